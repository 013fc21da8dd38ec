"""The CPU backend's bfloat16 prefill by path (`PAGEDRAY_EXACT_ATTENTION=0`: torch's SDPA over
the gathered context): the reference's output, and a row's result independent of what else the
step computes — a prefix read from the cache instead of computed in the same chunk, other
sequences in the batch."""

from __future__ import annotations

import math

import pytest
import torch
from _paged_batch import assert_close, build_metadata, metadata_on_blocks, pool_size

from pagedray.attention import torch_ref
from pagedray.attention.cpu_backend import paged_attention

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 14, 2, 64, 16  # Qwen2.5-0.5B's attention


pytestmark = pytest.mark.usefixtures("attention_by_path")


@pytest.mark.parametrize(
    ("length", "cached"),
    [(40, 16), (300, 128), (700, 600), (1100, 512), (513, 1)],
    ids=lambda v: str(v),
)
def test_a_rows_output_is_the_same_behind_a_cached_prefix_and_beside_other_sequences(
    length: int, cached: int
) -> None:
    gen = torch.Generator().manual_seed(length * 7 + cached)
    other = 90  # a second prefill chunk in the batch, and a decode
    seq_lens = [length, other, 200]
    num_blocks = pool_size(seq_lens, BLOCK)
    fresh = build_metadata([length, other, 1], seq_lens, BLOCK, num_blocks, gen)
    shape = (num_blocks, BLOCK, KV_HEADS, HEAD_DIM)
    key_cache = torch.randn(shape, generator=gen).to(torch.bfloat16)
    value_cache = torch.randn(shape, generator=gen).to(torch.bfloat16)
    rows = torch.randn(length, HEADS, HEAD_DIM, generator=gen).to(torch.bfloat16)
    rest = torch.randn(other + 1, HEADS, HEAD_DIM, generator=gen).to(torch.bfloat16)
    scale = 1.0 / math.sqrt(HEAD_DIM)

    # The whole prompt in one chunk, beside another chunk and a decode.
    whole = paged_attention(torch.cat([rows, rest]), key_cache, value_cache, fresh, scale)
    expected = torch_ref.paged_attention(
        torch.cat([rows, rest]), key_cache, value_cache, fresh, scale
    )
    assert_close(whole, expected)

    # Its last rows alone, the first `cached` tokens read from the cache.
    suffix = metadata_on_blocks([length - cached], [length], fresh.block_tables[:1], BLOCK)
    behind_prefix = paged_attention(rows[cached:], key_cache, value_cache, suffix, scale)
    assert torch.equal(behind_prefix, whole[cached:length])


def test_float32_keeps_the_c_kernel_within_the_reference() -> None:
    """fp32 prefills do not take the SDPA path (the C kernel is the faster there); both agree
    with the reference."""
    gen = torch.Generator().manual_seed(3)
    seq_lens = [120, 60]
    num_blocks = pool_size(seq_lens, BLOCK)
    metadata = build_metadata([120, 20], seq_lens, BLOCK, num_blocks, gen)
    shape = (num_blocks, BLOCK, KV_HEADS, HEAD_DIM)
    key_cache, value_cache = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    query = torch.randn(140, HEADS, HEAD_DIM, generator=gen)
    expected = torch_ref.paged_attention(query, key_cache, value_cache, metadata, 0.125)
    metadata.scratch.clear()
    assert_close(paged_attention(query, key_cache, value_cache, metadata, 0.125), expected)
