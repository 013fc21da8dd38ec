"""Top-k / top-p through candidates keeps exactly the tokens the full sort keeps."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedray.workers.top_k_top_p import (
    CANDIDATE_WIDTHS,
    CANDIDATES,
    _among_candidates,
    apply_top_k_top_p,
    apply_top_k_top_p_sorted,
)

VOCAB = 1000  # past the first round of candidates, short of the second
LARGE_VOCAB = 2 * CANDIDATE_WIDTHS[-1] + 100  # every round runs


def distinct_logits(
    num_rows: int, spread: list[float], seed: int, vocab: int = VOCAB
) -> torch.Tensor:
    """Rows without ties (their order among equal logits is defined by neither path): a
    permutation of evenly spaced values, scaled per row from flat (0.01) to peaked (50)."""
    generator = torch.Generator().manual_seed(seed)
    base = torch.linspace(-1.0, 1.0, vocab)
    rows = [base[torch.randperm(vocab, generator=generator)] * s for s in spread[:num_rows]]
    return torch.stack(rows)


def near_top_p(row: torch.Tensor, k: int, p: float) -> bool:
    """Whether some token's mass before it, in the top-k distribution, is within rounding of p:
    there the two paths' sums, added in other orders, may fall on either side."""
    if p >= 1.0:
        return False
    probs = row.sort(descending=True).values[: k or row.numel()].softmax(dim=-1)
    return bool(((probs.cumsum(dim=-1) - probs - p).abs() < 1e-5).any())


@settings(max_examples=60, deadline=None)
@given(
    vocab=st.sampled_from([VOCAB, LARGE_VOCAB]),
    data=st.lists(
        st.tuples(
            st.sampled_from([0.01, 1.0, 5.0, 20.0, 50.0, 200.0]),  # flat to peaked
            st.sampled_from([0, 1, 5, 256, 257, 600, 4096, 4097, -1, 0, 10**6]),  # -1: vocab - 1
            st.sampled_from([1.0, 0.999, 0.95, 0.9, 0.5, 0.1, 1e-30]),
            st.sampled_from([0.0, 0.0, 0.5, 0.999]),  # share of tokens a grammar masked
        ),
        min_size=1,
        max_size=8,
    ),
    seed=st.integers(0, 1000),
)
def test_candidates_keep_what_the_full_sort_keeps(vocab: int, data: list, seed: int) -> None:
    logits = distinct_logits(len(data), [spread for spread, *_ in data], seed, vocab)
    generator = torch.Generator().manual_seed(seed)
    for row, (*_, masked) in enumerate(data):
        hidden = torch.rand(vocab, generator=generator) < masked
        hidden[logits[row].argmax()] = False  # a grammar leaves at least one token
        logits[row, hidden] = float("-inf")
    top_k = torch.tensor([vocab - 1 if k == -1 else min(k, vocab) for _, k, _, _ in data])
    top_p = torch.tensor([p for _, _, p, _ in data], dtype=torch.float32)
    fast = apply_top_k_top_p(logits, top_k, top_p)
    sorted_ = apply_top_k_top_p_sorted(logits, top_k, top_p)
    kept_fast, kept_sorted = fast.isfinite(), sorted_.isfinite()
    for row in range(len(data)):
        differ = int((kept_fast[row] ^ kept_sorted[row]).sum())
        k = int(top_k[row]) % vocab
        allowed = 1 if near_top_p(logits[row], k, float(top_p[row])) else 0
        assert differ <= allowed, (data[row], differ)
    assert torch.equal(fast[kept_fast], logits[kept_fast])  # kept logits are unchanged
    assert kept_fast[torch.arange(len(data)), logits.argmax(dim=-1)].all()  # the top token stays


def test_rows_without_filters_come_back_whole() -> None:
    logits = distinct_logits(2, [1.0, 1.0], seed=0)
    out = apply_top_k_top_p(logits, torch.tensor([0, 3]), torch.tensor([1.0, 1.0]))
    assert torch.equal(out[0], logits[0])
    assert out[1].isfinite().sum() == 3


def test_peaked_nucleus_settles_among_candidates_and_flat_one_is_sorted() -> None:
    logits = distinct_logits(2, [50.0, 0.01], seed=1)
    vocab = torch.tensor([VOCAB, VOCAB])
    *_, settled = _among_candidates(logits, vocab, torch.tensor([0.9, 0.9]), CANDIDATES)
    assert settled.tolist() == [True, False]
    out = apply_top_k_top_p(logits, torch.tensor([0, 0]), torch.tensor([0.9, 0.9]))
    assert 0 < out[0].isfinite().sum() < CANDIDATES  # peaked: a few tokens hold 90%
    assert out[1].isfinite().sum() > CANDIDATES  # flat: about 90% of the vocabulary
    assert torch.equal(
        out.isfinite(),
        apply_top_k_top_p_sorted(logits, torch.tensor([0, 0]), torch.tensor([0.9, 0.9])).isfinite(),
    )


def test_masked_tokens_never_come_back() -> None:
    logits = distinct_logits(1, [5.0], seed=2)
    logits[0, 10:] = float("-inf")  # a grammar left ten tokens
    out = apply_top_k_top_p(logits, torch.tensor([0]), torch.tensor([0.99]))
    assert not out[0, 10:].isfinite().any()
    assert out[0, :10].isfinite().any()
