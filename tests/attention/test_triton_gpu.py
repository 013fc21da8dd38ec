"""Every Triton kernel against the torch reference on a real GPU (`pytest -m gpu`).

What Triton's interpreter never shows: real `tl.dot` in fp16 and bf16, launch limits, shared
memory, the split-K decode over contexts up to 32k tokens. Cases: fp16, bf16 and fp32; block
sizes 16 and 32; GQA ratios 1 to 8; head sizes 64 and 128; block offsets past 2^31 elements.

Skipped without CUDA. `PAGEDRAY_GPU_DRY_RUN=1` runs a few of the same cases with short contexts
on the CPU under the interpreter, so the GPU kit (benchmarks/gpu/) is exercised in CI.
"""

from __future__ import annotations

import os

import pytest
import torch
from _paged_batch import assert_close, build_metadata, random_batch

# NOTE: tests/conftest.py chooses Triton's interpreter when there is no GPU, before any import.
from pagedray.attention import torch_ref
from pagedray.attention.metadata import AttentionMetadata
from pagedray.attention.triton_backend import TRITON_BACKEND

GPU = torch.cuda.is_available()
DRY_RUN = os.environ.get("PAGEDRAY_GPU_DRY_RUN") == "1"
DEVICE = torch.device("cuda" if GPU else "cpu")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not GPU and not DRY_RUN,
        reason="needs a CUDA device (PAGEDRAY_GPU_DRY_RUN=1 runs short cases on the CPU)",
    ),
]

if GPU:
    DTYPES = [torch.float16, torch.bfloat16, torch.float32]
    BLOCK_SIZES, GROUPS, HEAD_DIMS = [16, 32], [1, 2, 4, 8], [64, 128]
    # Decodes from an empty context to 32k tokens; prefill chunks over long cached prefixes.
    DECODES = ([1] * 5, [1, 1000, 4097, 8192, 32768])
    MIXED = ([300, 1, 17, 1, 512], [300, 8192, 2000, 32768, 4608])
else:  # the dry run: the interpreter is slow, so fewer and shorter cases
    DTYPES = [torch.float16, torch.bfloat16]
    BLOCK_SIZES, GROUPS, HEAD_DIMS = [16], [1, 4], [64]
    DECODES = ([1] * 3, [1, 40, 97])
    MIXED = ([19, 1, 7], [19, 33, 64])


def _to(device: torch.device, *tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.to(device) for t in tensors]


def _metadata_on(metadata: AttentionMetadata, device: torch.device) -> AttentionMetadata:
    metadata.slot_mapping, metadata.query_start_loc, metadata.seq_lens, metadata.block_tables = _to(
        device,
        metadata.slot_mapping,
        metadata.query_start_loc,
        metadata.seq_lens,
        metadata.block_tables,
    )
    return metadata


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_attention_matches_reference(
    dtype: torch.dtype, block_size: int, group: int, head_dim: int
) -> None:
    """Decodes alone (the split-K kernel) and mixed with prefill chunks (the extend kernel)."""
    num_kv_heads = 2
    for query_lens, seq_lens in (DECODES, MIXED):
        query, key_cache, value_cache, metadata, scale = random_batch(
            query_lens, seq_lens, group * num_kv_heads, num_kv_heads, head_dim, block_size, dtype
        )
        query, key_cache, value_cache = _to(DEVICE, query, key_cache, value_cache)
        metadata = _metadata_on(metadata, DEVICE)
        expected = torch_ref.paged_attention(query, key_cache, value_cache, metadata, scale)
        metadata.scratch.clear()
        actual = TRITON_BACKEND.paged_attention(query, key_cache, value_cache, metadata, scale)
        assert_close(actual, expected)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_store_kv_and_copy_blocks_match_reference(dtype: torch.dtype, block_size: int) -> None:
    gen = torch.Generator().manual_seed(block_size)
    query_lens, seq_lens = [20, 1, 5], [20, 40, 37]
    num_blocks, num_kv_heads, head_dim = 64, 2, 128
    metadata = build_metadata(query_lens, seq_lens, block_size, num_blocks, gen)
    num_tokens = sum(query_lens)
    key, value = _to(DEVICE, *torch.randn(2, num_tokens, num_kv_heads, head_dim).to(dtype))
    kv_cache = torch.randn(1, 2, num_blocks, block_size, num_kv_heads, head_dim).to(dtype)
    kv_cache = kv_cache.to(DEVICE)
    expected = kv_cache.clone()
    slots = metadata.slot_mapping.to(DEVICE)
    torch_ref.store_kv(key, value, expected[0, 0], expected[0, 1], slots)
    TRITON_BACKEND.store_kv(key, value, kv_cache[0, 0], kv_cache[0, 1], slots)
    assert torch.equal(kv_cache, expected)
    src, dst = [4, 0, 7], [9, 11, 2]
    torch_ref.copy_blocks(expected, src, dst)
    TRITON_BACKEND.copy_blocks(kv_cache, src, dst)
    assert torch.equal(kv_cache, expected)


@pytest.mark.skipif(not GPU, reason="8 GiB of cache: on a GPU only (the CPU test covers it small)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_block_offsets_past_2_31(dtype: torch.dtype) -> None:
    """Block ids whose element offsets pass 2^31: int32 offset math would wrap."""
    block_size, num_kv_heads, head_dim, num_heads = 16, 1, 128, 8
    block_numel = block_size * num_kv_heads * head_dim
    first_block_id = 2**31 // block_numel + 1
    num_blocks = first_block_id + 64
    kv_cache = torch.zeros(2, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype)
    kv_cache = kv_cache.to(DEVICE)
    key_cache, value_cache = kv_cache[0], kv_cache[1]
    gen = torch.Generator().manual_seed(0)
    query_lens, seq_lens = [30, 1, 1], [300, 500, 40]
    metadata = build_metadata(query_lens, seq_lens, block_size, num_blocks, gen, first_block_id)
    used = metadata.block_tables[metadata.block_tables > 0].long().to(DEVICE)
    kv_cache[:, used] = torch.randn(2, used.numel(), block_size, 1, head_dim, device=DEVICE).to(
        dtype
    )
    metadata = _metadata_on(metadata, DEVICE)
    query = torch.randn(sum(query_lens), num_heads, head_dim, device=DEVICE).to(dtype)
    expected = torch_ref.paged_attention(query, key_cache, value_cache, metadata, 0.088)
    metadata.scratch.clear()
    actual = TRITON_BACKEND.paged_attention(query, key_cache, value_cache, metadata, 0.088)
    assert_close(actual, expected)
