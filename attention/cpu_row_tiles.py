"""Tiles of query rows through csrc/paged_rows_cpu.c: every row's attention computed in an order
fixed by its own context, a key block read once for all the rows of a tile.

Why a kernel of its own: a token's logits are the same bits by every path (prefill, chunks,
decode steps, any batch) only if its attention is; the decode kernel gives that by computing each
row alone, which makes a long prompt reread its context once per row and a prefix that many
requests share be read once per request. A tile of consecutive rows of one sequence, or of the
decodes of sequences whose block tables begin with the same blocks, shares each key and value
block read among its rows and query heads, while each (row, key) pair still goes through one
fixed sequence of operations (see the C source), so how rows are tiled never changes a bit:
tests/attention/test_cpu_row_tiles.py checks it. (vLLM's cascade attention reads a shared prefix
once too, but merges its partial softmax with the rest's, a sum whose order depends on the
batch.)
"""

from __future__ import annotations

import ctypes
import functools
from typing import NamedTuple

import numpy as np
import torch

from pagedray.attention import cpu_kernels

# Rows a prefill tile holds: more share each block read, fewer leave less work past the shorter
# rows' ends and split a prompt into more items for the threads.
TILE_ROWS = 16
# A thread's scores hold a tile's rows times its query heads times the context: past this many
# floats (16 MiB) tiles get fewer rows (bits unchanged), so a 128K context takes a tile of one.
SCORES_BUDGET_FLOATS = 1 << 22

_I64, _F32, _PTR = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
_ARGTYPES = [_PTR, _I64, _PTR, _PTR, _PTR, _I64, _I64, _I64, _PTR, _I64, _PTR, _I64, _I64]
_ARGTYPES += [_I64, _I64, _I64, _I64, _I64, _F32, _PTR, _I64, _I64]
# paged_rows_*'s return codes besides 0 (see the C source).
_NO_MEMORY, _BAD_LENGTH, _BAD_SHAPE, _BAD_INDEX = -1, -2, -3, -4


def supports(dtype: torch.dtype, head_dim: int) -> bool:
    """Whether the kernel serves this element type and head size here."""
    return cpu_kernels.available() and dtype in _entry_points() and head_dim % lanes() == 0


@functools.cache
def lanes() -> int:
    """The kernel's vector width here (8; 16 where it is built for AVX-512): head sizes it takes
    are its multiples."""
    return int(cpu_kernels.library().paged_rows_lanes())


class RowTiles(NamedTuple):
    """A step's rows cut into tiles (plan_tiles), with the bounds the kernel's scratch is sized
    by. The kernel checks each tile against them and against the tensors it reads."""

    entries: torch.Tensor  # [num_entries, 3] int64: a query row, keys it sees, its table row
    tiles: torch.Tensor  # [num_tiles, 3] int64: first entry, entries, leading blocks shared
    max_rows: int  # the most entries a tile holds
    max_seq_len: int  # the most keys a row sees


def tile_rows_for(max_seq_len: int, num_heads: int) -> int:
    """Rows a tile holds for a step whose longest row sees `max_seq_len` keys."""
    return max(1, min(TILE_ROWS, SCORES_BUDGET_FLOATS // max(1, max_seq_len * num_heads)))


def plan_tiles(
    query_start_loc: list[int],  # [num_seqs + 1]: sequence i's rows are [start_i, start_i+1)
    seq_lens: list[int],  # [num_seqs]: keys sequence i's last row sees
    block_size: int,
    tile_rows: int = TILE_ROWS,
    block_tables: torch.Tensor | None = None,  # [num_seqs, max_blocks]: to find shared prefixes
    num_threads: int = 1,
) -> RowTiles:
    """Each sequence's query rows cut into tiles of up to `tile_rows`. A decode is a tile of one,
    unless `block_tables` is given: then decodes whose tables begin with the same block share
    tiles of up to `tile_rows`, each reading the blocks its decodes share once; fewer where the
    step's decodes would leave fewer than two tiles for each of `num_threads` (the reads saved
    are not worth idle cores).

    Planned once a step for every layer, so kept to a few tensor operations: decodes as Python
    lists, a prefill's rows as ranges."""
    num_seqs = len(seq_lens)
    decodes = [s for s in range(num_seqs) if query_start_loc[s + 1] - query_start_loc[s] == 1]
    group_rows = min(tile_rows, max(2, -(-len(decodes) // (2 * max(1, num_threads)))))
    groups = _shared_prefix_groups(decodes, seq_lens, block_size, group_rows, block_tables)
    in_group = {seq for members, _ in groups for seq in members}
    entries: list[int] = []  # decodes' (row, keys, table row), flat
    tiles: list[int] = []  # (first entry, entries, shared blocks), flat
    for members, shared in groups:
        tiles += (len(entries) // 3, len(members), shared)
        for seq in members:
            entries += (query_start_loc[seq], seq_lens[seq], seq)
    for seq in decodes:
        if seq not in in_group:
            tiles += (len(entries) // 3, 1, -(-seq_lens[seq] // block_size))
            entries += (query_start_loc[seq], seq_lens[seq], seq)
    parts = [torch.tensor(entries, dtype=torch.int64).reshape(-1, 3)]
    num_entries = len(entries) // 3
    for seq in range(num_seqs):  # prefill chunks: consecutive rows of one sequence a tile
        start, end = query_start_loc[seq], query_start_loc[seq + 1]
        if end - start < 2:
            continue
        first_keys = seq_lens[seq] - (end - start) + 1
        rows = torch.arange(start, end, dtype=torch.int64)
        parts.append(
            torch.stack([rows, rows + (first_keys - start), torch.full_like(rows, seq)], 1)
        )
        for row in range(start, end, tile_rows):
            count = min(tile_rows, end - row)
            last_keys = first_keys + row - start + count - 1
            tiles += (num_entries + row - start, count, -(-last_keys // block_size))
        num_entries += end - start
    tile_tensor = torch.tensor(tiles, dtype=torch.int64).reshape(-1, 3)
    return RowTiles(
        torch.cat(parts) if len(parts) > 1 else parts[0],
        tile_tensor,
        max(tiles[1::3], default=0),
        max(seq_lens, default=0),
    )


def _shared_prefix_groups(
    decodes: list[int],
    seq_lens: list[int],
    block_size: int,
    tile_rows: int,
    block_tables: torch.Tensor | None,
) -> list[tuple[list[int], int]]:
    """Decodes whose block tables begin with the same block, `tile_rows` at most a group, with
    how many leading blocks all of a group's tables hold alike (within every member's keys)."""
    if block_tables is None or len(decodes) < 2 or tile_rows < 2:
        return []
    tables = block_tables.numpy()  # a CPU tensor's memory: numpy is cheaper on small arrays
    by_first: dict[int, list[int]] = {}
    for seq, first in zip(decodes, tables[decodes, 0].tolist()):
        by_first.setdefault(first, []).append(seq)
    chunks = [
        members[i : i + tile_rows]
        for members in by_first.values()
        for i in range(0, len(members), tile_rows)
    ]
    chunks = [chunk for chunk in chunks if len(chunk) >= 2]
    if not chunks:
        return []
    members = [seq for chunk in chunks for seq in chunk]
    leaders = [chunk[0] for chunk in chunks for _ in chunk]
    width = -(-max(seq_lens[seq] for seq in members) // block_size)
    same = tables[members, :width] == tables[leaders, :width]
    alike = np.logical_and.accumulate(same, axis=1).sum(axis=1).tolist()
    groups, at = [], 0
    for chunk in chunks:
        own = min(-(-seq_lens[seq] // block_size) for seq in chunk)
        groups.append((chunk, min(own, *alike[at : at + len(chunk)])))
        at += len(chunk)
    return groups


def paged_rows(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], contiguous
    value_cache: torch.Tensor,  # same as key_cache
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    plan: RowTiles,
    scale: float,
    out: torch.Tensor,  # like query: the tiles' rows are written
) -> None:
    """Attention of each tile's rows over their contexts, read in place."""
    tiles, entries = plan.tiles, plan.entries
    if tiles.numel() == 0:
        return
    cpu_kernels.check_layout(query, key_cache, value_cache, block_tables, out)
    for name, index in (("tiles", tiles), ("entries", entries)):
        cpu_kernels.check_index_tensor(name, index, torch.int64)
        if index.dim() != 2 or index.shape[1] != 3 or not index.is_contiguous():
            raise ValueError(f"{name}: expected a contiguous [n, 3] tensor, got {index.shape}")
    if out.shape != query.shape or key_cache.shape != value_cache.shape:
        raise ValueError(f"out {out.shape} must be query's {query.shape}, the caches one shape")
    _, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    if -(-plan.max_seq_len // block_size) > block_tables.shape[1]:
        raise ValueError(f"{plan.max_seq_len} keys need more blocks than block_tables holds")
    entry = _entry_points().get(query.dtype)
    if entry is None or head_dim % lanes():
        raise ValueError(f"no CPU row-tile kernel for {query.dtype} at head size {head_dim}")
    status = entry(
        *cpu_kernels.cache_args(query, key_cache, value_cache, block_tables),
        query.shape[0],
        block_tables.shape[0],
        entries.data_ptr(),
        entries.shape[0],
        tiles.data_ptr(),
        tiles.shape[0],
        plan.max_rows,
        num_heads,
        num_kv_heads,
        head_dim,
        block_size,
        plan.max_seq_len,
        float(scale),
        out.data_ptr(),
        out.stride(0),
        torch.get_num_threads(),
    )
    if status == _BAD_LENGTH:
        raise ValueError(
            f"a tile's rows see no keys or more than {plan.max_seq_len}, or it shares more "
            "blocks than its rows read"
        )
    if status == _BAD_INDEX:
        raise ValueError(
            "a tile names an entry, a query row or a block_tables row that is not there, or "
            "tables that differ in a block it reads as shared"
        )
    if status == _NO_MEMORY:
        raise MemoryError("CPU row tiles: could not allocate a thread's scratch")
    if status == _BAD_SHAPE:
        raise ValueError(f"head size {head_dim} is not a multiple of {lanes()}")


@functools.cache
def _entry_points() -> dict[torch.dtype, cpu_kernels.CFunction]:
    lib = cpu_kernels.library()
    entries = {}
    for dtype, name in ((torch.float32, "paged_rows_f32"), (torch.bfloat16, "paged_rows_bf16")):
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = _ARGTYPES, ctypes.c_int
        entries[dtype] = fn
    return entries
