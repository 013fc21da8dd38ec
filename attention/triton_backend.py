"""The Triton attention backend: the kernels of this folder bound to the AttentionBackend interface.

All-decode batches take the split-K decode kernel (few query rows, long contexts); anything with a
prefill chunk takes the unified prefill kernel, which also serves the decodes mixed into it.
"""

from __future__ import annotations

import torch

from pagedray.attention.interface import AttentionBackend
from pagedray.attention.metadata import AttentionMetadata
from pagedray.attention.triton_copy_blocks import copy_blocks
from pagedray.attention.triton_decode import decode_attention
from pagedray.attention.triton_prefill import prefill_attention
from pagedray.attention.triton_store_kv import store_kv


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    metadata: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Attention of each sequence's new tokens over its whole context (contract of torch_ref)."""
    out = torch.empty_like(query)
    num_seqs = metadata.num_seqs
    if num_seqs == 0:
        return out
    # Exactly one token per sequence means query row i belongs to sequence i.
    if metadata.max_query_len == 1 and metadata.query_start_loc_cpu[-1] == num_seqs:
        decode_attention(
            query[:num_seqs],
            key_cache,
            value_cache,
            metadata.block_tables,
            metadata.seq_lens,
            metadata.max_seq_len,
            scale,
            out=out[:num_seqs],
        )
        return out
    return prefill_attention(
        query,
        key_cache,
        value_cache,
        metadata.block_tables,
        metadata.query_start_loc,
        metadata.seq_lens,
        metadata.query_start_loc_cpu,
        scale,
        out=out,
    )


def arithmetic() -> str:
    """The device, torch's and Triton's versions (see AttentionBackend)."""
    import triton

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "no device"
    return f"triton {triton.__version__} on {device}, torch {torch.__version__}"


TRITON_BACKEND = AttentionBackend(
    name="triton",
    store_kv=store_kv,
    paged_attention=paged_attention,
    copy_blocks=copy_blocks,
    arithmetic=arithmetic,
)
