"""The scheduler's slice of the frozen config tree (a plain dataclass: no pydantic here)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits of the continuous-batching policy; the number of KV blocks is learned at run time."""

    max_model_len: int  # tokens, prompt + output, per sequence
    block_size: int = 16  # tokens per KV block
    max_num_seqs: int = 256  # sequences in one step
    max_num_batched_tokens: int = 2048  # tokens in one step (prefill chunks + decodes)
    enable_prefix_caching: bool = True
    scheduling_policy: Literal["fcfs", "priority"] = "fcfs"
    max_num_waiting: int | None = None  # admission bound; None = unbounded
    # Keep the prefix cache's changes as KV deltas, for a cache-aware router (kv_events.py).
    enable_kv_cache_events: bool = False
    # Save every full block to the node's host KV tier as it is computed, not only as the pool
    # evicts it (a restarted or migrated-to engine then finds the pool's blocks too).
    kv_offloading_write_through: bool = False
    # LoRA adapters: requests may name one; `max_loras` of them run in one step (lora_slots.py).
    enable_lora: bool = False
    max_loras: int = 1

    def __post_init__(self) -> None:
        for name in (
            "max_model_len",
            "block_size",
            "max_num_seqs",
            "max_num_batched_tokens",
            "max_loras",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be at least 1, got {getattr(self, name)}")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(
                f"scheduling_policy: must be 'fcfs' or 'priority', got {self.scheduling_policy!r}"
            )
