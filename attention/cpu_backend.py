"""The CPU attention backend: C kernels that read K/V blocks in place, for decodes and prefills.

In plain torch, attention costs a gather that copies each sequence's whole context per layer
before SDPA reads it again. The C kernels walk the block tables instead: csrc/paged_decode_cpu.c
for sequences with one new token, csrc/paged_prefill_cpu.c for prefill chunks (flash attention
laid out for AVX-512, 3-5x torch's CPU SDPA here, and a cached prefix is never copied). Where the
prefill kernel does not serve (no AVX-512, an odd head size) the torch reference's path does.
Storing K/V and copying blocks are the reference's own, already single indexed copies.
"""

from __future__ import annotations

import torch

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
    if cpu_kernels.prefill_supported(query.dtype, query.shape[-1]):
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
