"""row_argmax (workers/row_argmax.py) gives torch.argmax's indices: over random rows, rows of
ties, NaN and infinities, widths around the chunk and past it, and strided rows."""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedray.workers.row_argmax import CHUNK, row_argmax

SPECIALS = (math.nan, math.inf, -math.inf, 0.0, 1.0)


@settings(max_examples=200, deadline=None)
@given(
    rows=st.integers(0, 5),
    width=st.sampled_from([1, 7, 4 * CHUNK - 1, 4 * CHUNK, 4 * CHUNK + 1, 9 * CHUNK + 37]),
    levels=st.integers(1, 4),
    specials=st.lists(
        st.tuples(st.integers(0, 10**9), st.integers(0, 10**9), st.sampled_from(SPECIALS)),
        max_size=6,
    ),
    seed=st.integers(0, 2**31 - 1),
)
def test_the_same_index_as_argmax(
    rows: int, width: int, levels: int, specials: list, seed: int
) -> None:
    generator = torch.Generator().manual_seed(seed)
    # Few distinct values, so that rows have many equal maxima.
    x = torch.randint(0, levels, (rows, width), generator=generator).float()
    for row, column, value in specials if rows else ():
        x[row % rows, column % width] = value
    assert torch.equal(row_argmax(x), x.argmax(dim=-1))


def test_a_vocabulary_sized_batch_and_a_strided_one() -> None:
    x = torch.randn(64, 151936, generator=torch.Generator().manual_seed(0))
    assert torch.equal(row_argmax(x), x.argmax(dim=-1))
    columns = x[:, :100000]  # rows with a stride past their width
    assert torch.equal(row_argmax(columns), columns.argmax(dim=-1))
