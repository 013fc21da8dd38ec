"""Structured outputs on the worker: the scheduler's bitmask applied to a step's logits.

Disallowed tokens go to -inf before any sampling parameter is applied, so greedy, temperature,
top-k/p, penalties and logit_bias all pick among the tokens the grammar allows (as vLLM V1 masks
in the model runner), and logprobs are those of the constrained distribution.
"""

from __future__ import annotations

import numpy as np
import torch

from pagedray.scheduler.messages import GrammarBitmask


def apply_grammar_bitmask(
    logits: torch.Tensor, sample_req_ids: list[str], bitmask: GrammarBitmask
) -> None:
    """Masks, in place, the rows of `logits` whose request has a bitmask row.

    Args:
        logits: [num_samples, vocab_size] float32, one row per entry of `sample_req_ids`.
        sample_req_ids: the request of each logits row.
        bitmask: allowed tokens per constrained request; ids past its rows are disallowed.
    """
    row_of = {req_id: i for i, req_id in enumerate(sample_req_ids)}
    mask_rows = [j for j, req_id in enumerate(bitmask.req_ids) if req_id in row_of]
    if not mask_rows:
        return
    words = np.frombuffer(bitmask.data, dtype="<i4").reshape(-1, bitmask.words_per_row)
    # [num_masked, words_per_row * 32]: bit i of the row is token id i
    bits = np.unpackbits(words[mask_rows].view(np.uint8), axis=1, bitorder="little")
    vocab_size = logits.shape[1]
    allowed = torch.zeros(len(mask_rows), vocab_size, dtype=torch.bool)
    width = min(vocab_size, bits.shape[1])
    allowed[:, :width] = torch.from_numpy(bits[:, :width].astype(np.bool_))
    index = torch.tensor([row_of[bitmask.req_ids[j]] for j in mask_rows], device=logits.device)
    rows = logits.index_select(0, index)  # [num_masked, vocab_size]
    rows.masked_fill_(~allowed.to(logits.device), float("-inf"))
    logits.index_copy_(0, index, rows)
