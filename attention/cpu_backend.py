"""The CPU attention backend: C kernels that read K/V blocks in place, every query row computed
in an order fixed by its own context, whichever step computes it.

In plain torch, attention costs a gather that copies each sequence's whole context per layer
before SDPA reads it again. The C kernels walk the block tables instead.

By default every row, a decode's or a prefill chunk's, goes through csrc/paged_rows_cpu.c
(attention/cpu_row_tiles.py): tiles of up to 16 consecutive rows of one sequence, or of up to 16
decodes whose sequences share a cached prefix, share each key and value block read (a shared prefix
is read once a tile, not once a decode), and each (row, key) pair goes through one fixed sequence
of operations, so a row's result depends on its own context only. The projections are oneDNN GEMMs
whose rows do not depend on how many rows a call has, so a token's logits are the same bits whether
its context was computed by a prefill, in chunks, one decode step at a time, beside other requests
or behind a prefix that decode steps wrote (tests/engine/test_exact_rows.py), on CPUs of one
instruction set (the kernels and oneDNN compile for the CPU they run on). That is what lets a
seeded stream resumed on another engine, a preempted request recomputed, or a turn behind a cached
prefix draw the tokens it would have drawn (without it, about one sampled stream in 17-30 resumed
on the default model departed). Float16 and head sizes the tile kernel does not take go through
csrc/paged_decode_cpu.c one row at a time, with the same property (where the compiler has no
_Float16, float16 takes the torch reference, by path). Tiles get fewer rows where a thread's scores
would pass 16 MiB (long contexts); the bits do not change.

`PAGEDRAY_EXACT_ATTENTION=0` takes the kernels by path instead: csrc/paged_decode_cpu.c for
sequences with one new token (AVX-512 where the CPU has it), csrc/paged_prefill_cpu.c for
prefill chunks (flash attention laid out for AVX-512, a cached prefix never copied), torch's
flash SDPA for bfloat16 chunks and where neither serves (no AVX-512, an odd head size). They
round a row differently by path. Measured on a 2-core AVX2 VM (docs/performance.md), the tiles
cost nothing against them: a prompt's attention in 0.45x the time at 512 tokens and 1.0x at
2-4K (Qwen2.5-0.5B's heads), decodes 0.7-0.8x with GQA and 1.0-1.1x without. Storing K/V and
copying blocks are the reference's own, already single indexed copies.
"""

from __future__ import annotations

import functools
import os
from typing import NamedTuple

import torch
import torch.nn.functional as F

from pagedray.attention import cpu_kernels, cpu_row_tiles, torch_ref
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
    if exact_rows() and cpu_kernels.supports(query.dtype):
        attend_rows(query, key_cache, value_cache, metadata, scale, out)
        return out
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


def attend_rows(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim], heads contiguous
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    out: torch.Tensor,  # [num_tokens, num_heads, head_dim], every row written
) -> None:
    """Every query row computed in an order fixed by its own context (see the module): through
    the row-tile kernel, or where it does not serve (float16, a head size it does not take),
    through the decode kernel as a sequence of its own."""
    if cpu_row_tiles.supports(query.dtype, query.shape[-1]):
        tiles = metadata.scratch.get("cpu.tiles")
        if tiles is None:  # the same for every layer of the step
            tile_rows = cpu_row_tiles.tile_rows_for(metadata.max_seq_len, query.shape[1])
            tiles = metadata.scratch["cpu.tiles"] = cpu_row_tiles.plan_tiles(
                metadata.query_start_loc_cpu,
                metadata.seq_lens_cpu,
                key_cache.shape[1],
                tile_rows,
                metadata.block_tables,  # decodes behind a shared prefix read it once
                torch.get_num_threads(),
            )
        cpu_row_tiles.paged_rows(
            query, key_cache, value_cache, metadata.block_tables, tiles, scale, out
        )
        return
    rows = metadata.scratch.get("cpu.rows")
    if rows is None:  # the same for every layer of the step
        rows = metadata.scratch["cpu.rows"] = _plan_rows(metadata)
    cpu_kernels.paged_decode(
        query,
        key_cache,
        value_cache,
        metadata.block_tables,
        rows.seq_lens,
        rows.query_start_loc,
        rows.seqs,
        rows.max_seq_len,
        scale,
        out,
        table_rows=rows.table_rows,
    )


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


EXACT_ATTENTION_ENV = "PAGEDRAY_EXACT_ATTENTION"


@functools.cache
def exact_rows() -> bool:
    """Whether every query row is computed in an order fixed by its own context (see the
    module): yes unless the setting says no (0, false, no, off)."""
    return os.environ.get(EXACT_ATTENTION_ENV, "1").strip().lower() not in (
        "0",
        "false",
        "no",
        "off",
    )


class _Rows(NamedTuple):
    """paged_decode's arguments with every query row a sequence of its own: row r of a chunk
    whose first new token is at position p sees p + r + 1 keys of its sequence's blocks."""

    seq_lens: torch.Tensor  # [num_rows] int32: keys each row sees
    query_start_loc: torch.Tensor  # [num_rows + 1] int32: row i is query row i
    seqs: torch.Tensor  # [num_rows] int64: the rows to compute
    max_seq_len: int
    table_rows: torch.Tensor | None  # [num_rows] int64: its sequence's block table; None: itself


def _plan_rows(metadata: AttentionMetadata) -> _Rows:
    max_seq_len = max(metadata.seq_lens_cpu, default=0)
    if metadata.max_query_len <= 1:  # decodes only: each sequence is its one row already
        seqs = torch.tensor(torch_ref.decode_seqs(metadata), dtype=torch.int64)
        return _Rows(metadata.seq_lens, metadata.query_start_loc, seqs, max_seq_len, None)
    starts = torch.tensor(metadata.query_start_loc_cpu, dtype=torch.int64)  # [num_seqs + 1]
    query_lens = starts[1:] - starts[:-1]  # [num_seqs]
    num_rows = int(starts[-1])
    seq_of_row = torch.repeat_interleave(torch.arange(metadata.num_seqs), query_lens)  # [rows]
    first_position = torch.tensor(metadata.seq_lens_cpu, dtype=torch.int64) - query_lens
    row_lens = first_position[seq_of_row] + torch.arange(num_rows) - starts[seq_of_row] + 1
    return _Rows(
        row_lens.to(torch.int32),
        torch.arange(num_rows + 1, dtype=torch.int32),
        torch.arange(num_rows, dtype=torch.int64),
        max_seq_len,
        seq_of_row,
    )


def _plan_extends(metadata: AttentionMetadata) -> torch.Tensor:  # [num_extends] int64
    starts = metadata.query_start_loc_cpu
    seqs = [i for i in range(metadata.num_seqs) if starts[i + 1] - starts[i] > 1]
    return torch.tensor(seqs, dtype=torch.int64)


def _plan_decodes(metadata: AttentionMetadata) -> tuple[torch.Tensor, int]:
    seqs = torch_ref.decode_seqs(metadata)
    max_seq_len = max((metadata.seq_lens_cpu[i] for i in seqs), default=0)
    return torch.tensor(seqs, dtype=torch.int64), max_seq_len


def arithmetic() -> str:
    """The setting, the kernels' build (source, compiler, this CPU's instruction set) and torch's
    version: what decides a block's bits here (see AttentionBackend)."""
    setting = "exact rows" if exact_rows() else "by path"
    return f"cpu {setting}, kernels {cpu_kernels.build_key()}, torch {torch.__version__}"


CPU_BACKEND = AttentionBackend(
    name="cpu",
    store_kv=torch_ref.store_kv,
    paged_attention=paged_attention,
    copy_blocks=torch_ref.copy_blocks,
    arithmetic=arithmetic,
)
