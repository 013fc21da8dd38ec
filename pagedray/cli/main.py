"""`pagedray` command line: build the default model, generate offline, serve, push dashboards."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from pagedray.cli.dashboard import add_dashboard_parser
from pagedray.cli.serve import add_serve_parser
from pagedray.cli.vllm_flags import DTYPE_ALIASES, DTYPES, human_readable_int, max_model_len


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pagedray", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    _add_make_model(commands)
    _add_generate(commands)
    add_serve_parser(commands)
    add_dashboard_parser(commands)
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


def _add_make_model(commands: Any) -> None:
    from pagedray.tools.default_model import ARCHS, PRESETS

    parser = commands.add_parser("make-model", help="write a seeded random HF checkpoint, offline")
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--arch", choices=ARCHS, default="llama")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    parser.add_argument("--seed", type=int, default=0)
    parser.set_defaults(func=_run_make_model)


def _run_make_model(args: argparse.Namespace) -> int:
    from pagedray.tools.default_model import make_model

    path = make_model(args.out, arch=args.arch, preset=args.preset, seed=args.seed)
    print(path)
    return 0


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


def _add_generate(commands: Any) -> None:
    parser = commands.add_parser("generate", help="generate offline for prompts, print JSON lines")
    add_engine_args(parser)
    parser.add_argument("--prompt", action="append", help="a prompt (repeatable); default: stdin")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("-n", type=int, default=1)
    parser.set_defaults(func=_run_generate)


def _run_generate(args: argparse.Namespace) -> int:
    from pagedray import LLM, SamplingParams

    prompts = args.prompt or [line.rstrip("\n") for line in sys.stdin if line.strip()]
    try:
        params = SamplingParams(
            n=args.n, max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p
        )
        llm = LLM(args.model, **engine_kwargs(args))
        outputs = llm.generate(prompts, params)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    for output in outputs:
        record = {
            "prompt": output.prompt,
            "outputs": [
                {"text": o.text, "token_ids": o.token_ids, "finish_reason": o.finish_reason}
                for o in output.outputs
            ],
        }
        print(json.dumps(record))
    print(json.dumps({"stats": llm.stats()}), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
