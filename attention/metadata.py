"""What a paged-attention call needs to know about the batch, built once per step by the runner."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class AttentionMetadata:
    """A ragged batch of sequences: each has `query_len` new tokens at the end of `seq_len` tokens.

    Decodes have query_len 1; prefill chunks attend to their cached context (prefix-cache hits,
    earlier chunks) read through the block table, plus causally among themselves.
    """

    slot_mapping: torch.Tensor  # [num_tokens] int64: block_id * block_size + offset, -1 = skip
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32: prefix sums of query lengths
    seq_lens: torch.Tensor  # [num_seqs] int32: context length including this step's tokens
    block_tables: torch.Tensor  # [num_seqs, max_num_blocks_per_seq] int32, padded with 0
    max_query_len: int
    max_seq_len: int
    query_start_loc_cpu: list[int]  # host copy of query_start_loc for loops on the CPU
    seq_lens_cpu: list[int]  # host copy of seq_lens
    # A backend's own derived per-step data (gather indices, masks): built by the first layer,
    # reused by the others, dropped with the metadata at the end of the step.
    scratch: dict[str, Any] = field(default_factory=dict)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)
