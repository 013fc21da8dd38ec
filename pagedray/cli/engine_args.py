"""The engine's flags, shared by `pagedray generate` and `pagedray serve`, and the engine
settings they make."""

from __future__ import annotations

import argparse
from typing import Any

from pagedray.cli.vllm_flags import DTYPE_ALIASES, DTYPES, human_readable_int, max_model_len


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Engine flags shared by `generate` and `serve`: vLLM's names and values where it has the
    setting (`--dtype half`, `--max-model-len 32k`, `--enable-prefix-caching` and its `--no-`)."""
    parser.add_argument("model", nargs="?", default=None, help="HF checkpoint dir (default: built)")
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-kv-blocks", "--num-gpu-blocks-override", type=int, default=None)
    kv_memory = parser.add_mutually_exclusive_group()
    kv_memory.add_argument(
        "--kv-cache-memory-gb", type=float, default=None, help="the KV pool per rank, in GiB"
    )
    kv_memory.add_argument(
        "--kv-cache-memory-bytes",
        type=human_readable_int,
        default=None,
        help="the KV pool per rank, in bytes (vLLM's spelling: 40G, 8.5g)",
    )
    parser.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=None,
        help="CUDA: the share of device memory a rank may use, weights included (default 0.9)",
    )
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=human_readable_int, default=2048)
    parser.add_argument(
        "--max-model-len",
        type=max_model_len,
        default=None,
        help="context limit: 8192, 32k (default, or auto: the model's, capped by the KV pool)",
    )
    parser.add_argument(
        "--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True
    )
    parser.add_argument("--dtype", default="auto", choices=DTYPES)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--scheduling-policy",
        default="fcfs",
        choices=["fcfs", "priority"],
        help="admission order: arrival, or each request's `priority` (lower first)",
    )


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    kv_cache_memory_gb = args.kv_cache_memory_gb
    if args.kv_cache_memory_bytes is not None:
        kv_cache_memory_gb = args.kv_cache_memory_bytes / 2**30
    kwargs = dict(
        tensor_parallel_size=args.tensor_parallel_size,
        block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks,
        kv_cache_memory_gb=kv_cache_memory_gb,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        enable_prefix_caching=args.enable_prefix_caching,
        dtype=DTYPE_ALIASES.get(args.dtype, args.dtype),
        seed=args.seed,
        scheduling_policy=args.scheduling_policy,
    )
    if args.gpu_memory_utilization is not None:  # else EngineConfig's default
        kwargs["gpu_memory_utilization"] = args.gpu_memory_utilization
    return kwargs
