"""The interface every attention implementation offers the model: its three paged operations.

Apart from the selection (backend.py), so that the implementations (cpu_backend.py,
triton_backend.py), which the selection imports, need not import it back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


@dataclass(frozen=True)
class AttentionBackend:
    """The three paged operations a model step needs, bound to one implementation."""

    name: str
    store_kv: Callable[..., None]  # (key, value, key_cache, value_cache, slot_mapping)
    paged_attention: Callable[..., torch.Tensor]  # (query, key_cache, value_cache, metadata, scale)
    copy_blocks: Callable[..., None]  # (kv_cache, src_block_ids, dst_block_ids)
