"""Plain-torch paged attention: the CPU backend and the oracle the Triton kernels are tested by."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedray.attention.metadata import AttentionMetadata


def store_kv(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64, -1 = padding
) -> None:
    """Write each token's K and V into its slot of the paged cache."""
    num_kv_heads, head_dim = key_cache.shape[-2:]
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    key_cache.view(-1, num_kv_heads, head_dim)[slots] = key[valid].to(key_cache.dtype)
    value_cache.view(-1, num_kv_heads, head_dim)[slots] = value[valid].to(value_cache.dtype)


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    metadata: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Attention of each sequence's new tokens over its whole context, read through block tables.

    Decodes (one query token) are batched into one padded computation; prefill chunks run one
    sequence at a time with a causal mask offset by the cached context length.
    """
    out = torch.empty_like(query)
    starts = metadata.query_start_loc_cpu
    seq_lens = metadata.seq_lens_cpu
    decode_seqs = [i for i in range(metadata.num_seqs) if starts[i + 1] - starts[i] == 1]
    if decode_seqs:
        token_idx = [starts[i] for i in decode_seqs]
        out[token_idx] = _decode_attention(
            query[token_idx], key_cache, value_cache, metadata, decode_seqs, scale
        )
    for i in range(metadata.num_seqs):
        start, end = starts[i], starts[i + 1]
        if end - start <= 1:
            continue
        out[start:end] = _extend_attention(
            query[start:end], key_cache, value_cache, metadata.block_tables[i], seq_lens[i], scale
        )
    return out


def _gather_context(
    cache: torch.Tensor, block_table: torch.Tensor, seq_len: int
) -> torch.Tensor:  # [..., num_blocks_used * block_size, num_kv_heads, head_dim]
    block_size = cache.shape[1]
    num_blocks = -(-seq_len // block_size)
    blocks = cache[block_table[..., :num_blocks].long()]  # [..., num_blocks, bs, kv_heads, dim]
    return blocks.flatten(-4, -3)


def _decode_attention(
    query: torch.Tensor,  # [batch, num_heads, head_dim]
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    metadata: AttentionMetadata,
    seqs: list[int],
    scale: float,
) -> torch.Tensor:  # [batch, num_heads, head_dim]
    batch, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    group = num_heads // num_kv_heads
    lens = [metadata.seq_lens_cpu[i] for i in seqs]
    max_len = max(lens)
    tables = metadata.block_tables[seqs]
    keys = _gather_context(key_cache, tables, max_len)  # [batch, ctx, kv_heads, dim]
    values = _gather_context(value_cache, tables, max_len)
    q = query.view(batch, num_kv_heads, group, head_dim).float()
    scores = torch.einsum("bkgd,btkd->bkgt", q, keys.float()) * scale  # [batch, kv, group, ctx]
    positions = torch.arange(keys.shape[1], device=query.device)
    lens_t = torch.tensor(lens, device=query.device)
    mask = positions[None, :] >= lens_t[:, None]  # [batch, ctx]: padding past each seq_len
    scores.masked_fill_(mask[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("bkgt,btkd->bkgd", probs, values.float())
    return out.reshape(batch, num_heads, head_dim).to(query.dtype)


def _extend_attention(
    query: torch.Tensor,  # [query_len, num_heads, head_dim]
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,  # [max_num_blocks_per_seq]
    seq_len: int,
    scale: float,
) -> torch.Tensor:  # [query_len, num_heads, head_dim]
    query_len, num_heads, _ = query.shape
    num_kv_heads = key_cache.shape[2]
    keys = _gather_context(key_cache, block_table, seq_len)[:seq_len]  # [seq_len, kv, dim]
    values = _gather_context(value_cache, block_table, seq_len)[:seq_len]
    group = num_heads // num_kv_heads
    keys = keys.repeat_interleave(group, dim=1).transpose(0, 1)  # [heads, seq_len, dim]
    values = values.repeat_interleave(group, dim=1).transpose(0, 1)
    context_len = seq_len - query_len
    # Query token j sits at absolute position context_len + j and sees keys 0..context_len + j.
    q_pos = torch.arange(query_len, device=query.device)[:, None] + context_len
    k_pos = torch.arange(seq_len, device=query.device)[None, :]
    mask = k_pos <= q_pos  # [query_len, seq_len]
    out = F.scaled_dot_product_attention(
        query.transpose(0, 1).to(keys.dtype), keys, values, attn_mask=mask, scale=scale
    )  # [heads, query_len, dim]
    return out.transpose(0, 1).to(query.dtype)


def copy_blocks(
    kv_cache: torch.Tensor,  # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
    src_block_ids: list[int],
    dst_block_ids: list[int],
) -> None:
    """Copy-on-write: duplicate whole blocks for every layer, K and V, in one indexed copy."""
    if not src_block_ids:
        return
    src = torch.tensor(src_block_ids, device=kv_cache.device)
    dst = torch.tensor(dst_block_ids, device=kv_cache.device)
    kv_cache[:, :, dst] = kv_cache[:, :, src]
