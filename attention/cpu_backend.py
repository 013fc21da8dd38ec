"""The CPU attention backend: C kernels that read K/V blocks in place, for decodes and prefills.

In plain torch, attention costs a gather that copies each sequence's whole context per layer
before SDPA reads it again. The C kernels walk the block tables instead: csrc/paged_decode_cpu.c
for sequences with one new token, csrc/paged_prefill_cpu.c for prefill chunks (flash attention
laid out for AVX-512, and a cached prefix is never copied). Where the prefill kernel does not
serve (no AVX-512, an odd head size) the torch reference's path does.

In bfloat16 a prefill chunk goes to torch's flash SDPA instead, over its context gathered from
the blocks: the C kernel computes bf16 in fp32 vector lanes, 5.7 ms a layer for a 512-token
prompt of the Qwen2.5-0.5B shape, where SDPA's bf16 GEMMs (oneDNN, AMX where the CPU has it) take
1.6 ms and the gather 0.1. One path for every chunk, fresh or behind a cached prefix: a row's
result depends only on its own context (the kv split is fixed by the context length), so prefix
caching leaves it unchanged (tests/attention/test_cpu_backend_sdpa.py). fp32 keeps the C kernel.
Storing K/V and copying blocks are the reference's own, already single indexed copies.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedray.attention import cpu_kernels, torch_ref
from pagedray.attention.interface import AttentionBackend
from pagedray.attention.metadata import AttentionMetadata


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    metadata: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Attention of each sequence's new tokens over its whole context (contract of torch_ref)."""
    if query.stride(-1) != 1 or query.stride(-2) != query.shape[-1]:
        query = query.contiguous()
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if not cpu_kernels.supports(query.dtype):
        torch_ref.attend_decodes(query, key_cache, value_cache, metadata, scale, out)
    else:
        decodes = metadata.scratch.get("cpu.decodes")
        if decodes is None:
            decodes = metadata.scratch["cpu.decodes"] = _plan_decodes(metadata)
        seqs, max_seq_len = decodes
        cpu_kernels.paged_decode(
            query,
            key_cache,
            value_cache,
            metadata.block_tables,
            metadata.seq_lens,
            metadata.query_start_loc,
            seqs,
            max_seq_len,
            scale,
            out,
        )
    extends = metadata.scratch.get("cpu.extends")
    if extends is None:
        extends = metadata.scratch["cpu.extends"] = _plan_extends(metadata)
    if extends.numel() == 0:
        return out
    if query.dtype == torch.bfloat16:
        attend_extends_by_sdpa(query, key_cache, value_cache, metadata, extends, scale, out)
    elif cpu_kernels.prefill_supported(query.dtype, query.shape[-1]):
        cpu_kernels.paged_prefill(
            query,
            key_cache,
            value_cache,
            metadata.block_tables,
            metadata.seq_lens,
            metadata.query_start_loc,
            extends,
            scale,
            out,
        )
    else:
        torch_ref.attend_extends(query, key_cache, value_cache, metadata, scale, out)
    return out


def attend_extends_by_sdpa(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,
    metadata: AttentionMetadata,
    extends: torch.Tensor,  # [num_extends] int64: the prefill chunks' sequence indices
    scale: float,
    out: torch.Tensor,  # [num_tokens, num_heads, head_dim], written for the chunks' rows
) -> None:
    """Each prefill chunk's rows over its context (cached prefix, earlier chunks, itself),
    causal at the bottom right: torch's SDPA over the context's K/V gathered from its blocks."""
    chunks = metadata.scratch.get("cpu.sdpa_chunks")
    if chunks is None:  # the same for every layer of the step
        chunks = metadata.scratch["cpu.sdpa_chunks"] = _plan_sdpa_chunks(
            metadata, extends, key_cache.shape[1]
        )
    for start, end, context, blocks, mask in chunks:
        keys = key_cache[blocks].flatten(0, 1)[:context].transpose(0, 1)  # [kv_heads, ctx, d]
        values = value_cache[blocks].flatten(0, 1)[:context].transpose(0, 1)
        rows = query[start:end].transpose(0, 1)  # [heads, rows, d]
        attended = F.scaled_dot_product_attention(
            rows.unsqueeze(0),
            keys.unsqueeze(0),
            values.unsqueeze(0),
            attn_mask=mask,
            is_causal=mask is None,
            scale=scale,
            enable_gqa=True,
        )
        out[start:end] = attended[0].transpose(0, 1)


SdpaChunk = tuple[int, int, int, torch.Tensor, "torch.Tensor | None"]


def _plan_sdpa_chunks(
    metadata: AttentionMetadata, extends: torch.Tensor, block_size: int
) -> list[SdpaChunk]:
    """Per prefill chunk: its rows [start, end), its context length, its blocks (int64) and its
    mask: None for a chunk that is its whole context (plain causal), else row j seeing the
    context up to its own position, context - num_rows + j."""
    starts, seq_lens = metadata.query_start_loc_cpu, metadata.seq_lens_cpu
    chunks: list[SdpaChunk] = []
    for seq in extends.tolist():
        start, end, context = starts[seq], starts[seq + 1], seq_lens[seq]
        blocks = metadata.block_tables[seq, : -(-context // block_size)].long()
        num_rows = end - start
        mask = None
        if num_rows != context:
            positions = torch.arange(context - num_rows, context)
            mask = torch.arange(context)[None, :] <= positions[:, None]
        chunks.append((start, end, context, blocks, mask))
    return chunks


def _plan_extends(metadata: AttentionMetadata) -> torch.Tensor:  # [num_extends] int64
    starts = metadata.query_start_loc_cpu
    seqs = [i for i in range(metadata.num_seqs) if starts[i + 1] - starts[i] > 1]
    return torch.tensor(seqs, dtype=torch.int64)


def _plan_decodes(metadata: AttentionMetadata) -> tuple[torch.Tensor, int]:
    seqs = torch_ref.decode_seqs(metadata)
    max_seq_len = max((metadata.seq_lens_cpu[i] for i in seqs), default=0)
    return torch.tensor(seqs, dtype=torch.int64), max_seq_len


CPU_BACKEND = AttentionBackend(
    name="cpu",
    store_kv=torch_ref.store_kv,
    paged_attention=paged_attention,
    copy_blocks=torch_ref.copy_blocks,
)
