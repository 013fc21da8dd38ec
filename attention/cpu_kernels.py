"""The C attention kernels' bindings for the CPU: paged decode (csrc/paged_decode_cpu.c) and paged
prefill (csrc/paged_prefill_cpu.c), with the checks of the layout every kernel here reads. The
library they live in is built and loaded by attention/kernel_library.py.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from pagedray.attention.kernel_library import (
    CFunction,
    KernelBuildError,
    available,
    build_key,
    library,
    parallel_width,
)

__all__ = [
    "CFunction",
    "KernelBuildError",
    "available",
    "build_key",
    "library",
    "parallel_width",
    "supports",
    "paged_decode",
    "paged_prefill",
    "prefill_supported",
    "check_layout",
    "check_index_tensor",
    "cache_args",
]

_I64, _F32, _PTR = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
_ARGTYPES = [_PTR, _I64, _PTR, _PTR, _PTR, _I64, _PTR, _PTR, _PTR, _I64]
_ARGTYPES += [_I64, _I64, _I64, _I64, _I64, _F32, _PTR, _I64, _I64, _PTR]


# paged_decode_*'s return codes besides 0 (see the C source).
_NO_MEMORY, _BAD_LENGTH = -1, -2


def supports(dtype: torch.dtype) -> bool:
    return dtype in _entry_points()


def paged_decode(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], contiguous
    value_cache: torch.Tensor,  # same as key_cache
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32: sequence i's query row
    decode_seqs: torch.Tensor,  # [num_decodes] int64: the sequences with one query token
    max_seq_len: int,  # at least the longest seq_len among decode_seqs
    scale: float,
    out: torch.Tensor,  # like query: rows of the decode sequences are written
    table_rows: torch.Tensor | None = None,  # [num_seqs] int64: sequence i's block_tables row
) -> None:
    """Attention of each decode sequence's one query token over its context, read in place."""
    num_decodes = decode_seqs.numel()
    if num_decodes == 0:
        return
    if table_rows is not None:
        if table_rows.dtype != torch.int64 or not table_rows.is_contiguous():
            raise ValueError(f"table_rows: expected a contiguous int64 tensor, got {table_rows}")
        if table_rows.numel() and int(table_rows.max()) >= block_tables.shape[0]:
            raise ValueError("table_rows names a row past block_tables")
    _, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    seq_lens, query_start_loc, decode_seqs = _checked(
        query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, decode_seqs, out
    )
    entry = _entry_points().get(query.dtype)
    if entry is None:
        raise ValueError(f"no CPU decode kernel for {query.dtype}")
    status = entry(
        *_batch_args(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc),
        decode_seqs.data_ptr(),
        num_decodes,
        num_heads,
        num_kv_heads,
        head_dim,
        block_size,
        int(max_seq_len),
        float(scale),
        out.data_ptr(),
        out.stride(0),
        torch.get_num_threads(),
        None if table_rows is None else table_rows.data_ptr(),
    )
    if status == _BAD_LENGTH:
        raise ValueError(f"a decode's seq_len is outside [1, max_seq_len={max_seq_len}]")
    if status == _NO_MEMORY:
        raise MemoryError("CPU paged decode: could not allocate its per-thread scratch")


def _checked(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    seqs: torch.Tensor,
    out: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Raises ValueError where the kernels' layout assumptions do not hold; returns seq_lens,
    query_start_loc and seqs contiguous."""
    check_layout(query, key_cache, value_cache, block_tables, out)
    for name, t, dtype in (
        ("seq_lens", seq_lens, torch.int32),
        ("query_start_loc", query_start_loc, torch.int32),
        ("decode_seqs", seqs, torch.int64),
    ):
        check_index_tensor(name, t, dtype)
    return seq_lens.contiguous(), query_start_loc.contiguous(), seqs.contiguous()


def check_layout(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    out: torch.Tensor,
) -> None:
    """Raises ValueError where the layout every kernel here reads does not hold: heads of query
    and out contiguous, caches contiguous, one dtype, whole GQA groups, int32 block tables."""
    _, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    for name, t in (("query", query), ("out", out)):
        if t.stride(-1) != 1 or t.stride(-2) != head_dim:
            raise ValueError(f"{name}: heads must be contiguous, got strides {t.stride()}")
    if not (key_cache.is_contiguous() and value_cache.is_contiguous()):
        raise ValueError("key_cache and value_cache must be contiguous")
    if block_tables.stride(-1) != 1:
        raise ValueError(f"block_tables: rows must be contiguous, got {block_tables.stride()}")
    if not (query.dtype == key_cache.dtype == value_cache.dtype == out.dtype):
        raise ValueError(
            f"query, caches and out must share a dtype, got {query.dtype}, {key_cache.dtype}, "
            f"{value_cache.dtype}, {out.dtype}"
        )
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    check_index_tensor("block_tables", block_tables, torch.int32)


def check_index_tensor(name: str, t: torch.Tensor, dtype: torch.dtype) -> None:
    if t.dtype != dtype or t.device.type != "cpu":
        raise ValueError(f"{name}: expected a CPU {dtype} tensor, got {t.dtype} on {t.device}")


def _batch_args(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
) -> tuple[int, ...]:
    """The arguments both kernels open with: the batch's pointers and row strides."""
    return (
        *cache_args(query, key_cache, value_cache, block_tables),
        seq_lens.data_ptr(),
        query_start_loc.data_ptr(),
    )


def cache_args(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
) -> tuple[int, ...]:
    """The arguments every attention kernel here opens with: query and its row stride, the
    caches, the block tables and their row stride."""
    return (
        query.data_ptr(),
        query.stride(0),
        key_cache.data_ptr(),
        value_cache.data_ptr(),
        block_tables.data_ptr(),
        block_tables.stride(0),
    )


@functools.cache
def _entry_points() -> dict[torch.dtype, CFunction]:
    lib = library()
    names = {torch.float32: "paged_decode_f32", torch.bfloat16: "paged_decode_bf16"}
    if lib.has_f16():
        names[torch.float16] = "paged_decode_f16"
    entries = {}
    for dtype, name in names.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = _ARGTYPES, ctypes.c_int
        entries[dtype] = fn
    return entries


@functools.cache
def prefill_supported(dtype: torch.dtype, head_dim: int) -> bool:
    """Whether paged_prefill serves this dtype and head size here (AVX-512 builds only)."""
    if not (available() and library().paged_prefill_supported()):
        return False
    return dtype in _prefill_entry_points() and head_dim % 16 == 0 and head_dim <= 256


def paged_prefill(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim], heads contiguous
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], contiguous
    value_cache: torch.Tensor,  # same as key_cache
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    extend_seqs: torch.Tensor,  # [num_extends] int64: sequences with several query tokens
    scale: float,
    out: torch.Tensor,  # like query: rows of the extend sequences are written
) -> None:
    """Causal attention of each extend sequence's query rows over its whole context, in place.
    The caller has checked `prefill_supported`."""
    num_extends = extend_seqs.numel()
    if num_extends == 0:
        return
    _, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    seq_lens, query_start_loc, extend_seqs = _checked(
        query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, extend_seqs, out
    )
    status = _prefill_entry_points()[query.dtype](
        *_batch_args(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc),
        extend_seqs.data_ptr(),
        num_extends,
        num_heads,
        num_kv_heads,
        head_dim,
        block_size,
        float(scale),
        out.data_ptr(),
        out.stride(0),
        torch.get_num_threads(),
    )
    if status == _BAD_LENGTH:
        raise ValueError("an extend's query_len is outside [1, seq_len]")
    if status == _NO_MEMORY:
        raise MemoryError("CPU paged prefill: could not allocate its per-thread scratch")
    if status != 0:
        raise ValueError(f"CPU paged prefill refused head_dim {head_dim} (status {status})")


_PREFILL_ARGTYPES = [_PTR, _I64, _PTR, _PTR, _PTR, _I64, _PTR, _PTR, _PTR, _I64]
_PREFILL_ARGTYPES += [_I64, _I64, _I64, _I64, _F32, _PTR, _I64, _I64]


@functools.cache
def _prefill_entry_points() -> dict[torch.dtype, CFunction]:
    lib = library()
    entries = {}
    for dtype, name in (
        (torch.float32, "paged_prefill_f32"),
        (torch.bfloat16, "paged_prefill_bf16"),
    ):
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = _PREFILL_ARGTYPES, ctypes.c_int
        entries[dtype] = fn
    return entries
