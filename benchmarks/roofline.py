"""Against the machine's limits: decode against the memory-bandwidth bound, prefill against the
measured GEMM peak, on the model shapes users run.

First it measures this machine: memory bandwidth as a STREAM-like copy (and a plain read, what
decode does to its weights) over buffers far larger than the caches, and the GEMM peak as the
best FLOP/s torch's `linear` (oneDNN) reaches at the model's own projection shapes, in the model's
dtype, on all the cores. Then it runs the engine offline (`LLM`, prefix caching off, so that
every token is computed) and prints, per batch size:

- decode: the step time against its bound, the larger of its memory time (the bytes a step
  must read, the weights once and each sequence's KV, over the copy bandwidth) and its compute
  time (its FLOPs at the GEMM peak), as a share of the step, and which of the two bounds it;
- prefill: the FLOP/s achieved (2 × the projections' weights × tokens, the attention's causal
  products, and the LM head for each prompt's last token) as a share of the GEMM peak.

A decode step time is (generate with 1 + D tokens − generate with 1 token) / D, the median of
`--repeats`, on fresh prompts each time.

    .venv/bin/python benchmarks/roofline.py --preset qwen2.5-0.5b --dtype bfloat16
    .venv/bin/python benchmarks/roofline.py --preset llama-3.2-1b --dtype bfloat16
    .venv/bin/python benchmarks/roofline.py --model DIR        # any checkpoint
    .venv/bin/python benchmarks/roofline.py --quick            # the small model, a smoke run
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from pagedray import LLM, SamplingParams
from pagedray.tools.default_model import PRESET_ARCHS, default_model_path
from pagedray.workers.model_config import ModelConfig

# Buffers for the bandwidth test: far past any last-level cache.
BANDWIDTH_BYTES = 1 << 30
# Tokens per GEMM when measuring its peak (a prefill chunk's worth).
GEMM_TOKENS = (256, 512, 1024)


@dataclass(frozen=True)
class Machine:
    copy_gbps: float  # bytes read + written per second, 1e9
    read_gbps: float
    gemm_tflops: float  # the best of the model's shapes
    threads: int


@dataclass(frozen=True)
class ModelCost:
    """What a step must move and compute, from the checkpoint's own tensors."""

    decode_weight_bytes: int  # every weight a decode step reads: all but the embedding's rows
    layer_linear_params: int  # the projections of all layers (per token, 2 FLOPs each)
    lm_head_params: int
    kv_bytes_per_token: int  # K and V of every layer, per token of context
    attention_width: int  # heads × head_dim × layers (per query-key pair, 2 FLOPs each, twice)


def best_seconds(fn, repeats: int) -> float:  # type: ignore[no-untyped-def]
    fn()  # warm: page faults, oneDNN's primitive for the shape
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def measure_machine(config: ModelConfig, repeats: int) -> Machine:
    copy_gbps, read_gbps = _bandwidth(repeats)
    dtype = config.dtype
    hidden, heads, kv, head_dim = (
        config.hidden_size,
        config.num_attention_heads,
        config.num_key_value_heads,
        config.head_dim,
    )
    shapes = {  # (N, K) of each projection: out features, in features
        "qkv": ((heads + 2 * kv) * head_dim, hidden),
        "o": (hidden, heads * head_dim),
        "gate_up": (2 * config.intermediate_size, hidden),
        "down": (hidden, config.intermediate_size),
    }
    best = 0.0
    for n, k in shapes.values():
        weight = torch.randn(n, k, dtype=dtype)
        for m in GEMM_TOKENS:
            x = torch.randn(m, k, dtype=dtype)
            seconds = best_seconds(lambda: F.linear(x, weight), repeats)  # noqa: B023
            best = max(best, 2 * m * n * k / seconds)
    return Machine(copy_gbps, read_gbps, best / 1e12, torch.get_num_threads())


def _bandwidth(repeats: int) -> tuple[float, float]:
    """GB/s of a copy (bytes read and written) and of a read (a sum), over 1 GiB buffers."""
    src = torch.ones(BANDWIDTH_BYTES // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    copy_s = best_seconds(lambda: dst.copy_(src), repeats)
    read_s = best_seconds(lambda: src.sum(), repeats)
    return 2 * BANDWIDTH_BYTES / copy_s / 1e9, BANDWIDTH_BYTES / read_s / 1e9


def model_cost(path: Path, config: ModelConfig) -> ModelCost:
    from safetensors import safe_open

    sizes: dict[str, int] = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(file, "pt") as tensors:
            for name in tensors.keys():  # noqa: SIM118 - safe_open has no __iter__
                sizes[name] = tensors.get_slice(name).get_shape()
    numel = {name: _product(shape) for name, shape in sizes.items()}
    itemsize = torch.empty(0, dtype=config.dtype).element_size()
    embed = sum(v for k, v in numel.items() if "embed_tokens" in k)
    lm_head = sum(v for k, v in numel.items() if k.startswith("lm_head")) or embed  # tied
    layers = sum(
        v
        for k, v in numel.items()
        if ".layers." in k and k.endswith("weight") and v > config.hidden_size
    )
    total = sum(numel.values())
    # The LM head is read whole each step; the embedding only for the batch's tokens.
    decode_params = total - embed + (lm_head if "lm_head.weight" not in numel else 0)
    kv_per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim
    width = config.num_attention_heads * config.head_dim * config.num_hidden_layers
    return ModelCost(decode_params * itemsize, layers, lm_head, kv_per_token * itemsize, width)


def decode_flops(cost: ModelCost, batch: int, context: float) -> float:
    """FLOPs of a decode step of `batch` sequences of `context` tokens: each token's projections
    and LM head, and its query against every cached key and value."""
    per_token = 2 * (cost.layer_linear_params + cost.lm_head_params)
    return batch * (per_token + 2 * 2 * cost.attention_width * context)


def _product(shape: list[int]) -> int:
    result = 1
    for dim in shape:
        result *= dim
    return result


def _prompts(batch: int, length: int, vocab: int, seed: int) -> list[dict[str, list[int]]]:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(10, vocab - 10, (batch, length), generator=generator)
    return [{"prompt_token_ids": row.tolist()} for row in ids]


def timed_generate(llm: LLM, prompts: list[dict[str, list[int]]], max_tokens: int) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start


def main() -> None:
    args = parse_args()
    if args.model is not None:
        path = Path(args.model)
    else:
        preset = "small" if args.quick else args.preset
        arch = PRESET_ARCHS.get(preset, "llama")
        path = default_model_path(arch, preset, args.dtype)
    config = ModelConfig.from_pretrained(path)
    cost = model_cost(path, config)
    machine = measure_machine(config, args.repeats)
    print(
        f"model {path.name} ({config.dtype}): {cost.decode_weight_bytes / 1e9:.2f} GB of weights "
        f"a decode step reads, KV {cost.kv_bytes_per_token / 1e3:.1f} kB per token"
    )
    print(
        f"machine: {machine.threads} threads, copy {machine.copy_gbps:.1f} GB/s "
        f"(read {machine.read_gbps:.1f}), GEMM peak {machine.gemm_tflops:.2f} TFLOP/s "
        f"({config.dtype}, the model's projection shapes)"
    )
    batches = (1, 4) if args.quick else tuple(args.batches)
    max_batch = max(max(batches), max(args.prefill_batches))
    llm = LLM(
        str(path),
        enable_prefix_caching=False,
        max_num_seqs=max(max_batch, 8),
        max_num_batched_tokens=max(args.prefill_len * max(args.prefill_batches), 2048),
        max_model_len=args.prefill_len + args.decode_tokens + 64,
    )
    vocab = config.vocab_size
    seed = iter(range(10**6))
    print(f"decode (prompt {args.prompt_len} tokens, {args.decode_tokens} generated):")
    # A step can go no faster than its bytes at the memory bandwidth, nor its FLOPs at the GEMM
    # peak: the bound is the larger (a roofline), and which one it is shows where the step sits
    # (a large batch on a CPU with a low GEMM peak is compute-bound). The memory time is taken at
    # the copy bandwidth (STREAM's convention); a plain read may run faster, so the share of the
    # bound at the read bandwidth is printed too, as the stricter figure. The bandwidth is measured
    # again beside each batch's steps: a shared VM's moved by 35-57 GB/s within one session.
    print(
        "  batch   step ms   copy GB/s   memory ms   compute ms  of bound   of read bound", end=""
    )
    print("   bound by")
    for batch in batches:
        steps = []
        for _ in range(args.repeats):
            one = timed_generate(llm, _prompts(batch, args.prompt_len, vocab, next(seed)), 1)
            many = timed_generate(
                llm, _prompts(batch, args.prompt_len, vocab, next(seed)), 1 + args.decode_tokens
            )
            steps.append((many - one) / args.decode_tokens)
        step = statistics.median(steps)
        copy_gbps, read_gbps = _bandwidth(args.repeats)
        context = args.prompt_len + args.decode_tokens / 2
        read = cost.decode_weight_bytes + batch * context * cost.kv_bytes_per_token
        memory = read / (copy_gbps * 1e9)
        compute = decode_flops(cost, batch, context) / (machine.gemm_tflops * 1e12)
        bound, read_bound = max(memory, compute), max(read / (read_gbps * 1e9), compute)
        print(
            f"  {batch:5d}  {step * 1e3:8.2f}  {copy_gbps:10.1f}  {memory * 1e3:10.2f}"
            f"  {compute * 1e3:11.2f}"
            f"  {bound / step:8.0%}  {read_bound / step:14.0%}"
            f"   {'memory' if memory >= compute else 'compute'}"
        )
    print(f"prefill ({args.prefill_len} tokens a prompt, the first token only):")
    print("  batch   tokens/s   TFLOP/s   of peak")
    for batch in args.prefill_batches if not args.quick else (1,):
        length = args.prefill_len
        times = [
            timed_generate(llm, _prompts(batch, length, vocab, next(seed)), 1)
            for _ in range(args.repeats)
        ]
        seconds = statistics.median(times)
        tokens = batch * length
        flops = 2 * cost.layer_linear_params * tokens + 2 * cost.lm_head_params * batch
        flops += 2 * 2 * cost.attention_width * batch * length * (length + 1) // 2
        achieved = flops / seconds / 1e12
        print(
            f"  {batch:5d}  {tokens / seconds:9.0f}  {achieved:8.2f}  "
            f"{achieved / machine.gemm_tflops:7.0%}"
        )


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="qwen2.5-0.5b", help="a make-model preset")
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    parser.add_argument("--model", default=None, help="a checkpoint directory instead")
    parser.add_argument("--quick", action="store_true", help="the small model, two batch sizes")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--prefill-batches", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--prompt-len", type=int, default=128, help="decode's prompts")
    parser.add_argument("--prefill-len", type=int, default=512)
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--threads", type=int, default=os.cpu_count() or 1, help="torch threads (all cores)"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    return args


if __name__ == "__main__":
    main()
