"""Triton copy-on-write of KV blocks: every layer's K and V for all (src, dst) pairs in one launch.

Runs before the forward pass when a forked sequence is about to write into a shared block.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _copy_blocks_kernel(
    kv_cache_ptr,  # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
    src_block_ids_ptr,  # [num_pairs] int64
    dst_block_ids_ptr,  # [num_pairs] int64
    stride_layer,
    stride_kv,
    stride_block,
    BLOCK_NUMEL: tl.constexpr,  # block_size * num_kv_heads * head_dim, contiguous
    COPY_TILE: tl.constexpr,
):
    pair = tl.program_id(0)
    layer = tl.program_id(1) // 2
    kv = tl.program_id(1) % 2
    # int64 throughout: layer and block offsets of a full pool pass 2^31 elements.
    src = tl.load(src_block_ids_ptr + pair).to(tl.int64)
    dst = tl.load(dst_block_ids_ptr + pair).to(tl.int64)
    base = layer.to(tl.int64) * stride_layer + kv.to(tl.int64) * stride_kv
    src_ptr = kv_cache_ptr + base + src * stride_block
    dst_ptr = kv_cache_ptr + base + dst * stride_block
    for start in range(0, BLOCK_NUMEL, COPY_TILE):
        offs = start + tl.arange(0, COPY_TILE)
        mask = offs < BLOCK_NUMEL
        tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=mask), mask=mask)


def copy_blocks(
    kv_cache: torch.Tensor,  # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
    src_block_ids: list[int],
    dst_block_ids: list[int],
) -> None:
    """Copy-on-write: duplicate whole blocks for every layer, K and V (same contract as torch_ref).

    NOTE: pairs run in parallel, so a dst must not also be another pair's src; the scheduler's
    copy-on-write only ever copies into freshly allocated blocks.
    """
    if not src_block_ids:
        return
    assert len(src_block_ids) == len(dst_block_ids)
    num_layers, _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    block_numel = block_size * num_kv_heads * head_dim
    # One block's tokens, heads and dims must be contiguous so it copies as one flat run.
    assert kv_cache.stride()[3:] == (num_kv_heads * head_dim, head_dim, 1)
    src = torch.tensor(src_block_ids, dtype=torch.int64).to(kv_cache.device, non_blocking=True)
    dst = torch.tensor(dst_block_ids, dtype=torch.int64).to(kv_cache.device, non_blocking=True)
    _copy_blocks_kernel[(len(src_block_ids), num_layers * 2)](
        kv_cache,
        src,
        dst,
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        BLOCK_NUMEL=block_numel,
        COPY_TILE=min(1024, triton.next_power_of_2(block_numel)),
    )
