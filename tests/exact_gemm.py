"""Whether this CPU's GEMM gives a row the same bits at every batch size: what the tests of
exact outputs (a token's bits by every path) need before they can hold."""

from __future__ import annotations

import torch

from pagedray.workers.layers.gemm import linear, pack


def gemm_rows_do_not_depend_on_the_batch(width: int) -> bool:
    """No split of the sum that changes with the rows, at this width: without it no attention
    path can make outputs exact."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(3 * width, width, generator=gen)
    rows = torch.randn(300, width, generator=gen)
    packed = pack(weight)
    first = linear(rows[:1], weight, packed=packed)
    return all(
        torch.equal(linear(rows[:count], weight, packed=packed)[:1], first)
        for count in (2, 7, 64, 300)
    )
