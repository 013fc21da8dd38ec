"""pagedray's C kernels for the CPU: compiled once per machine with the system C compiler, called
through ctypes.

Why not `torch.utils.cpp_extension`: a file that includes no torch header compiles in well under a
second and needs no ninja, and a kernel that takes raw pointers needs nothing else from torch.
The library is cached under `$PAGEDRAY_CACHE_DIR/kernels/` (default `~/.cache/pagedray`), keyed
by the source, the compiler and this CPU's instruction set (it is built with `-march=native`), so
machines of one cluster that share a home directory never load each other's builds.

Threads: torch's Linux wheels use GNU OpenMP (soname libgomp.so.1), the runtime gcc's `-fopenmp`
links too, so the kernel runs on torch's own thread pool, at `torch.get_num_threads()`. Built
with another OpenMP runtime, it gets a second pool of that size.

Where no compiler works, `available()` is False and the CPU backend is not offered; the plain-torch
reference serves instead (see attention/backend.py).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import torch

from pagedray.cache_dir import cache_dir

# A function of a loaded C library (ctypes' own type for it is private).
CFunction = Any

logger = logging.getLogger(__name__)

# One library: paged decode, prefill and row-tile attention (attention/cpu_row_tiles.py), and the
# decoder layer's element-wise ops that workers/layers/cpu_ops.py calls.
SOURCES = (
    Path(__file__).parent / "csrc" / "paged_decode_cpu.c",
    Path(__file__).parent / "csrc" / "paged_prefill_cpu.c",
    Path(__file__).parent / "csrc" / "paged_rows_cpu.c",
    Path(__file__).parent / "csrc" / "layer_ops_cpu.c",
)
HEADERS = (Path(__file__).parent / "csrc" / "cpu_simd.h",)  # hashed into the build key
# NOTE: -ffast-math is a compile flag only. Linking a shared library with it makes GCC < 13 add
# crtfastmath.o, which flushes denormals to zero for the whole process (torch included) on load.
_COMPILE_FLAGS = ("-O3", "-march=native", "-ffast-math", "-fPIC", "-std=c11")
# A row's sums must not be regrouped where a tile's loops unroll differently (GCC and clang both
# take the flag; clang ignores GCC's optimize pragma).
_SOURCE_FLAGS = {"paged_rows_cpu.c": ("-fno-associative-math",)}
_LINK_FLAGS = ("-shared",)
# With OpenMP first; without it the kernel still runs, on one thread.
_OPENMP_CHOICES = (("-fopenmp",), ())

_I64, _F32, _PTR = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
_ARGTYPES = [_PTR, _I64, _PTR, _PTR, _PTR, _I64, _PTR, _PTR, _PTR, _I64]
_ARGTYPES += [_I64, _I64, _I64, _I64, _I64, _F32, _PTR, _I64, _I64, _PTR]


# paged_decode_*'s return codes besides 0 (see the C source).
_NO_MEMORY, _BAD_LENGTH = -1, -2


class KernelBuildError(RuntimeError):
    """The C kernels could not be compiled or loaded on this machine."""


@functools.cache
def available() -> bool:
    """Whether the CPU kernels built and loaded here (built on the first call)."""
    try:
        _library()
    except KernelBuildError as error:
        logger.warning("CPU attention kernels unavailable, using the torch reference: %s", error)
        return False
    return True


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


def parallel_width(num_threads: int) -> int:
    """Threads the kernels get when asked for `num_threads`: 1 where OpenMP did not build."""
    return int(_library().parallel_width(ctypes.c_int64(num_threads)))


@functools.cache
def _entry_points() -> dict[torch.dtype, CFunction]:
    lib = _library()
    names = {torch.float32: "paged_decode_f32", torch.bfloat16: "paged_decode_bf16"}
    if lib.has_f16():
        names[torch.float16] = "paged_decode_f16"
    entries = {}
    for dtype, name in names.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = _ARGTYPES, ctypes.c_int
        entries[dtype] = fn
    return entries


def build_key() -> str:
    """The loaded library's build key: its source, compiler, flags and this CPU's instruction
    set (what decides the kernels' bits)."""
    return Path(_library()._name).stem


def library() -> ctypes.CDLL:
    """The loaded kernels (built on the first call); raises KernelBuildError where they cannot
    be. For the other modules that bind entry points of their own."""
    return _library()


@functools.cache
def _library() -> ctypes.CDLL:
    try:
        return _build_and_load()
    except (OSError, RuntimeError) as error:  # no cache dir, no source file, no HOME, ...
        if isinstance(error, KernelBuildError):
            raise
        raise KernelBuildError(f"{type(error).__name__}: {error}") from error


def _build_and_load() -> ctypes.CDLL:
    compiler = shlex.split(os.environ.get("CC", "")) or [
        found for found in (shutil.which("cc") or shutil.which("gcc"),) if found
    ]
    if not compiler:
        raise KernelBuildError("no C compiler (cc, gcc or $CC) on PATH")
    source = b"\0".join(path.read_bytes() for path in (*SOURCES, *HEADERS))
    folder, private = _writable_cache_dir()
    try:
        return _load_first(compiler, source, folder)
    finally:
        if private:
            # A loaded library stays mapped after its file is removed: nothing is left behind.
            shutil.rmtree(folder, ignore_errors=True)


def _load_first(compiler: list[str], source: bytes, folder: Path) -> ctypes.CDLL:
    """The OpenMP build, else the serial one, compiled into `folder` unless already there."""
    errors = []
    for openmp in _OPENMP_CHOICES:
        path = folder / f"{_build_key(compiler, source, openmp)}.so"
        if not path.exists():
            try:
                _compile(compiler, openmp, path)
            except KernelBuildError as error:
                errors.append(str(error))
                continue
        try:
            lib = ctypes.CDLL(str(path))
        except OSError as error:
            errors.append(f"loading {path}: {error}")
            continue
        if errors:
            logger.warning("CPU attention kernels run on one thread (no OpenMP): %s", errors[0])
        return lib
    raise KernelBuildError("; ".join(errors))


def _writable_cache_dir() -> tuple[Path, bool]:
    """(folder, private): the shared cache, or where it cannot be written (read-only HOME,
    random UID) a temporary folder of this process's own, so that a build still happens, only
    not shared."""
    try:
        folder = cache_dir("kernels")
        folder.mkdir(parents=True, exist_ok=True)
        if os.access(folder, os.W_OK):
            return folder, False
    except (OSError, RuntimeError):
        pass
    return Path(tempfile.mkdtemp(prefix="pagedray-kernels-")), True


def _compile(compiler: list[str], openmp: tuple[str, ...], path: Path) -> None:
    # Built beside its final name and renamed into place: processes building at once (the
    # workers of one engine) each write their own file, and none loads a half-written one.
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        objects = [Path(tmp) / f"{source.stem}.o" for source in SOURCES]
        lib = Path(tmp) / "kernel.so"
        commands = [
            [*compiler, "-c", *_COMPILE_FLAGS, *_SOURCE_FLAGS.get(source.name, ()), *openmp]
            + [str(source), "-o", str(obj)]
            for source, obj in zip(SOURCES, objects)
        ]
        commands.append(
            [*compiler, *_LINK_FLAGS, *openmp, *map(str, objects), "-o", str(lib), "-lm"]
        )
        for command in commands:
            try:
                done = subprocess.run(command, capture_output=True, text=True, timeout=120)
            except (OSError, subprocess.TimeoutExpired) as error:
                raise KernelBuildError(f"{' '.join(command)}: {error}") from error
            if done.returncode != 0:
                tail = (done.stderr or done.stdout).strip()[-500:]
                raise KernelBuildError(f"{' '.join(command)} failed: {tail}")
        os.replace(lib, path)


def _build_key(compiler: list[str], source: bytes, openmp: tuple[str, ...]) -> str:
    digest = hashlib.sha256(source)
    parts = (*compiler, _compiler_version(compiler), *_COMPILE_FLAGS, *_LINK_FLAGS, *openmp)
    parts += tuple(flag for flags in _SOURCE_FLAGS.values() for flag in flags)
    for part in (*parts, _cpu_identity()):
        digest.update(b"\0" + part.encode())
    return digest.hexdigest()[:24]


def _compiler_version(compiler: list[str]) -> str:
    try:
        return subprocess.run(
            [*compiler, "--version"], capture_output=True, text=True, timeout=30
        ).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return ""


# x86 names the model and its flags; Arm its features and implementation (part, variant).
_CPUINFO_KEYS = ("model name", "flags", "Features", "CPU implementer", "CPU part", "CPU variant")


def _cpu_identity() -> str:
    """The instruction set `-march=native` compiles for: the CPU's model and feature flags."""
    identity = [platform.machine()]
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith(_CPUINFO_KEYS):
                    identity.append(line.strip())
                if line.strip() == "":
                    break  # the first processor's entry is enough
    except OSError:
        identity.append(platform.processor())
    return "\n".join(identity)


@functools.cache
def prefill_supported(dtype: torch.dtype, head_dim: int) -> bool:
    """Whether paged_prefill serves this dtype and head size here (AVX-512 builds only)."""
    if not (available() and _library().paged_prefill_supported()):
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
    lib = _library()
    entries = {}
    for dtype, name in (
        (torch.float32, "paged_prefill_f32"),
        (torch.bfloat16, "paged_prefill_bf16"),
    ):
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = _PREFILL_ARGTYPES, ctypes.c_int
        entries[dtype] = fn
    return entries
