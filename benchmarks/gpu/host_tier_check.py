"""The host KV tier beside a GPU: how fast a rank saves blocks from its device pool into the
node's tier file and loads them back, against what a plain device-to-host copy moves.

A Llama-3.2-1B-like rank shard (16 layers, 8 KV heads, head size 64, bf16, block size 16) on the
device; the tier a file in /dev/shm as the engine makes it (scheduler/host_kv_tier.py), its
slots reserved by the scheduler's handle; `HostKVBuffer.save` / `load` (workers/
host_kv_buffer.py) for batches of blocks from a shuffled block table. Each row gives the time
per batch, GB/s, and the ratio to a pinned and to a pageable device-to-host copy of the same
bytes; every loaded block is checked bit-identical to the one saved.

    python benchmarks/gpu/host_tier_check.py --json out.json            # on a GPU
    python benchmarks/gpu/host_tier_check.py --json out.json --dry-run  # tiny, on the CPU
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import tempfile
import time
from typing import Any

import torch

from pagedray.scheduler.host_kv_tier import HostKVTier, create_or_open
from pagedray.workers.host_kv_buffer import HostKVBuffer

LAYERS, KV_HEADS, HEAD_DIM, BLOCK_SIZE, POOL_BLOCKS = 16, 8, 64, 16, 4096
BATCHES = (16, 128, 1024)
DRY = dict(layers=2, kv_heads=2, head_dim=16, pool_blocks=256, batches=(4, 32))


def synchronized(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def seconds(fn: Any, device: torch.device, iters: int = 5) -> float:
    """Median wall seconds of `fn`, device work included, after a warm-up."""
    fn()
    synchronized(device)
    times = []
    for _ in range(iters):
        begin = time.perf_counter()
        fn()
        synchronized(device)
        times.append(time.perf_counter() - begin)
    return sorted(times)[len(times) // 2]


def host_copy_gbps(device: torch.device, num_bytes: int, pinned: bool) -> float:
    src = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=pinned and device.type == "cuda")
    return num_bytes / seconds(lambda: dst.copy_(src, non_blocking=pinned), device) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", required=True)
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args()
    dry = args.dry_run or not torch.cuda.is_available()
    device = torch.device("cpu" if dry else "cuda")
    layers = DRY["layers"] if dry else LAYERS
    kv_heads = DRY["kv_heads"] if dry else KV_HEADS
    head_dim = DRY["head_dim"] if dry else HEAD_DIM
    pool_blocks = DRY["pool_blocks"] if dry else POOL_BLOCKS
    batches = DRY["batches"] if dry else BATCHES
    dtype = torch.bfloat16
    shape = (layers, 2, pool_blocks, BLOCK_SIZE, kv_heads, head_dim)
    pool = torch.randn(shape, device=device).to(dtype)
    block_bytes = pool[:, :, 0].numel() * pool.element_size()
    directory = tempfile.mkdtemp(dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    path = os.path.join(directory, "tier")
    rows: list[dict[str, Any]] = []
    try:
        create_or_open(path, 2 * max(batches), block_bytes)
        tier, buffer = HostKVTier(path), HostKVBuffer(path, 0, 1, pool)
        order = torch.randperm(pool_blocks).tolist()
        for count in batches:
            blocks = order[:count]
            reserved = tier.reserve([os.urandom(32) for _ in blocks])
            slots = [slot for _, slot in reserved]
            saves = list(zip(blocks, slots))
            save_s = seconds(functools.partial(buffer.save, pool, saves), device)
            targets = order[-count:]
            loads = list(zip(slots, targets))
            load_s = seconds(functools.partial(buffer.load, pool, loads), device)
            equal = bool(torch.equal(pool[:, :, targets], pool[:, :, blocks]))
            num_bytes = count * block_bytes
            pinned = host_copy_gbps(device, num_bytes, pinned=True)
            pageable = host_copy_gbps(device, num_bytes, pinned=False)
            rows.append(
                {
                    "blocks": count,
                    "mib": round(num_bytes / 2**20, 1),
                    "save_ms": round(save_s * 1e3, 2),
                    "load_ms": round(load_s * 1e3, 2),
                    "save_gbps": round(num_bytes / save_s / 1e9, 2),
                    "load_gbps": round(num_bytes / load_s / 1e9, 2),
                    "pinned_copy_gbps": round(pinned, 2),
                    "pageable_copy_gbps": round(pageable, 2),
                    "save_of_pinned": round(num_bytes / save_s / 1e9 / pinned, 3),
                    "bit_identical": equal,
                }
            )
            print(rows[-1], flush=True)
            tier.release(slots)
    finally:
        for name in os.listdir(directory):
            os.unlink(os.path.join(directory, name))
        os.rmdir(directory)
    with open(args.json, "w") as out:
        json.dump({"device": str(device), "block_bytes": block_bytes, "rows": rows}, out)
    if not all(row["bit_identical"] for row in rows):
        raise SystemExit("a loaded block differs from the one saved")


if __name__ == "__main__":
    main()
