"""The worker's bitmask application: exactly the allowed tokens keep their logits, only the
constrained rows change, and token ids past the bitmask are never allowed."""

from __future__ import annotations

from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedray.scheduler.messages import GrammarBitmask
from pagedray.workers import grammar_mask
from pagedray.workers.grammar_mask import apply_grammar_bitmask


def _bitmask(req_ids: list[str], allowed: list[set[int]], vocab_size: int) -> GrammarBitmask:
    words_per_row = (vocab_size + 31) // 32
    rows = np.zeros((len(req_ids), words_per_row), dtype=np.uint32)
    for row, tokens in zip(rows, allowed):
        for token_id in tokens:
            row[token_id // 32] |= np.uint32(1 << (token_id % 32))
    return GrammarBitmask(req_ids, words_per_row, rows.astype("<u4").tobytes())


@pytest.mark.parametrize("path", ["c", "torch"])
@settings(max_examples=60, deadline=None)
@given(
    vocab_size=st.integers(1, 200),
    num_rows=st.integers(1, 6),
    data=st.data(),
)
def test_only_allowed_tokens_keep_their_logits(
    path: str, vocab_size: int, num_rows: int, data
) -> None:
    req_ids = [f"r{i}" for i in range(num_rows)]
    constrained = data.draw(st.lists(st.sampled_from(req_ids), unique=True, max_size=num_rows))
    # The scheduler may also send rows of requests that do not sample on this rank's step.
    shipped = constrained + ["absent"]
    # The bitmask is narrower than the logits when the model pads its vocabulary.
    mask_vocab_size = max(1, vocab_size - 3)
    allowed = [data.draw(st.sets(st.integers(0, mask_vocab_size - 1), min_size=1)) for _ in shipped]
    logits = torch.randn(num_rows, vocab_size)
    before = logits.clone()
    bitmask = _bitmask(shipped, allowed, mask_vocab_size)
    c_entry = grammar_mask._c_entry() if path == "c" else None
    if path == "c" and c_entry is None:
        pytest.skip("no C compiler: the CPU kernels did not build")
    with mock.patch.object(grammar_mask, "_c_entry", lambda: c_entry):
        apply_grammar_bitmask(logits, req_ids, bitmask)
    for i, req_id in enumerate(req_ids):
        if req_id not in constrained:
            assert torch.equal(logits[i], before[i])
            continue
        tokens = allowed[shipped.index(req_id)]
        for token_id in range(vocab_size):
            expected = before[i, token_id] if token_id in tokens else float("-inf")
            assert logits[i, token_id] == expected
