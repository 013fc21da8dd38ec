"""Tiles of query rows through csrc/paged_rows_cpu.c: every row's attention computed in an order
fixed by its own context, a key block read once for all the rows of a tile.

Why a kernel of its own: a token's logits are the same bits by every path (prefill, chunks,
decode steps, any batch) only if its attention is; the decode kernel gives that by computing each
row alone, which makes a long prompt reread its context once per row. A tile of consecutive rows
of one sequence shares each key and value block read among its rows and query heads, while each
(row, key) pair still goes through one fixed sequence of operations (see the C source), so how
rows are tiled never changes a bit: tests/attention/test_cpu_row_tiles.py checks it.
"""

from __future__ import annotations

import ctypes
import functools
from typing import NamedTuple

import torch

from pagedray.attention import cpu_kernels

# Rows a prefill tile holds: more share each block read, fewer leave less work past the shorter
# rows' ends and split a prompt into more items for the threads.
TILE_ROWS = 16
# A thread's scores hold a tile's rows times its query heads times the context: past this many
# floats (16 MiB) tiles get fewer rows (bits unchanged), so a 128K context takes a tile of one.
SCORES_BUDGET_FLOATS = 1 << 22

_I64, _F32, _PTR = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
_ARGTYPES = [_PTR, _I64, _PTR, _PTR, _PTR, _I64, _PTR, _I64, _I64]
_ARGTYPES += [_I64, _I64, _I64, _I64, _I64, _F32, _PTR, _I64, _I64]
# paged_rows_*'s return codes besides 0 (see the C source).
_NO_MEMORY, _BAD_LENGTH, _BAD_SHAPE = -1, -2, -3


def supports(dtype: torch.dtype, head_dim: int) -> bool:
    """Whether the kernel serves this element type and head size here."""
    return cpu_kernels.available() and dtype in _entry_points() and head_dim % lanes() == 0


@functools.cache
def lanes() -> int:
    """The kernel's vector width here (8; 16 where it is built for AVX-512): head sizes it takes
    are its multiples."""
    return int(cpu_kernels.library().paged_rows_lanes())


class RowTiles(NamedTuple):
    """A step's rows cut into tiles (plan_tiles), with the bounds paged_rows checks them by."""

    tiles: torch.Tensor  # [num_tiles, 4] int64: first row, rows, keys its first row sees, table row
    max_rows: int  # the most rows a tile holds
    rows_end: int  # one past the last query row a tile names
    tables_end: int  # one past the last block_tables row a tile names
    max_seq_len: int  # the most keys a row sees


def tile_rows_for(max_seq_len: int, num_heads: int) -> int:
    """Rows a tile holds for a step whose longest row sees `max_seq_len` keys."""
    return max(1, min(TILE_ROWS, SCORES_BUDGET_FLOATS // max(1, max_seq_len * num_heads)))


def plan_tiles(
    query_start_loc: list[int],  # [num_seqs + 1]: sequence i's rows are [start_i, start_i+1)
    seq_lens: list[int],  # [num_seqs]: keys sequence i's last row sees
    tile_rows: int = TILE_ROWS,
) -> RowTiles:
    """Each sequence's query rows cut into tiles of up to `tile_rows` (a decode: a tile of one)."""
    num_rows = len(seq_lens)
    if list(query_start_loc) == list(range(num_rows + 1)):  # decodes only: a tile a sequence
        lens = torch.tensor(seq_lens, dtype=torch.int64)
        seqs = torch.arange(num_rows, dtype=torch.int64)
        tiles_tensor = torch.stack([seqs, torch.ones_like(seqs), lens, seqs], dim=1)
        return RowTiles(
            tiles_tensor, int(num_rows > 0), num_rows, num_rows, max(seq_lens, default=0)
        )
    tiles: list[tuple[int, int, int, int]] = []
    for seq, seq_len in enumerate(seq_lens):
        start, end = query_start_loc[seq], query_start_loc[seq + 1]
        first_position = seq_len - (end - start)
        for row in range(start, end, tile_rows):
            rows = min(tile_rows, end - row)
            tiles.append((row, rows, first_position + row - start + 1, seq))
    return RowTiles(
        torch.tensor(tiles, dtype=torch.int64).reshape(-1, 4),
        max((t[1] for t in tiles), default=0),
        max((t[0] + t[1] for t in tiles), default=0),
        len(seq_lens),
        max(seq_lens, default=0),
    )


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
    tiles = plan.tiles
    if tiles.numel() == 0:
        return
    cpu_kernels.check_layout(query, key_cache, value_cache, block_tables, out)
    cpu_kernels.check_index_tensor("tiles", tiles, torch.int64)
    if tiles.dim() != 2 or tiles.shape[1] != 4 or not tiles.is_contiguous():
        raise ValueError(f"tiles: expected a contiguous [num_tiles, 4] tensor, got {tiles.shape}")
    if plan.tables_end > block_tables.shape[0] or plan.rows_end > query.shape[0]:
        raise ValueError("tiles name rows outside block_tables or query")
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
        raise ValueError(f"a tile's rows see no keys or more than {plan.max_seq_len}")
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
