"""A ragged paged-attention batch with scattered blocks, and the check of a backend against the
torch reference: shared by the tests of every attention backend (Triton, CPU).
"""

from __future__ import annotations

import math
import random
from typing import Callable

import pytest
import torch

from pagedray.attention import torch_ref
from pagedray.attention.metadata import AttentionMetadata

# Kernels accumulate in fp32 like the reference. bf16 differs by output rounding (and on GPU by
# rounding p to bf16 before P @ V); fp32 only by summation order.
TOLERANCES = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 5e-3}


# (num_heads, num_kv_heads, head_dim, block_size, dtype): GQA 1/2/4/8, head sizes 64/128/80/96.
SHAPES = [
    pytest.param(2, 2, 64, 16, torch.float32, id="gqa1-d64-bs16"),
    pytest.param(4, 2, 80, 8, torch.float32, id="gqa2-d80-bs8"),
    pytest.param(4, 1, 128, 32, torch.float32, id="gqa4-d128-bs32"),
    pytest.param(8, 1, 96, 16, torch.float32, id="gqa8-d96-bs16"),
    pytest.param(16, 2, 128, 8, torch.float32, id="gqa8-d128-bs8"),
    pytest.param(6, 6, 80, 32, torch.float32, id="gqa1-d80-bs32"),
    pytest.param(3, 1, 64, 8, torch.float32, id="gqa3-d64-bs8"),  # group not a power of 2
    pytest.param(4, 2, 128, 16, torch.bfloat16, id="gqa2-d128-bs16-bf16"),
    pytest.param(8, 2, 80, 8, torch.bfloat16, id="gqa4-d80-bs8-bf16"),
]


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    tol = TOLERANCES[expected.dtype]
    torch.testing.assert_close(actual.float(), expected.float(), atol=tol, rtol=tol)


def build_metadata(
    query_lens: list[int],
    seq_lens: list[int],
    block_size: int,
    num_blocks: int,
    gen: torch.Generator,
    first_block_id: int = 1,
) -> AttentionMetadata:
    """Metadata for a ragged batch whose blocks are scattered (shuffled) over [first_block_id, N).

    Block 0 stays out of use: it is what padded block-table entries point at.
    """
    blocks_per_seq = [-(-s // block_size) for s in seq_lens]
    perm = torch.randperm(num_blocks - first_block_id, generator=gen)
    ids = (first_block_id + perm[: sum(blocks_per_seq)]).tolist()
    block_tables = torch.zeros(len(seq_lens), max(blocks_per_seq), dtype=torch.int32)
    for i in range(len(seq_lens)):
        block_tables[i, : blocks_per_seq[i]] = torch.tensor(ids[: blocks_per_seq[i]])
        ids = ids[blocks_per_seq[i] :]
    return metadata_on_blocks(query_lens, seq_lens, block_tables, block_size)


def metadata_on_blocks(
    query_lens: list[int], seq_lens: list[int], block_tables: torch.Tensor, block_size: int
) -> AttentionMetadata:
    """Metadata for a ragged batch on the blocks `block_tables` gives each sequence."""
    slots = []
    for i, (query_len, seq_len) in enumerate(zip(query_lens, seq_lens, strict=True)):
        for pos in range(seq_len - query_len, seq_len):
            slots.append(int(block_tables[i, pos // block_size]) * block_size + pos % block_size)
    starts = [0]
    for query_len in query_lens:
        starts.append(starts[-1] + query_len)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=block_tables,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_start_loc_cpu=starts,
        seq_lens_cpu=list(seq_lens),
    )


def pool_size(seq_lens: list[int], block_size: int) -> int:
    # Twice what the batch needs, so the shuffled ids leave holes between a sequence's blocks.
    return 2 * sum(-(-s // block_size) for s in seq_lens) + 1


def random_batch(
    query_lens: list[int],
    seq_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata, float]:
    """(query, key_cache, value_cache, metadata, scale), seeded by the shape."""
    gen = torch.Generator().manual_seed(sum(seq_lens) * 31 + head_dim + block_size)
    num_blocks = pool_size(seq_lens, block_size)
    metadata = build_metadata(query_lens, seq_lens, block_size, num_blocks, gen)
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.randn(cache_shape, generator=gen).to(dtype)
    value_cache = torch.randn(cache_shape, generator=gen).to(dtype)
    query = torch.randn(sum(query_lens), num_heads, head_dim, generator=gen).to(dtype)
    return query, key_cache, value_cache, metadata, 1.0 / math.sqrt(head_dim)


def check_against_reference(
    paged_attention: Callable[..., torch.Tensor],
    query_lens: list[int],
    seq_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
) -> None:
    """`paged_attention` gives the torch reference's output on a random batch of this shape."""
    query, key_cache, value_cache, metadata, scale = random_batch(
        query_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype
    )
    expected = torch_ref.paged_attention(query, key_cache, value_cache, metadata, scale)
    metadata.scratch.clear()  # the backend under test derives its own per-step data
    actual = paged_attention(query, key_cache, value_cache, metadata, scale)
    assert_close(actual, expected)


def shared_prefix_batch(
    families: list[tuple[int, list[int]]],
    prefills: list[tuple[int, int]],
    shape: tuple[int, int, int, int],
    dtype: torch.dtype,
    order: random.Random,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata, float]:
    """Decodes in families whose block tables begin with the family's prefix blocks (the same
    blocks: a cached prefix), each with blocks of its own after them, and prefill chunks beside
    them, in a shuffled order; every block anywhere in the pool."""
    num_heads, num_kv_heads, head_dim, block_size = shape
    sequences: list[tuple[int, int, int | None]] = []  # query len, seq len, family
    for family, (prefix_blocks, extras) in enumerate(families):
        sequences += [(1, prefix_blocks * block_size + extra, family) for extra in extras]
    sequences += [(query_len, query_len + context, None) for query_len, context in prefills]
    order.shuffle(sequences)
    blocks_of = [-(-seq_len // block_size) for _, seq_len, _ in sequences]
    num_blocks = 2 * sum(blocks_of) + 1
    free = (1 + torch.randperm(num_blocks - 1, generator=torch.Generator().manual_seed(7))).tolist()
    prefixes = [[free.pop() for _ in range(prefix_blocks)] for prefix_blocks, _ in families]
    tables = torch.zeros(len(sequences), max(blocks_of), dtype=torch.int32)
    for i, (_, _, family) in enumerate(sequences):
        ids = [] if family is None else list(prefixes[family])
        ids += [free.pop() for _ in range(blocks_of[i] - len(ids))]
        tables[i, : blocks_of[i]] = torch.tensor(ids, dtype=torch.int32)
    query_lens = [query_len for query_len, _, _ in sequences]
    seq_lens = [seq_len for _, seq_len, _ in sequences]
    batch = metadata_on_blocks(query_lens, seq_lens, tables, block_size)
    gen = torch.Generator().manual_seed(sum(seq_lens))
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.randn(cache_shape, generator=gen).to(dtype)
    value_cache = torch.randn(cache_shape, generator=gen).to(dtype)
    query = torch.randn(sum(query_lens), num_heads, head_dim, generator=gen).to(dtype)
    return query, key_cache, value_cache, batch, 1.0 / math.sqrt(head_dim)
