"""Triton paged decode attention: one query token per sequence, split-K over its context.

A decode batch has too few query rows to fill a GPU, so the context is cut into splits that run
in parallel (stage 1: partial output + log-sum-exp per split) and are merged afterwards (stage 2).
All query heads sharing one KV head are processed together so each K/V tile is read once (GQA).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedray.attention.triton_paged_tile import dot_in_fp32, dot_precision, load_kv_tile

TILE_N = 32  # context tokens per loop iteration; independent of the cache's block_size
TOKENS_PER_SPLIT = 256  # aim for about this much context per split
MAX_SPLITS = 16


@triton.jit
def _decode_stage1_kernel(
    query_ptr,  # [num_seqs, num_heads, head_dim]
    key_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables_ptr,  # [num_seqs, max_num_blocks_per_seq] int32
    seq_lens_ptr,  # [num_seqs] int32
    mid_out_ptr,  # [num_seqs, num_heads, NUM_SPLITS, HEAD_DIM_PADDED] fp32
    mid_lse_ptr,  # [num_seqs, num_heads, NUM_SPLITS] fp32
    scale,
    stride_q_token,
    stride_q_head,
    stride_k_block,
    stride_k_token,
    stride_k_head,
    stride_v_block,
    stride_v_token,
    stride_v_head,
    stride_bt_seq,
    num_heads,
    GROUP: tl.constexpr,  # query heads per KV head
    BLOCK_H: tl.constexpr,  # GROUP padded to a power of two, at least 16 for tl.dot
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PADDED: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,  # see triton_paged_tile.dot_in_fp32
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 operands (no silent tf32), else "tf32"
    NUM_SPLITS: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq_len = tl.load(seq_lens_ptr + seq)
    # Splits are whole tiles so that only the last tile of the sequence needs a length mask.
    split_len = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), TILE_N) * TILE_N
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, HEAD_DIM_PADDED)
    offs_n = tl.arange(0, TILE_N)
    head_mask = offs_h < GROUP
    dim_mask = offs_d < HEAD_DIM
    heads = kv_head * GROUP + offs_h

    q_offs = seq.to(tl.int64) * stride_q_token + heads[:, None] * stride_q_head + offs_d[None, :]
    q = tl.load(query_ptr + q_offs, mask=head_mask[:, None] & dim_mask[None, :], other=0.0)

    dot_dtype = tl.float32 if DOT_IN_FP32 else key_cache_ptr.dtype.element_ty
    q = q.to(dot_dtype)  # [BLOCK_H, HEAD_DIM_PADDED]
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, HEAD_DIM_PADDED], dtype=tl.float32)
    block_table_row = block_tables_ptr + seq.to(tl.int64) * stride_bt_seq
    for tile_start in range(start, end, TILE_N):
        pos = tile_start + offs_n  # [TILE_N] positions in the sequence
        pos_mask = pos < end
        k, v = load_kv_tile(
            key_cache_ptr,
            value_cache_ptr,
            block_table_row,
            pos,
            pos_mask,
            dim_mask,
            offs_d,
            kv_head,
            stride_k_block,
            stride_k_token,
            stride_k_head,
            stride_v_block,
            stride_v_token,
            stride_v_head,
            BLOCK_SIZE,
        )
        k, v = k.to(dot_dtype), v.to(dot_dtype)  # [TILE_N, HEAD_DIM_PADDED]

        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale  # [BLOCK_H, TILE_N]
        s = tl.where(pos_mask[None, :], s, float("-inf"))
        # Every tile holds at least one valid position, so m_new is finite.
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(dot_dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    # An empty split (short sequence) leaves l_i == 0: it reports lse -inf and weighs nothing.
    has_tokens = l_i > 0.0
    safe_l = tl.where(has_tokens, l_i, 1.0)
    out = acc / safe_l[:, None]
    lse = tl.where(has_tokens, m_i + tl.log(safe_l), float("-inf"))
    # The mid buffers are contiguous, owned by the launcher: index them by flat (seq, head) row.
    mid_idx = (seq.to(tl.int64) * num_heads + heads) * NUM_SPLITS + split  # [BLOCK_H]
    out_offs = mid_idx[:, None] * HEAD_DIM_PADDED + offs_d[None, :]
    tl.store(mid_out_ptr + out_offs, out, mask=head_mask[:, None])
    tl.store(mid_lse_ptr + mid_idx, lse, mask=head_mask)


@triton.jit
def _decode_stage2_kernel(
    mid_out_ptr,  # [num_seqs, num_heads, NUM_SPLITS, HEAD_DIM_PADDED] fp32
    mid_lse_ptr,  # [num_seqs, num_heads, NUM_SPLITS] fp32
    out_ptr,  # [num_seqs, num_heads, head_dim]
    stride_o_token,
    stride_o_head,
    num_heads,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PADDED: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, NUM_SPLITS)
    offs_d = tl.arange(0, HEAD_DIM_PADDED)
    row = seq.to(tl.int64) * num_heads + head  # flat (seq, head) index into the mid buffers

    lse = tl.load(mid_lse_ptr + row * NUM_SPLITS + offs_s)  # [NUM_SPLITS]
    # Split 0 always holds tokens (seq_len >= 1), so the max is finite and empty splits get 0.
    weights = tl.exp(lse - tl.max(lse, 0))
    weights = weights / tl.sum(weights, 0)
    part_offs = (row * NUM_SPLITS + offs_s)[:, None] * HEAD_DIM_PADDED + offs_d[None, :]
    parts = tl.load(mid_out_ptr + part_offs)  # [NUM_SPLITS, HEAD_DIM_PADDED]
    out = tl.sum(parts * weights[:, None], 0)

    out_offs = seq.to(tl.int64) * stride_o_token + head * stride_o_head + offs_d
    tl.store(out_ptr + out_offs, out.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)


def decode_attention(
    query: torch.Tensor,  # [num_seqs, num_heads, head_dim], row i is sequence i's only token
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_num_blocks_per_seq] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32, including the query token
    max_seq_len: int,
    scale: float,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,  # [num_seqs, num_heads, head_dim]
) -> torch.Tensor:  # [num_seqs, num_heads, head_dim]
    """Paged attention of one new token per sequence over its whole cached context."""
    num_seqs, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    if out is None:
        out = torch.empty_like(query)
    if num_seqs == 0:
        return out
    for t in (query, key_cache, value_cache, out):
        assert t.stride(-1) == 1, "head_dim must be contiguous"
    if num_splits is None:
        num_splits = min(
            MAX_SPLITS, triton.next_power_of_2(triton.cdiv(max_seq_len, TOKENS_PER_SPLIT))
        )
    assert num_splits == triton.next_power_of_2(num_splits), "num_splits must be a power of 2"
    assert num_heads % num_kv_heads == 0, "query heads must split evenly over KV heads"
    group = num_heads // num_kv_heads
    head_dim_padded = triton.next_power_of_2(head_dim)
    upcast = dot_in_fp32(key_cache.dtype)

    mid_out = torch.empty(
        (num_seqs, num_heads, num_splits, head_dim_padded), dtype=torch.float32, device=query.device
    )
    mid_lse = torch.empty(
        (num_seqs, num_heads, num_splits), dtype=torch.float32, device=query.device
    )
    _decode_stage1_kernel[(num_seqs, num_kv_heads, num_splits)](
        query,
        key_cache,
        value_cache,
        block_tables,
        seq_lens,
        mid_out,
        mid_lse,
        scale,
        query.stride(0),
        query.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        value_cache.stride(0),
        value_cache.stride(1),
        value_cache.stride(2),
        block_tables.stride(0),
        num_heads,
        GROUP=group,
        BLOCK_H=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim,
        HEAD_DIM_PADDED=head_dim_padded,
        BLOCK_SIZE=block_size,
        TILE_N=TILE_N,
        DOT_IN_FP32=upcast,
        DOT_PRECISION=dot_precision(key_cache.dtype),
        NUM_SPLITS=num_splits,
    )
    _decode_stage2_kernel[(num_seqs, num_heads)](
        mid_out,
        mid_lse,
        out,
        out.stride(0),
        out.stride(1),
        num_heads,
        HEAD_DIM=head_dim,
        HEAD_DIM_PADDED=head_dim_padded,
        NUM_SPLITS=num_splits,
    )
    return out
