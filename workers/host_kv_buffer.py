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
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
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


def tier_path(
    model: str,
    dtype: torch.dtype,
    rank_kv_shape: tuple[int, ...],
    tp: int,
    arithmetic: str,
    directory: Path | None = None,
) -> Path:
    """The tier file of one model layout in `directory` (default `tier_dir()`): engines that can
    read each other's blocks (same weights, dtype, block shape and rank count) and compute them
    to the same bits (`arithmetic`: the worker's, see workers/worker.py) share it; any other
    shares nothing. The file outlives the engines, so without the arithmetic a block computed
    by another build or setting (`PAGEDRAY_EXACT_ATTENTION`) would come back into a stream that
    must go on token-exact. The name ends in the arithmetic's own digest, which engines on other
    nodes compare before they hand blocks over (scheduler/kv_transfer.py's TierAddress)."""
    model_dir = Path(model).resolve()
    weights = sorted(
        (path.name, path.stat().st_size, path.stat().st_mtime_ns)
        for path in model_dir.glob("*.safetensors")
    )
    layout = json.dumps([str(model_dir), weights, str(dtype), list(rank_kv_shape), tp])
    digest = hashlib.sha256(layout.encode()).hexdigest()[:16]
    arithmetic_digest = hashlib.sha256(arithmetic.encode()).hexdigest()[:12]
    return (directory or tier_dir()) / f"pagedray-kv-{digest}-{arithmetic_digest}.tier"


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
    """This rank's part of the tier's slots, copied with `preadv`/`pwritev` on the file.

    The kernel copies between the file and the pool's own memory, one (layer, K/V) run of a
    block at a time, with no gather into a staging tensor and no mapping of the file: a first
    touch of each page of a mapping costs a fault, and a staging copy a second pass over the
    bytes; both together made the saves of the offline benchmark's run (1,500 blocks of 64 KiB)
    cost 250-350 ms of its 4 s. A run of consecutive slots (the tier's clock hands them out in
    order) goes in one call.
    """

    def __init__(self, path: str, rank: int, tp: int, kv_cache: torch.Tensor) -> None:
        layout = read_layout(path)
        num_layers, kv, _, block_size, heads, head_dim = kv_cache.shape
        self.shard_shape = (num_layers, kv, block_size, heads, head_dim)
        self.rank_bytes = kv_cache.element_size() * int(torch.Size(self.shard_shape).numel())
        if layout.slot_bytes != self.rank_bytes * tp:
            raise ValueError(
                f"{path}: slots of {layout.slot_bytes} bytes, expected {self.rank_bytes * tp}"
            )
        self.layout = layout
        self.rank = rank
        self.tp = tp
        self._file = open(path, "r+b", buffering=0)  # noqa: SIM115 - held for the rank's life
        self._fd = self._file.fileno()

    def save(self, kv_cache: torch.Tensor, pairs: list[tuple[int, int]]) -> None:
        """Copy (pool block, slot) pairs from the pool into the tier."""
        block_ids, slots = zip(*pairs)
        positions: Sequence[int]
        if kv_cache.is_cpu:
            source, positions = _chunks(kv_cache), block_ids
        else:  # a device pool: its blocks gathered to the host first
            index = torch.tensor(block_ids, dtype=torch.long, device=kv_cache.device)
            source, positions = _chunks(kv_cache.index_select(2, index).cpu()), range(len(slots))
        for run in self._runs(slots):
            parts = [c for i in run.positions for c in _parts(source, positions[i])]
            os.pwritev(self._fd, parts, run.offset)

    def load(self, kv_cache: torch.Tensor, pairs: list[tuple[int, int]]) -> None:
        """Copy (slot, pool block) pairs from the tier into the pool."""
        slots, block_ids = zip(*pairs)
        positions: Sequence[int]
        if kv_cache.is_cpu:
            target, positions = _chunks(kv_cache), block_ids
            staging = None
        else:
            shape = (*kv_cache.shape[:2], len(slots), *kv_cache.shape[3:])
            staging = torch.empty(shape, dtype=kv_cache.dtype)
            target, positions = _chunks(staging), range(len(slots))
        for run in self._runs(slots):
            parts = [c for i in run.positions for c in _parts(target, positions[i])]
            os.preadv(self._fd, parts, run.offset)
        if staging is not None:
            index = torch.tensor(block_ids, dtype=torch.long, device=kv_cache.device)
            kv_cache.index_copy_(2, index, staging.to(kv_cache.device))

    def _runs(self, slots: tuple[int, ...]) -> list[_Run]:
        """The slots as runs of consecutive ones (one run a slot when ranks share slots: this
        rank's parts of two slots are not adjacent), each within the kernel's iovec limit."""
        runs: list[_Run] = []
        per_call = max(1, _IOV_MAX // (self.shard_shape[0] * self.shard_shape[1]))
        start = 0
        for i in range(1, len(slots) + 1):
            ends = i == len(slots) or slots[i] != slots[i - 1] + 1 or self.tp > 1
            if ends or i - start == per_call:
                offset = self.layout.data_offset + slots[start] * self.layout.slot_bytes
                runs.append(_Run(range(start, i), offset + self.rank * self.rank_bytes))
                start = i
        return runs


@dataclass(frozen=True)
class _Run:
    positions: range  # indexes into the pairs
    offset: int  # file offset of this rank's part of the first slot


# Buffers one readv/writev call takes (Linux's IOV_MAX).
_IOV_MAX = 1024


def _chunks(kv_cache: torch.Tensor) -> np.ndarray:
    """The pool's bytes as [layer, K/V, block, bytes of one block's tokens]: each last-axis row
    is one (layer, K/V) run of a block, contiguous in the pool."""
    layers, kv, blocks = kv_cache.shape[:3]
    return kv_cache.view(torch.uint8).numpy().reshape(layers, kv, blocks, -1)


def _parts(chunks: np.ndarray, block: int) -> list[memoryview]:
    """One block's shard, in a slot's order (layer, then K/V), as buffers of the pool."""
    layers = range(chunks.shape[0])
    return [memoryview(chunks[layer, half, block]) for layer in layers for half in (0, 1)]


def open_tier(
    model: str,
    requested_gib: float | None,
    rank: int,
    tp: int,
    kv_cache: torch.Tensor,
    arithmetic: str,
    directory: Path | None = None,
    name: str = "host",
) -> tuple[str, HostKVBuffer] | None:
    """This rank's buffer on the node's `name` tier for this model layout, in `directory`
    (default: the host tier's, `tier_dir()`), created at the size the config asks or as
    `tier_bytes` finds room for; with the file's path. None when the tier is off or no block
    fits."""
    shard_shape = (kv_cache.shape[0], kv_cache.shape[1], *kv_cache.shape[3:])
    path = tier_path(model, kv_cache.dtype, shard_shape, tp, arithmetic, directory)
    slot_bytes = kv_cache.element_size() * int(torch.Size(shard_shape).numel()) * tp
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        num_slots = tier_bytes(requested_gib, path.parent) // slot_bytes
        if num_slots < 1:
            return None
        layout = create_or_open(str(path), num_slots, slot_bytes)
        buffer = HostKVBuffer(str(path), rank, tp, kv_cache)
    except OSError as exc:
        logger.warning("%s KV tier off: %s cannot be used (%s)", name, path, exc)
        return None
    if rank == 0:
        logger.info(
            "%s KV tier: %s, %d blocks, %.2f GiB, shared by this model's engines on the node",
            name,
            path,
            layout.num_slots,
            layout.num_slots * slot_bytes / 1024**3,
        )
        _warn_of_other_tiers(path)
    return str(path), buffer


def _warn_of_other_tiers(path: Path) -> None:
    """Tier files outlive their engines, and another model, layout, build or setting writes
    another: say how much memory the others hold, since nothing removes them."""
    others = [other for other in path.parent.glob("pagedray-kv-*.tier") if other != path]
    held = 0
    for other in others:
        try:
            held += other.stat().st_blocks * 512  # written pages: the files are sparse
        except OSError:
            continue  # removed meanwhile
    if held:
        logger.warning(
            "%d other KV tier files in %s hold %.2f GiB (other models, builds or settings); "
            "`rm %s/pagedray-kv-*.tier` frees them once no engine of theirs runs",
            len(others),
            path.parent,
            held / 1024**3,
            path.parent,
        )
