"""The worker's persistent batch: per-sequence token ids and block tables, updated from diffs.

The scheduler sends a sequence in full once; afterwards only new tokens, appended block ids and
`num_computed_tokens` arrive. Rows live in preallocated numpy arrays so that building a step's
inputs is a handful of vectorized gathers, not a Python loop over tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pagedray.scheduler.messages import CachedRequestData, NewRequestData
from pagedray.scheduler.sampling_params import SamplingParams


@dataclass
class CachedRequestState:
    """What a worker remembers about one sequence between steps."""

    req_id: str
    row: int  # index into the batch arrays
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    num_block_ids: int  # filled entries of this row's block table
    num_computed_tokens: int
    # Its allowed_token_ids as an index tensor, made once (the sampler masks with it each step).
    allowed_index: torch.Tensor | None = None
    lora_slot: int | None = None  # its LoRA adapter's slot; None: the base model

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)


class InputBatch:
    """Rows of token ids and block tables for every sequence the workers hold."""

    def __init__(self, max_num_reqs: int, max_model_len: int, block_size: int) -> None:
        self.block_size = block_size
        max_blocks = -(-max_model_len // block_size)
        self.token_ids = np.zeros((max_num_reqs, max_model_len + 1), dtype=np.int64)
        self.block_table = np.zeros((max_num_reqs, max_blocks), dtype=np.int32)
        self.requests: dict[str, CachedRequestState] = {}
        self._free_rows = list(range(max_num_reqs - 1, -1, -1))
        # Sequences still owing prompt logprobs: checked every step, so kept apart.
        self.prompt_logprob_reqs: set[str] = set()

    def remove(self, req_id: str) -> None:
        self.prompt_logprob_reqs.discard(req_id)
        state = self.requests.pop(req_id, None)
        if state is not None:
            self._free_rows.append(state.row)

    def add(self, new: NewRequestData) -> CachedRequestState:
        if not self._free_rows:
            self._grow()
        row = self._free_rows.pop()
        tokens = new.prompt_token_ids + new.output_token_ids
        self.token_ids[row, : len(tokens)] = tokens
        self.block_table[row, : len(new.block_ids)] = new.block_ids
        params = new.sampling_params
        state = CachedRequestState(
            req_id=new.req_id,
            row=row,
            prompt_token_ids=list(new.prompt_token_ids),
            output_token_ids=list(new.output_token_ids),
            sampling_params=params,
            num_block_ids=len(new.block_ids),
            num_computed_tokens=new.num_computed_tokens,
            lora_slot=new.lora_slot,
            allowed_index=(
                None
                if params.allowed_token_ids is None
                else torch.tensor(params.allowed_token_ids, dtype=torch.long)
            ),
        )
        self.requests[new.req_id] = state
        # A sequence that already has outputs delivered its prompt logprobs before.
        if params.prompt_logprobs is not None and not new.output_token_ids:
            self.prompt_logprob_reqs.add(new.req_id)
        return state

    def update(self, cached: CachedRequestData) -> None:
        for req_id, new_tokens, new_blocks, num_computed in zip(
            cached.req_ids, cached.new_token_ids, cached.new_block_ids, cached.num_computed_tokens
        ):
            state = self.requests[req_id]
            if new_tokens:
                start = state.num_tokens
                self.token_ids[state.row, start : start + len(new_tokens)] = new_tokens
                state.output_token_ids.extend(new_tokens)
            if new_blocks:
                start = state.num_block_ids
                self.block_table[state.row, start : start + len(new_blocks)] = new_blocks
                state.num_block_ids += len(new_blocks)
            state.num_computed_tokens = num_computed

    def _grow(self) -> None:
        """More sequences than expected (e.g. n > 1 forks): double the rows."""
        old_rows = self.token_ids.shape[0]
        self.token_ids = np.concatenate([self.token_ids, np.zeros_like(self.token_ids)])
        self.block_table = np.concatenate([self.block_table, np.zeros_like(self.block_table)])
        self._free_rows.extend(range(2 * old_rows - 1, old_rows - 1, -1))
