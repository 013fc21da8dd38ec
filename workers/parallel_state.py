"""The tensor-parallel group one worker belongs to, and the two collectives the layers use.

Layers take a `TensorParallelGroup` explicitly instead of reading global state, so a TP=1 model
and a TP=2 model can live in one process (the tests compare them that way). At world size 1 the
collectives are no-ops and torch.distributed is never initialised.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TensorParallelGroup:
    """This rank's place in its tensor-parallel group."""

    rank: int
    world_size: int
    group: dist.ProcessGroup | None = None  # None at world size 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over ranks in place; returns it for chaining."""
        if self.world_size == 1:
            return x
        dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's `x` along `dim`, in rank order."""
        if self.world_size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x, group=self.group)
        return torch.cat(parts, dim=dim)


def init_tensor_parallel(
    rank: int, world_size: int, init_method: str, backend: str = "gloo"
) -> TensorParallelGroup:
    """Join the process group of one engine's workers.

    Args:
        rank: this worker's rank, 0..world_size - 1.
        world_size: tensor-parallel size; 1 skips torch.distributed entirely.
        init_method: rendezvous address chosen by the caller, e.g. "tcp://10.0.0.1:29517".
        backend: "gloo" (CPU) or "nccl" (CUDA; the caller selects this rank's device first).
    """
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside world size {world_size}")
    if world_size == 1:
        return TensorParallelGroup(rank=0, world_size=1)
    dist.init_process_group(
        backend=backend, init_method=init_method, rank=rank, world_size=world_size
    )
    return TensorParallelGroup(rank=rank, world_size=world_size, group=dist.group.WORLD)


def destroy() -> None:
    """Leave the process group, if one was joined; safe to call more than once."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
