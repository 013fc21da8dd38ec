"""Triton paged prefill/extend attention over a ragged batch, decodes included (unified kernel).

Each sequence's new tokens attend to its cached context through the block table and causally to
each other, so prefill chunks, prefix-cache hits and decodes share one launch. A program owns
BLOCK_Q query tokens x all query heads of one KV head (GQA), flattened into BLOCK_M rows.
"""

from __future__ import annotations

import itertools

import torch
import triton
import triton.language as tl

from pagedray.attention.triton_paged_tile import dot_in_fp32, dot_precision, load_kv_tile

TILE_N = 32  # context tokens per loop iteration; independent of the cache's block_size


@triton.jit
def _prefill_attention_kernel(
    query_ptr,  # [num_tokens, num_heads, head_dim]
    key_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    out_ptr,  # [num_tokens, num_heads, head_dim]
    block_tables_ptr,  # [num_seqs, max_num_blocks_per_seq] int32
    query_start_loc_ptr,  # [num_seqs + 1] int32
    seq_lens_ptr,  # [num_seqs] int32
    program_map_ptr,  # [num_programs, 2] int32: (seq, q_block) per program
    scale,
    stride_q_token,
    stride_q_head,
    stride_k_block,
    stride_k_token,
    stride_k_head,
    stride_v_block,
    stride_v_token,
    stride_v_head,
    stride_o_token,
    stride_o_head,
    stride_bt_seq,
    GROUP: tl.constexpr,  # query heads per KV head
    GROUP_PADDED: tl.constexpr,
    BLOCK_Q: tl.constexpr,  # query tokens per program
    BLOCK_M: tl.constexpr,  # BLOCK_Q * GROUP_PADDED rows
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PADDED: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,  # see triton_paged_tile.dot_in_fp32
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 operands (no silent tf32), else "tf32"
):
    kv_head = tl.program_id(1)
    seq = tl.load(program_map_ptr + 2 * tl.program_id(0))
    q_block = tl.load(program_map_ptr + 2 * tl.program_id(0) + 1)

    query_start = tl.load(query_start_loc_ptr + seq)
    query_len = tl.load(query_start_loc_ptr + seq + 1) - query_start
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - query_len

    # Row r: query token q_block * BLOCK_Q + r // GROUP_PADDED, head r % GROUP_PADDED of the group.
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_PADDED)
    offs_n = tl.arange(0, TILE_N)
    q_idx = q_block * BLOCK_Q + offs_m // GROUP_PADDED  # [BLOCK_M] index within the sequence
    head_in_group = offs_m % GROUP_PADDED
    row_mask = (q_idx < query_len) & (head_in_group < GROUP)
    dim_mask = offs_d < HEAD_DIM
    heads = kv_head * GROUP + head_in_group
    tokens = (query_start + q_idx).to(tl.int64)
    q_pos = context_len + q_idx  # absolute position; sees keys 0..q_pos

    q_offs = tokens[:, None] * stride_q_token + heads[:, None] * stride_q_head + offs_d[None, :]
    io_mask = row_mask[:, None] & dim_mask[None, :]
    q = tl.load(query_ptr + q_offs, mask=io_mask, other=0.0)  # [BLOCK_M, HEAD_DIM_PADDED]

    dot_dtype = tl.float32 if DOT_IN_FP32 else key_cache_ptr.dtype.element_ty
    q = q.to(dot_dtype)  # [BLOCK_M, HEAD_DIM_PADDED]
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PADDED], dtype=tl.float32)
    # The block's last query token sees the most context; nothing past it is read.
    kv_end = tl.minimum(seq_len, context_len + (q_block + 1) * BLOCK_Q)
    block_table_row = block_tables_ptr + seq.to(tl.int64) * stride_bt_seq
    for tile_start in range(0, kv_end, TILE_N):
        pos = tile_start + offs_n  # [TILE_N] key positions
        pos_mask = pos < kv_end
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

        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale  # [BLOCK_M, TILE_N]
        causal = (pos[None, :] <= q_pos[:, None]) & pos_mask[None, :] & row_mask[:, None]
        s = tl.where(causal, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # Padding rows see only -inf: a 0 max keeps exp() at 0 there instead of
        # exp(-inf - -inf) = nan. Real rows always see key 0, so their max is finite.
        m_new = tl.where(m_new > float("-inf"), m_new, 0.0)
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(dot_dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    o_offs = tokens[:, None] * stride_o_token + heads[:, None] * stride_o_head + offs_d[None, :]
    tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=io_mask)


def prefill_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_num_blocks_per_seq] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32, including this step's tokens
    query_start_loc_cpu: list[int],
    scale: float,
    out: torch.Tensor | None = None,  # [num_tokens, num_heads, head_dim]
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Paged causal attention of each sequence's new tokens over its cached context and itself."""
    _, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    if out is None:
        out = torch.empty_like(query)
    for t in (query, key_cache, value_cache, out):
        assert t.stride(-1) == 1, "head_dim must be contiguous"
    assert num_heads % num_kv_heads == 0, "query heads must split evenly over KV heads"
    group = num_heads // num_kv_heads
    group_padded = triton.next_power_of_2(group)
    upcast = dot_in_fp32(key_cache.dtype)
    query_lens = [b - a for a, b in itertools.pairwise(query_start_loc_cpu)]
    # Taller tiles amortise K/V loads over more rows for prefill; short rows waste less on decodes.
    block_m = 64 if max(query_lens, default=0) * group_padded >= 64 else 16
    block_m = max(block_m, group_padded)
    block_q = block_m // group_padded
    program_map = [
        (seq, q_block)
        for seq, query_len in enumerate(query_lens)
        for q_block in range(triton.cdiv(query_len, block_q))
    ]
    if not program_map:
        return out
    program_map_t = torch.tensor(program_map, dtype=torch.int32).to(query.device, non_blocking=True)

    _prefill_attention_kernel[(len(program_map), num_kv_heads)](
        query,
        key_cache,
        value_cache,
        out,
        block_tables,
        query_start_loc,
        seq_lens,
        program_map_t,
        scale,
        query.stride(0),
        query.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        value_cache.stride(0),
        value_cache.stride(1),
        value_cache.stride(2),
        out.stride(0),
        out.stride(1),
        block_tables.stride(0),
        GROUP=group,
        GROUP_PADDED=group_padded,
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        HEAD_DIM=head_dim,
        HEAD_DIM_PADDED=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=block_size,
        TILE_N=TILE_N,
        DOT_IN_FP32=upcast,
        DOT_PRECISION=dot_precision(key_cache.dtype),
    )
    return out
