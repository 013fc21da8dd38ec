"""Ray bootstrap and the engine's placement group: one bundle for the engine, one per TP rank.

The ranks of one engine exchange an all-reduce per layer, so they must share a node (STRICT_PACK).
A Serve replica deployed with `placement_group_bundles` already sits in bundle 0 of such a group;
then the workers take bundles 1..TP of it, and only a group created here is removed at release.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.util.placement_group import (
    PlacementGroup,
    get_current_placement_group,
    remove_placement_group,
)
from ray.util.placement_group import placement_group as create_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

# Bundle 0 holds the engine (the scheduler actor, or the process driving an offline `LLM`).
ENGINE_BUNDLE_INDEX = 0
# How long to wait for the cluster to grant a newly requested group before giving up.
PLACEMENT_TIMEOUT_S = 120.0


def ensure_ray(address: str | None = None, min_cpus: int = 1) -> None:
    """Start or join Ray unless this process is already connected.

    Args:
        address: None starts a local Ray; "auto" (or "ray://...", "host:port") joins a cluster.
        min_cpus: logical CPUs a local Ray must offer, at least `1 + tensor_parallel_size` so
            the engine's placement group fits even on a machine with fewer cores.
    """
    if ray.is_initialized():
        return
    if address is None:
        ray.init(num_cpus=max(os.cpu_count() or 1, min_cpus), include_dashboard=False)
    else:
        ray.init(address=address)


def engine_bundles(tensor_parallel_size: int, use_gpu: bool) -> list[dict[str, float]]:
    """The bundles of one engine: the engine's own, then one per rank (1 GPU each on GPU)."""
    rank_bundle: dict[str, float] = {"GPU": 1, "CPU": 1} if use_gpu else {"CPU": 1}
    head: dict[str, float] = {"CPU": 1}
    return [head] + [dict(rank_bundle) for _ in range(tensor_parallel_size)]


@dataclass
class EnginePlacement:
    """Where an engine's workers go: bundle `worker_bundle_indices[rank]` of `placement_group`."""

    placement_group: PlacementGroup
    worker_bundle_indices: list[int]  # bundle index per TP rank
    use_gpu: bool  # ranks own one GPU each
    owned: bool  # created here, so removed by `release()`
    released: bool = field(default=False, init=False)

    def scheduling_strategy(self, rank: int) -> PlacementGroupSchedulingStrategy:
        return PlacementGroupSchedulingStrategy(
            placement_group=self.placement_group,
            placement_group_bundle_index=self.worker_bundle_indices[rank],
        )

    def release(self) -> None:
        """Remove the group if it was created here; safe to call more than once."""
        if self.owned and not self.released:
            remove_placement_group(self.placement_group)
        self.released = True


def resolve_use_gpu(device: str, placement_group: PlacementGroup | None = None) -> bool:
    """Whether ranks run on GPUs: "auto" follows the group's rank bundles, else the cluster."""
    if device != "auto":
        return device == "cuda"
    if placement_group is not None:
        specs = placement_group.bundle_specs
        return len(specs) > 1 and specs[1].get("GPU", 0) >= 1
    return ray.cluster_resources().get("GPU", 0) >= 1


def reserve_placement(
    tensor_parallel_size: int,
    device: str = "auto",
    placement_group: PlacementGroup | None = None,
) -> EnginePlacement:
    """Use `placement_group`, else the caller's current group, else create one (and own it).

    Raises:
        ValueError: a given or current group has too few bundles, or bundles without the
            resources a rank needs.
        TimeoutError: the cluster cannot grant a new group within `PLACEMENT_TIMEOUT_S`.
    """
    group = placement_group or get_current_placement_group()
    if group is not None:
        use_gpu = resolve_use_gpu(device, group)
        _check_bundles(group.bundle_specs, tensor_parallel_size, use_gpu)
        indices = list(range(1, tensor_parallel_size + 1))
        return EnginePlacement(group, indices, use_gpu, owned=False)
    use_gpu = resolve_use_gpu(device)
    bundles = engine_bundles(tensor_parallel_size, use_gpu)
    group = create_placement_group(bundles, strategy="STRICT_PACK")
    try:
        ray.get(group.ready(), timeout=PLACEMENT_TIMEOUT_S)
    except ray.exceptions.GetTimeoutError as error:
        remove_placement_group(group)
        raise TimeoutError(
            f"tensor_parallel_size={tensor_parallel_size}: no node can hold {bundles} "
            f"(STRICT_PACK) within {PLACEMENT_TIMEOUT_S:.0f} s"
        ) from error
    return EnginePlacement(group, list(range(1, len(bundles))), use_gpu, owned=True)


def _check_bundles(specs: list[dict[str, Any]], tensor_parallel_size: int, use_gpu: bool) -> None:
    needed = 1 + tensor_parallel_size
    if len(specs) < needed:
        raise ValueError(
            f"placement group has {len(specs)} bundles; tensor_parallel_size="
            f"{tensor_parallel_size} needs {needed} (the engine's, then one per rank)"
        )
    for index in range(1, needed):
        if specs[index].get("CPU", 0) < 1 or (use_gpu and specs[index].get("GPU", 0) < 1):
            wanted = engine_bundles(1, use_gpu)[1]
            raise ValueError(
                f"placement group bundle {index} is {specs[index]}; a rank needs {wanted}"
            )
