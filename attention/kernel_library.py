"""The library of pagedray's C kernels for the CPU: compiled once per machine with the system C
compiler, loaded through ctypes. attention/cpu_kernels.py, attention/cpu_row_tiles.py and
workers/layers/cpu_ops.py bind its entry points.

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

import contextlib
import ctypes
import functools
import hashlib
import logging
import os
import platform
import shlex
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

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
COMPILE_TIMEOUT_S = 120  # a build step (its commands side by side) that runs longer has hung
# With OpenMP first; without it the kernel still runs, on one thread.
_OPENMP_CHOICES = (("-fopenmp",), ())


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


def parallel_width(num_threads: int) -> int:
    """Threads the kernels get when asked for `num_threads`: 1 where OpenMP did not build."""
    return int(_library().parallel_width(ctypes.c_int64(num_threads)))


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
        compiles = [
            [*compiler, "-c", *_COMPILE_FLAGS, *_SOURCE_FLAGS.get(source.name, ()), *openmp]
            + [str(source), "-o", str(obj)]
            for source, obj in zip(SOURCES, objects)
        ]
        # The sources compile side by side: a first start waits for the slowest, not the sum.
        _run_all(compiles, Path(tmp))
        link = [*compiler, *_LINK_FLAGS, *openmp, *map(str, objects), "-o", str(lib), "-lm"]
        _run_all([link], Path(tmp))
        os.replace(lib, path)


def _run_all(commands: list[list[str]], logs: Path) -> None:
    """Run `commands` at once, each with its output in a file under `logs`; raise
    KernelBuildError naming every one that failed. Each runs in a process group of its own, so
    that one past the deadline is killed with the compiler's own children (gcc's cc1, as, ld),
    and none is left running when this returns, however it returns: the build's temporary
    folder is removed next."""
    deadline = time.monotonic() + COMPILE_TIMEOUT_S
    started: list[tuple[list[str], Path, subprocess.Popen[bytes] | OSError]] = []
    errors = []
    try:
        for index, command in enumerate(commands):
            log = logs / f"command-{index}.log"
            try:
                with log.open("wb") as out:
                    process = subprocess.Popen(
                        command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
                    )
            except OSError as error:
                started.append((command, log, error))
            else:
                started.append((command, log, process))
        for command, log, run in started:
            if isinstance(run, OSError):
                errors.append(f"{' '.join(command)}: {run}")
                continue
            try:
                run.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                errors.append(f"{' '.join(command)}: still running after {COMPILE_TIMEOUT_S} s")
                continue
            if run.returncode != 0:
                output = log.read_text(errors="replace").strip()[-500:]
                errors.append(f"{' '.join(command)} failed: {output}")
    finally:
        for _, _, leftover in started:
            if isinstance(leftover, subprocess.Popen) and leftover.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(leftover.pid, signal.SIGKILL)
                leftover.wait()
    if errors:
        raise KernelBuildError("; ".join(errors))


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
