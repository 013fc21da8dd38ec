"""Triton attention kernels against the plain-torch reference, run on CPU by Triton's interpreter.

Covers ragged query/context lengths, GQA ratios, padded head sizes, block sizes, shuffled block ids
and block ids whose element offsets pass 2^31 (int32 overflow in the offset math).
"""

from __future__ import annotations

import functools
import os

# Before triton is imported; tests/conftest.py sets it too, since transformers imports triton.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch
from _paged_batch import (  # noqa: E402
    SHAPES,
    assert_close,
    build_metadata,
    check_against_reference,
    pool_size,
)

from pagedray.attention import torch_ref, triton_backend  # noqa: E402
from pagedray.attention.triton_backend import TRITON_BACKEND  # noqa: E402
from pagedray.attention.triton_decode import decode_attention  # noqa: E402

# (query_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype)
_check_attention = functools.partial(check_against_reference, TRITON_BACKEND.paged_attention)


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size,dtype", SHAPES)
def test_decode_matches_reference(
    num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype
) -> None:
    # seq_len 1: no cached context; 32: ends exactly on a block boundary for every block size.
    seq_lens = [1, 32, 45, 97]
    _check_attention([1] * 4, seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype)


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size,dtype", SHAPES)
def test_mixed_prefill_matches_reference(
    num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype
) -> None:
    # A fresh prompt (no cached context), decodes, chunks over a cached prefix, one chunk that
    # ends exactly on a block boundary (64) and one spanning several query tiles.
    query_lens = [19, 1, 7, 1, 24, 40]
    seq_lens = [19, 33, 64, 16, 50, 90]
    _check_attention(query_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype)


def test_long_decode_uses_several_splits() -> None:
    # 600 tokens -> 4 splits of 160, the last one partial; 257 leaves the 4th split empty.
    _check_attention([1, 1, 1], [600, 257, 3], 4, 2, 64, 16, torch.float32)


def test_long_prefill_over_cached_prefix() -> None:
    _check_attention([300, 1, 45], [600, 512, 45], 4, 2, 64, 16, torch.float32)


def test_long_mixed_batch_gqa8_bf16() -> None:
    # 608 = 19 blocks of 32 exactly; a long fresh prompt next to long decodes.
    _check_attention([1, 130, 1], [608, 130, 577], 8, 1, 128, 32, torch.bfloat16)


@pytest.mark.parametrize("num_splits", [1, 2, 8])
def test_decode_split_counts_agree(num_splits: int) -> None:
    # More splits than a short sequence has tiles: empty splits must weigh nothing in the merge.
    gen = torch.Generator().manual_seed(num_splits)
    seq_lens, block_size = [5, 70, 130], 16
    num_blocks = pool_size(seq_lens, block_size)
    metadata = build_metadata([1, 1, 1], seq_lens, block_size, num_blocks, gen)
    key_cache = torch.randn(num_blocks, block_size, 2, 64, generator=gen)
    value_cache = torch.randn(num_blocks, block_size, 2, 64, generator=gen)
    query = torch.randn(3, 8, 64, generator=gen)
    expected = torch_ref.paged_attention(query, key_cache, value_cache, metadata, 0.125)
    actual = decode_attention(
        query, key_cache, value_cache, metadata.block_tables, metadata.seq_lens,
        metadata.max_seq_len, 0.125, num_splits=num_splits,
    )  # fmt: skip
    assert_close(actual, expected)


def test_backend_dispatches_decode_and_mixed_batches(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    for name in ("decode_attention", "prefill_attention"):
        kernel = getattr(triton_backend, name)
        monkeypatch.setattr(
            triton_backend,
            name,
            lambda *a, _k=kernel, _n=name, **kw: calls.append(_n) or _k(*a, **kw),
        )
    _check_attention([1, 1], [9, 20], 2, 1, 64, 8, torch.float32)
    _check_attention([1, 3], [9, 20], 2, 1, 64, 8, torch.float32)
    assert calls == ["decode_attention", "prefill_attention"]


@pytest.mark.parametrize(
    "block_size,num_kv_heads,head_dim,dtype",
    [(8, 2, 64, torch.float32), (16, 1, 80, torch.float32), (32, 2, 128, torch.bfloat16)],
)
def test_store_kv_matches_reference(
    block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> None:
    gen = torch.Generator().manual_seed(block_size)
    query_lens, seq_lens = [20, 1, 5], [20, 40, 37]
    num_blocks = pool_size(seq_lens, block_size)
    metadata = build_metadata(query_lens, seq_lens, block_size, num_blocks, gen)
    slot_mapping = torch.cat([metadata.slot_mapping, torch.tensor([-1, -1])])  # padded tokens
    num_tokens = slot_mapping.numel()
    # K and V as strided views of one fused projection output, as the model produces them.
    # NOTE: in the cache dtype, as the model hands them over; the interpreter truncates fp32 ->
    # bf16 casts where GPUs and torch round to nearest even.
    kv = torch.randn(num_tokens, 2 * num_kv_heads * head_dim + 8, generator=gen).to(dtype)
    key = kv[:, : num_kv_heads * head_dim].view(num_tokens, num_kv_heads, head_dim)
    value = kv[:, num_kv_heads * head_dim : -8].view(num_tokens, num_kv_heads, head_dim)
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.randn(cache_shape, generator=gen).to(dtype)
    value_cache = torch.randn(cache_shape, generator=gen).to(dtype)
    expected_k, expected_v = key_cache.clone(), value_cache.clone()

    torch_ref.store_kv(key, value, expected_k, expected_v, slot_mapping)
    TRITON_BACKEND.store_kv(key, value, key_cache, value_cache, slot_mapping)
    assert torch.equal(key_cache, expected_k)
    assert torch.equal(value_cache, expected_v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_copy_blocks_matches_reference(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    kv_cache = torch.randn(3, 2, 12, 16, 2, 80, generator=gen).to(dtype)
    expected = kv_cache.clone()
    src, dst = [4, 0, 7], [9, 11, 2]
    torch_ref.copy_blocks(expected, src, dst)
    TRITON_BACKEND.copy_blocks(kv_cache, src, dst)
    assert torch.equal(kv_cache, expected)
    TRITON_BACKEND.copy_blocks(kv_cache, [], [])  # no pairs: nothing to launch
    assert torch.equal(kv_cache, expected)


def test_block_offsets_past_int32() -> None:
    """Block ids whose element offsets pass 2^31: an int32 multiply would wrap around.

    The pool is 8 GiB of bf16 but allocated with torch.empty, so only the pages of the few
    blocks written here are ever backed by memory.
    """
    block_size, num_kv_heads, head_dim, num_heads = 16, 1, 64, 4
    block_numel = block_size * num_kv_heads * head_dim
    first_block_id = 2**31 // block_numel + 1  # this block and all after start past 2^31
    num_blocks = first_block_id + 16
    kv_cache = torch.empty(
        1, 2, num_blocks, block_size, num_kv_heads, head_dim, dtype=torch.bfloat16
    )
    key_cache, value_cache = kv_cache[0, 0], kv_cache[0, 1]  # [num_blocks, bs, kv_heads, dim]
    assert first_block_id * key_cache.stride(0) > 2**31
    gen = torch.Generator().manual_seed(0)
    query_lens, seq_lens = [6, 1], [40, 20]
    metadata = build_metadata(query_lens, seq_lens, block_size, num_blocks, gen, first_block_id)
    used = metadata.block_tables[metadata.block_tables > 0].long()
    kv_cache[0, :, 0] = 0.0  # padded block-table entries point at block 0 (read by the reference)
    kv_cache[0, :, used] = torch.randn(2, used.numel(), block_size, 1, head_dim).bfloat16()

    # store_kv: this step's tokens land in the high blocks.
    num_tokens = sum(query_lens)
    key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).bfloat16()
    value = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).bfloat16()
    TRITON_BACKEND.store_kv(key, value, key_cache, value_cache, metadata.slot_mapping)
    flat_k = key_cache.view(-1, num_kv_heads, head_dim)
    assert torch.equal(flat_k[metadata.slot_mapping], key)
    assert torch.equal(value_cache.view(-1, num_kv_heads, head_dim)[metadata.slot_mapping], value)

    # Prefill (mixed batch) and decode read through the same high block ids.
    query = torch.randn(num_tokens, num_heads, head_dim, generator=gen).bfloat16()
    expected = torch_ref.paged_attention(query, key_cache, value_cache, metadata, 0.125)
    assert_close(
        TRITON_BACKEND.paged_attention(query, key_cache, value_cache, metadata, 0.125), expected
    )
    decode_md = build_metadata([1], [40], block_size, num_blocks, gen, first_block_id)
    decode_md.block_tables = metadata.block_tables[:1]
    expected = torch_ref.paged_attention(query[:1], key_cache, value_cache, decode_md, 0.125)
    actual = TRITON_BACKEND.paged_attention(query[:1], key_cache, value_cache, decode_md, 0.125)
    assert_close(actual, expected)

    # copy_blocks between two high blocks, K and V.
    src, dst = int(used[0]), num_blocks - 1
    TRITON_BACKEND.copy_blocks(kv_cache, [src], [dst])
    assert torch.equal(kv_cache[0, :, dst], kv_cache[0, :, src])
