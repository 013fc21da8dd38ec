"""The interface every attention implementation offers the model: its three paged operations,
and what decides the bits they compute.

Apart from the selection (backend.py), so that the implementations (cpu_backend.py,
triton_backend.py), which the selection imports, need not import it back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


@dataclass(frozen=True)
class AttentionBackend:
    """The three paged operations a model step needs, bound to one implementation.

    `arithmetic()` names what decides the bits of the K/V blocks an engine computes with it (the
    kernels, their build for this CPU or device, the settings that choose between them, torch's
    version for the GEMMs): engines whose names differ may compute a block to other bits, so
    they must not read each other's blocks where outputs are meant to be the same (the node's
    host and disk KV tiers, pulls between replicas)."""

    name: str
    store_kv: Callable[..., None]  # (key, value, key_cache, value_cache, slot_mapping)
    paged_attention: Callable[..., torch.Tensor]  # (query, key_cache, value_cache, metadata, scale)
    copy_blocks: Callable[..., None]  # (kv_cache, src_block_ids, dst_block_ids)
    arithmetic: Callable[[], str]
