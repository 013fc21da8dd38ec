"""Pieces the paged Triton kernels share: reading a tile of K and V through a block table, and
choosing the dot-product operand dtype and precision."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


@triton.jit
def load_kv_tile(
    key_cache_ptr,
    value_cache_ptr,
    block_table_row,  # pointer to this sequence's block table row
    pos,  # [TILE_N] token positions in the sequence
    pos_mask,  # [TILE_N] positions that exist
    dim_mask,  # [HEAD_DIM_PADDED] real head dimensions
    offs_d,  # [HEAD_DIM_PADDED]
    kv_head,
    stride_k_block,
    stride_k_token,
    stride_k_head,
    stride_v_block,
    stride_v_token,
    stride_v_head,
    BLOCK_SIZE: tl.constexpr,
):
    """K and V of positions `pos`, each [TILE_N, HEAD_DIM_PADDED], zero where masked."""
    # NOTE: block ids go to int64 before the multiply; block_id * stride passes 2^31 on
    # large pools.
    block_ids = tl.load(block_table_row + pos // BLOCK_SIZE, mask=pos_mask, other=0)
    block_ids = block_ids.to(tl.int64)
    token_in_block = (pos % BLOCK_SIZE).to(tl.int64)
    kv_mask = pos_mask[:, None] & dim_mask[None, :]
    k_offs = (
        block_ids[:, None] * stride_k_block
        + token_in_block[:, None] * stride_k_token
        + kv_head * stride_k_head
        + offs_d[None, :]
    )
    v_offs = (
        block_ids[:, None] * stride_v_block
        + token_in_block[:, None] * stride_v_token
        + kv_head * stride_v_head
        + offs_d[None, :]
    )
    k = tl.load(key_cache_ptr + k_offs, mask=kv_mask, other=0.0)
    v = tl.load(value_cache_ptr + v_offs, mask=kv_mask, other=0.0)
    return k, v


def dot_in_fp32(dtype: torch.dtype) -> bool:
    """Whether tl.dot must take fp32 operands instead of the cache dtype.

    NOTE: Triton's CPU interpreter keeps bfloat16 as raw uint16 bits and multiplies those in
    tl.dot (triton-lang/triton#11584), so under TRITON_INTERPRET=1 bf16 tiles are upcast first.
    Compiled kernels always use the cache dtype.
    """
    return dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1"


def dot_precision(cache_dtype: torch.dtype) -> str:
    """ "ieee" for fp32 operands (no silent tf32 on GPUs), else "tf32"."""
    return "ieee" if dot_in_fp32(cache_dtype) or cache_dtype == torch.float32 else "tf32"
