"""The decode-kernel table: pagedray's Triton paged decode against the device's copy bandwidth,
beside PyTorch's SDPA over the same cache gathered dense and `flex_attention` with a block mask.

Decode reads every cached K and V once per step, so its ceiling is memory bandwidth: each row
gives the time per step, the K/V bytes read, the bandwidth that makes, and its ratio to what a
plain device copy achieves (read + write). Llama-3-8B's attention shape (32 query heads, 8 KV
heads, head size 128, bf16), block size 16, a shuffled block table.

    python benchmarks/gpu/decode_table.py --json out.json            # on a GPU
    python benchmarks/gpu/decode_table.py --json out.json --dry-run  # tiny, on the CPU (torch)
"""

from __future__ import annotations

import argparse
import json
import math
import time
from typing import Any, Callable

import torch

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
BATCHES, CONTEXTS = (1, 32, 128), (1024, 8192, 32768)
DRY_BATCHES, DRY_CONTEXTS = (1, 2), (64, 256)


def timed(fn: Callable[[], Any], device: torch.device, iters: int) -> float:
    """Median seconds of `fn` over `iters` runs after a warm-up (CUDA events on a GPU)."""
    fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            begin = time.perf_counter()
            fn()
            times.append(time.perf_counter() - begin)
    return sorted(times)[len(times) // 2]


def copy_bandwidth(device: torch.device, num_bytes: int) -> float:
    """Bytes per second a device-to-device copy moves (each byte read once, written once)."""
    src = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    seconds = timed(lambda: dst.copy_(src), device, iters=10)
    return 2 * num_bytes / seconds


def decode_row(
    batch: int, context: int, device: torch.device, dtype: torch.dtype, dry_run: bool
) -> dict[str, Any]:
    """One (batch, context) cell: the three implementations' times over one random cache."""
    from pagedray.attention import torch_ref
    from pagedray.attention.metadata import AttentionMetadata
    from pagedray.attention.triton_decode import decode_attention

    blocks_per_seq = math.ceil(context / BLOCK_SIZE)
    num_blocks = batch * blocks_per_seq + 1  # block 0 is never used, as in the engine
    shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    key_cache = torch.randn(shape, device=device, dtype=dtype)
    value_cache = torch.randn(shape, device=device, dtype=dtype)
    block_tables = (1 + torch.randperm(num_blocks - 1, device=device)).to(torch.int32)
    block_tables = block_tables.view(batch, blocks_per_seq)  # [batch, blocks_per_seq]
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    query = torch.randn(batch, NUM_HEADS, HEAD_DIM, device=device, dtype=dtype)
    scale = HEAD_DIM**-0.5
    kv_bytes = 2 * batch * context * NUM_KV_HEADS * HEAD_DIM * key_cache.element_size()
    iters = 3 if dry_run else 20
    row: dict[str, Any] = {"batch": batch, "context": context, "kv_bytes": kv_bytes}

    if device.type == "cuda":
        paged = lambda: decode_attention(  # noqa: E731
            query, key_cache, value_cache, block_tables, seq_lens, context, scale
        )
        row["paged_impl"] = "triton"
    else:  # the dry run: the torch reference over the same paged cache
        metadata = AttentionMetadata(
            slot_mapping=torch.empty(0, dtype=torch.int64),
            query_start_loc=torch.arange(batch + 1, dtype=torch.int32),
            seq_lens=seq_lens,
            block_tables=block_tables,
            max_query_len=1,
            max_seq_len=context,
            query_start_loc_cpu=list(range(batch + 1)),
            seq_lens_cpu=[context] * batch,
        )
        paged = lambda: torch_ref.paged_attention(  # noqa: E731
            query, key_cache, value_cache, metadata, scale
        )
        row["paged_impl"] = "torch reference"
    row["paged_s"] = timed(paged, device, iters)

    # The same cache gathered dense: [batch, kv_heads, context, head_dim].
    def dense(cache: torch.Tensor) -> torch.Tensor:
        gathered = cache[block_tables.long()]  # [batch, blocks_per_seq, block, kv_heads, dim]
        gathered = gathered.flatten(1, 2)[:, :context]
        return gathered.transpose(1, 2).contiguous()

    keys, values = dense(key_cache), dense(value_cache)  # the largest cell: 2 x 16 GiB more
    q4 = query.unsqueeze(2)  # [batch, heads, 1, head_dim]
    sdpa = torch.nn.functional.scaled_dot_product_attention
    row["sdpa_s"] = timed(
        lambda: sdpa(q4, keys, values, scale=scale, enable_gqa=True), device, iters
    )
    row["flex_s"], row["flex_note"] = _flex(
        q4, keys, values, scale, context, device, iters, dry_run
    )
    return row


def _flex(
    q4: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    scale: float,
    context: int,
    device: torch.device,
    iters: int,
    dry_run: bool,
) -> tuple[float | None, str]:
    """flex_attention (compiled) with a block mask keeping each sequence's own length."""
    if dry_run or device.type != "cuda":
        return None, "skipped: flex_attention is timed on a GPU only"
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        def within(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
            return kv_idx < context

        mask = create_block_mask(within, None, None, q4.shape[2], context, device=device)
        compiled = torch.compile(flex_attention, dynamic=False)

        def run() -> torch.Tensor:
            return compiled(q4, keys, values, block_mask=mask, scale=scale, enable_gqa=True)

        return timed(run, device, iters), "compiled, block mask"
    except Exception as exc:  # noqa: BLE001 - a failure is a finding to report, not a crash
        return None, f"failed: {type(exc).__name__}: {str(exc)[:160]}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", required=True, help="where to write the rows")
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.dry_run else "cpu")
    dtype = torch.bfloat16
    batches, contexts = (DRY_BATCHES, DRY_CONTEXTS) if args.dry_run else (BATCHES, CONTEXTS)
    copy_bps = copy_bandwidth(device, (1 << 24) if args.dry_run else (1 << 32))
    result: dict[str, Any] = {"device": str(device), "copy_bytes_per_s": copy_bps, "rows": []}
    for batch in batches:
        for context in contexts:
            row = decode_row(batch, context, device, dtype, args.dry_run)
            row["paged_bytes_per_s"] = row["kv_bytes"] / row["paged_s"]
            row["paged_vs_copy"] = row["paged_bytes_per_s"] / copy_bps
            result["rows"].append(row)
            with open(args.json, "w") as out:  # after every row: a timeout keeps what ran
                json.dump(result, out, indent=2)
            print(json.dumps(row), flush=True)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
