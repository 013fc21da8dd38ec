"""Plain-torch paged attention: the CPU backend and the oracle the Triton kernels are tested by.

Speed on CPU comes from doing the per-step work once: the first layer derives gather indices and
masks from the block tables and keeps them in `metadata.scratch`; every layer then runs one
gather and one fused SDPA call per group of sequences. Decodes are grouped by context length so
that padding to the longest in a group wastes little. The CPU backend (cpu_backend.py) reuses the
prefill half and replaces the decode half with a C kernel that reads blocks in place.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagedray.attention.metadata import AttentionMetadata

# A decode joins the current length group while its context is at least this fraction of the
# group's longest; below it, padding would cost more than another SDPA call.
_GROUP_FILL = 0.7


def store_kv(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64, -1 = padding
) -> None:
    """Write each token's K and V into its slot of the paged cache."""
    num_kv_heads, head_dim = key_cache.shape[-2:]
    if bool((slot_mapping < 0).any()):
        valid = slot_mapping >= 0
        key, value, slot_mapping = key[valid], value[valid], slot_mapping[valid]
    key_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key.to(key_cache.dtype))
    value_cache.view(-1, num_kv_heads, head_dim).index_copy_(
        0, slot_mapping, value.to(value_cache.dtype)
    )


@dataclass
class _DecodeGroup:
    """Decodes of similar context length, gathered and attended together."""

    token_idx: torch.Tensor  # [group] int64: rows of the query / output
    block_ids: torch.Tensor  # [group, num_blocks] int64: block table, cut to the longest
    mask: torch.Tensor  # [group, 1, 1, num_blocks * block_size] float: 0 in context, else -inf


@dataclass
class _Extend:
    """One sequence with several new tokens: a prefill chunk over its cached context."""

    start: int  # first query row
    end: int
    seq_len: int
    block_ids: torch.Tensor  # [num_blocks] int64
    mask: torch.Tensor | None  # [query_len, seq_len] bool; None = plain causal (no context)


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    metadata: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Attention of each sequence's new tokens over its whole context, read through block tables."""
    out = torch.empty_like(query)
    attend_decodes(query, key_cache, value_cache, metadata, scale, out)
    attend_extends(query, key_cache, value_cache, metadata, scale, out)
    return out


def attend_decodes(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    out: torch.Tensor,
) -> None:
    """Writes the rows of `out` that belong to sequences with one new token."""
    groups = metadata.scratch.get("torch_ref.decodes")
    if groups is None:
        groups = _plan_decodes(metadata, key_cache.shape[1])
        metadata.scratch["torch_ref.decodes"] = groups
    _, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    for group in groups:
        # NOTE: the query heads sharing a KV head attend to the same keys under the same mask,
        # so they go in as that KV head's "query rows": no K/V expansion for GQA.
        q = query.index_select(0, group.token_idx)
        q = q.view(-1, num_kv_heads, num_heads // num_kv_heads, head_dim)  # [seqs, kv, group, dim]
        k = _gather(key_cache, group.block_ids).transpose(1, 2)  # [seqs, kv_heads, len, dim]
        v = _gather(value_cache, group.block_ids).transpose(1, 2)
        o = _sdpa(q, k, v, group.mask, scale)  # [seqs, kv_heads, group, dim]
        out.index_copy_(0, group.token_idx, o.reshape(-1, num_heads, head_dim))


def attend_extends(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    out: torch.Tensor,
) -> None:
    """Writes the rows of `out` that belong to sequences with several new tokens (prefills)."""
    extends = metadata.scratch.get("torch_ref.extends")
    if extends is None:
        extends = _plan_extends(metadata, key_cache.shape[1])
        metadata.scratch["torch_ref.extends"] = extends
    for ext in extends:
        # NOTE: batched (4-D) inputs, because torch's CPU SDPA takes its flash kernel only for
        # those; 3-D ones fall back to the unfused math path, about 3x slower.
        q = query[None, ext.start : ext.end].transpose(1, 2)  # [1, heads, query_len, dim]
        # [1, kv_heads, seq_len, dim]
        k = _gather(key_cache, ext.block_ids)[None, : ext.seq_len].transpose(1, 2)
        v = _gather(value_cache, ext.block_ids)[None, : ext.seq_len].transpose(1, 2)
        o = _sdpa(q, k, v, ext.mask, scale, is_causal=ext.mask is None)
        out[ext.start : ext.end] = o[0].transpose(0, 1)


def decode_seqs(metadata: AttentionMetadata) -> list[int]:
    """The sequences of this step with exactly one new token."""
    starts = metadata.query_start_loc_cpu
    return [i for i in range(metadata.num_seqs) if starts[i + 1] - starts[i] == 1]


def _gather(
    cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    block_ids: torch.Tensor,  # [..., num_blocks_used] int64
) -> torch.Tensor:  # [..., num_blocks_used * block_size, kv_heads, head_dim]
    # NOTE: whole blocks by index_select: several times faster on CPU than advanced indexing
    # of single slots, which copies rows of one token each.
    blocks = cache.index_select(0, block_ids.reshape(-1))
    return blocks.view(*block_ids.shape[:-1], -1, *cache.shape[2:])


def _sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    is_causal: bool = False,
) -> torch.Tensor:
    k, v = k.to(q.dtype), v.to(q.dtype)
    return F.scaled_dot_product_attention(
        q,
        k,
        v,
        attn_mask=mask,
        is_causal=is_causal,
        scale=scale,
        enable_gqa=q.shape[-3] != k.shape[-3],
    )


def _plan_decodes(metadata: AttentionMetadata, block_size: int) -> list[_DecodeGroup]:
    """Gather indices and masks for one step's decodes, shared by every layer."""
    seq_lens = metadata.seq_lens_cpu
    decodes = sorted(decode_seqs(metadata), key=lambda i: -seq_lens[i])
    groups: list[list[int]] = []
    for i in decodes:
        if not groups or seq_lens[i] < _GROUP_FILL * seq_lens[groups[-1][0]]:
            groups.append([])
        groups[-1].append(i)
    device = metadata.block_tables.device
    return [_decode_group(metadata, seqs, block_size, device) for seqs in groups]


def _plan_extends(metadata: AttentionMetadata, block_size: int) -> list[_Extend]:
    """Block ids and masks for one step's prefill chunks, shared by every layer."""
    starts = metadata.query_start_loc_cpu
    device = metadata.block_tables.device
    return [
        _extend(metadata, i, starts[i], starts[i + 1], block_size, device)
        for i in range(metadata.num_seqs)
        if starts[i + 1] - starts[i] > 1
    ]


def _decode_group(
    metadata: AttentionMetadata, seqs: list[int], block_size: int, device: torch.device
) -> _DecodeGroup:
    lens = torch.tensor([metadata.seq_lens_cpu[i] for i in seqs], device=device)
    num_blocks = -(-int(lens[0]) // block_size)
    # Table entries past a sequence's last block are stale but valid ids: read, then masked.
    block_ids = metadata.block_tables[seqs, :num_blocks].long()
    positions = torch.arange(num_blocks * block_size, device=device)
    outside = positions[None, :] >= lens[:, None]  # [group, num_blocks * block_size]
    mask = torch.zeros(outside.shape, dtype=torch.float32, device=device)
    mask.masked_fill_(outside, float("-inf"))
    token_idx = torch.tensor([metadata.query_start_loc_cpu[i] for i in seqs], device=device)
    return _DecodeGroup(token_idx=token_idx, block_ids=block_ids, mask=mask[:, None, None, :])


def _extend(
    metadata: AttentionMetadata,
    seq: int,
    start: int,
    end: int,
    block_size: int,
    device: torch.device,
) -> _Extend:
    seq_len, query_len = metadata.seq_lens_cpu[seq], end - start
    block_ids = metadata.block_tables[seq, : -(-seq_len // block_size)].long()
    mask = None
    if seq_len > query_len:
        # Query token j sits at position context_len + j and sees keys 0..context_len + j.
        q_pos = torch.arange(query_len, device=device)[:, None] + (seq_len - query_len)
        mask = torch.arange(seq_len, device=device)[None, :] <= q_pos  # [query_len, seq_len]
    return _Extend(start=start, end=end, seq_len=seq_len, block_ids=block_ids, mask=mask)


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
