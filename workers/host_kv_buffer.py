"""One rank's side of the node's host KV tier: where the file is, how large, and the copies.

The scheduler decides which blocks move (scheduler/host_kv_tier.py); each rank copies its own
shard of them between its KV pool and the tier's slots, all blocks of a step in one gather and
one scatter. A slot holds one block over every layer, K and V, contiguous per rank, so a copy
is a few large transfers rather than one per layer.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path

import torch

from pagedray.scheduler.host_kv_tier import create_or_open, read_layout

logger = logging.getLogger(__name__)

# Where tier files live: shared memory when the node has it (it outlives the engines, as a
# restarted replica should find its blocks), else the temporary directory.
TIER_DIR_ENV = "PAGEDRAY_KV_TIER_DIR"
# Without `kv_offloading_size`, the tier takes at most this share of the memory available at
# start, and this much in all: the file is sparse, its memory taken as blocks are written.
AUTO_MEMORY_SHARE = 0.25
AUTO_MAX_BYTES = 8 * 1024**3


def tier_dir() -> Path:
    configured = os.environ.get(TIER_DIR_ENV)
    if configured:
        return Path(configured)
    shm = Path("/dev/shm")
    return shm if shm.is_dir() else Path(tempfile.gettempdir())


def tier_path(model: str, dtype: torch.dtype, rank_kv_shape: tuple[int, ...], tp: int) -> Path:
    """The tier file of one model layout: engines that can read each other's blocks (same
    weights, dtype, block shape and rank count) share it; any other shares nothing."""
    model_dir = Path(model).resolve()
    weights = sorted(
        (path.name, path.stat().st_size, path.stat().st_mtime_ns)
        for path in model_dir.glob("*.safetensors")
    )
    identity = json.dumps([str(model_dir), weights, str(dtype), list(rank_kv_shape), tp])
    digest = hashlib.sha256(identity.encode()).hexdigest()[:16]
    return tier_dir() / f"pagedray-kv-{digest}.tier"


def tier_bytes(requested_gib: float | None, directory: Path) -> int:
    """The tier's size: `requested_gib` as given (0: none), else a share of what is free."""
    if requested_gib is not None:
        return int(requested_gib * 1024**3)
    available = _available_memory()
    free_on_disk = os_free_bytes(directory)
    return int(min(AUTO_MAX_BYTES, AUTO_MEMORY_SHARE * available, 0.5 * free_on_disk))


def os_free_bytes(directory: Path) -> int:
    stat = os.statvfs(directory)
    return stat.f_bavail * stat.f_frsize


def _available_memory() -> int:
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class HostKVBuffer:
    """The tier's slots as a tensor of this rank's shards: [slot, layer, K/V, token, head, dim]."""

    def __init__(self, path: str, rank: int, tp: int, kv_cache: torch.Tensor) -> None:
        layout = read_layout(path)
        num_layers, kv, _, block_size, heads, head_dim = kv_cache.shape
        shard_shape = (num_layers, kv, block_size, heads, head_dim)
        rank_bytes = kv_cache.element_size() * int(torch.Size(shard_shape).numel())
        if layout.slot_bytes != rank_bytes * tp:
            raise ValueError(f"{path}: slots of {layout.slot_bytes} bytes, expected {rank_bytes}")
        raw = torch.from_file(path, shared=True, size=layout.file_bytes, dtype=torch.uint8)
        data = raw[layout.data_offset :].view(kv_cache.dtype)
        self.slots = data.view(layout.num_slots, tp, *shard_shape)[:, rank]
        self.device = kv_cache.device

    def save(self, kv_cache: torch.Tensor, pairs: list[tuple[int, int]]) -> None:
        """Copy (pool block, slot) pairs from the pool into the tier."""
        block_ids, slots = zip(*pairs)
        gathered = kv_cache.index_select(2, self._index(block_ids, kv_cache.device))
        self.slots.index_copy_(
            0, self._index(slots, torch.device("cpu")), gathered.permute(2, 0, 1, 3, 4, 5).cpu()
        )

    def load(self, kv_cache: torch.Tensor, pairs: list[tuple[int, int]]) -> None:
        """Copy (slot, pool block) pairs from the tier into the pool."""
        slots, block_ids = zip(*pairs)
        gathered = self.slots.index_select(0, self._index(slots, torch.device("cpu")))
        kv_cache.index_copy_(
            2,
            self._index(block_ids, kv_cache.device),
            gathered.permute(1, 2, 0, 3, 4, 5).to(kv_cache.device),
        )

    @staticmethod
    def _index(ids: tuple[int, ...], device: torch.device) -> torch.Tensor:
        return torch.tensor(ids, dtype=torch.long, device=device)


def open_host_tier(
    model: str,
    requested_gib: float | None,
    rank: int,
    tp: int,
    kv_cache: torch.Tensor,
) -> tuple[str, HostKVBuffer] | None:
    """This rank's buffer on the node's tier for this model layout (created at the size the
    config asks, or as `tier_bytes` finds room for), with the file's path; None when the tier
    is off or no block fits."""
    shard_shape = (kv_cache.shape[0], kv_cache.shape[1], *kv_cache.shape[3:])
    path = tier_path(model, kv_cache.dtype, shard_shape, tp)
    slot_bytes = kv_cache.element_size() * int(torch.Size(shard_shape).numel()) * tp
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        num_slots = tier_bytes(requested_gib, path.parent) // slot_bytes
        if num_slots < 1:
            return None
        layout = create_or_open(str(path), num_slots, slot_bytes)
        buffer = HostKVBuffer(str(path), rank, tp, kv_cache)
    except OSError as exc:
        logger.warning("host KV tier off: %s cannot be used (%s)", path, exc)
        return None
    if rank == 0:
        logger.info(
            "host KV tier: %s, %d blocks, %.2f GiB, shared by this model's engines on the node",
            path,
            layout.num_slots,
            layout.num_slots * slot_bytes / 1024**3,
        )
    return str(path), buffer
