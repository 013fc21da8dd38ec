"""Triton kernel writing this step's K and V into their paged-cache slots.

Runs before attention every step; slot -1 marks padding tokens that must not touch the cache.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _store_kv_kernel(
    key_ptr,  # [num_tokens, num_kv_heads, head_dim]
    value_ptr,  # [num_tokens, num_kv_heads, head_dim]
    key_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping_ptr,  # [num_tokens] int64
    num_tokens,
    stride_k_token,
    stride_k_head,
    stride_v_token,
    stride_v_head,
    stride_kc_block,
    stride_kc_token,
    stride_kc_head,
    stride_vc_block,
    stride_vc_token,
    stride_vc_head,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PADDED: tl.constexpr,
    TILE_T: tl.constexpr,
):
    # One program writes TILE_T tokens of one KV head.
    kv_head = tl.program_id(1)
    tokens = tl.program_id(0) * TILE_T + tl.arange(0, TILE_T)
    offs_d = tl.arange(0, HEAD_DIM_PADDED)
    # int64 slots: block_id * block_size * stride can pass 2^31 elements on a large pool.
    slots = tl.load(slot_mapping_ptr + tokens, mask=tokens < num_tokens, other=-1)
    valid = slots >= 0
    block_ids = slots // BLOCK_SIZE
    block_offsets = slots % BLOCK_SIZE
    mask = valid[:, None] & (offs_d < HEAD_DIM)[None, :]
    tokens64 = tokens.to(tl.int64)

    src_k = tokens64[:, None] * stride_k_token + kv_head * stride_k_head + offs_d[None, :]
    src_v = tokens64[:, None] * stride_v_token + kv_head * stride_v_head + offs_d[None, :]
    dst_k = (
        block_ids[:, None] * stride_kc_block
        + block_offsets[:, None] * stride_kc_token
        + kv_head * stride_kc_head
        + offs_d[None, :]
    )
    dst_v = (
        block_ids[:, None] * stride_vc_block
        + block_offsets[:, None] * stride_vc_token
        + kv_head * stride_vc_head
        + offs_d[None, :]
    )
    key = tl.load(key_ptr + src_k, mask=mask)
    value = tl.load(value_ptr + src_v, mask=mask)
    tl.store(key_cache_ptr + dst_k, key.to(key_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(value_cache_ptr + dst_v, value.to(value_cache_ptr.dtype.element_ty), mask=mask)


def store_kv(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64, -1 = padding
) -> None:
    """Write each token's K and V into its slot of the paged cache (same contract as torch_ref)."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    for t in (key, value, key_cache, value_cache):
        assert t.stride(-1) == 1, "head_dim must be contiguous"
    block_size = key_cache.shape[1]
    tile_t = 16
    grid = (triton.cdiv(num_tokens, tile_t), num_kv_heads)
    _store_kv_kernel[grid](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping.to(torch.int64),
        num_tokens,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        value_cache.stride(0),
        value_cache.stride(1),
        value_cache.stride(2),
        BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim,
        HEAD_DIM_PADDED=triton.next_power_of_2(head_dim),
        TILE_T=tile_t,
    )
