"""The worker's bitmask application: exactly the allowed tokens keep their logits, only the
constrained rows change, and token ids past the bitmask are never allowed."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedray.scheduler.messages import GrammarBitmask
from pagedray.workers.grammar_mask import apply_grammar_bitmask


def _bitmask(req_ids: list[str], allowed: list[set[int]], vocab_size: int) -> GrammarBitmask:
    words_per_row = (vocab_size + 31) // 32
    rows = np.zeros((len(req_ids), words_per_row), dtype=np.uint32)
    for row, tokens in zip(rows, allowed):
        for token_id in tokens:
            row[token_id // 32] |= np.uint32(1 << (token_id % 32))
    return GrammarBitmask(req_ids, words_per_row, rows.astype("<u4").tobytes())


@settings(max_examples=60, deadline=None)
@given(
    vocab_size=st.integers(1, 200),
    num_rows=st.integers(1, 6),
    data=st.data(),
)
def test_only_allowed_tokens_keep_their_logits(vocab_size: int, num_rows: int, data) -> None:
    req_ids = [f"r{i}" for i in range(num_rows)]
    constrained = data.draw(st.lists(st.sampled_from(req_ids), unique=True, max_size=num_rows))
    # The scheduler may also send rows of requests that do not sample on this rank's step.
    shipped = constrained + ["absent"]
    allowed = [data.draw(st.sets(st.integers(0, vocab_size - 1), min_size=1)) for _ in shipped]
    logits = torch.randn(num_rows, vocab_size)
    before = logits.clone()
    # The bitmask is narrower than the logits when the model pads its vocabulary.
    apply_grammar_bitmask(logits, req_ids, _bitmask(shipped, allowed, max(1, vocab_size - 3)))
    for i, req_id in enumerate(req_ids):
        if req_id not in constrained:
            assert torch.equal(logits[i], before[i])
            continue
        tokens = allowed[shipped.index(req_id)]
        for token_id in range(vocab_size):
            expected = before[i, token_id] if token_id in tokens else float("-inf")
            assert logits[i, token_id] == expected
