"""Memory set-up for inference on the CPU that the C library's defaults get wrong.

1. The allocator.
A forward pass allocates and frees activations of hundreds of KiB to tens of MiB every step.
glibc's malloc gives such blocks back to the kernel as soon as they are freed (an mmap'd chunk is
unmapped; the heap's top is trimmed past 128 KiB), so the next step faults every page in again:
measured here, an add + RMSNorm over 2,048 x 256 floats took 1.6 ms instead of 0.13 ms, and the
whole benchmark ran 15-25% slower. vLLM's CPU docs answer with a preloaded tcmalloc; a preload
has to be in place before the process starts, which an offline `LLM` in someone's notebook
cannot do. `mallopt` can, at any time: blocks up to 32 MiB (glibc's ceiling for the mmap
threshold) come from the heap, and up to `TRIM_THRESHOLD_BYTES` of freed heap stays mapped.

With tcmalloc or another allocator preloaded (vLLM's CPU docs' advice), this does nothing.

2. Pages of the KV pool. The pool is faulted in at start by the kernel, with one
madvise(MADV_POPULATE_WRITE) over a private anonymous mapping, which reads as zeros: no pass of
zeroing in user space (torch.zeros wrote every page after the kernel had zeroed it), and a pool
larger than the memory available (a container's limit counted: `memory_limits.py`) is refused
then rather than killed under load. (Faulted in as blocks were first written instead, runs that
reached fresh blocks slowed.)
It is not advised onto transparent huge pages unless PAGEDRAY_KV_HUGE_PAGES=1 asks: where
the kernel leaves those to `madvise` (the common default) it compacts memory to find 2 MiB pages
for an advised region as it faults it in, and on this VM that made the first `LLM()` of a
process take 18-20 s for a 2 GiB pool against 1.6-1.9 s, while offline throughput on 4 KiB pages
was the same or higher (prefix512: 2,451-3,290 against 2,444-2,978 output tok/s, interleaved;
sharegpt 3,525-4,191 against 3,225-3,415). The TLB misses that huge pages spare showed in a
kernel benchmark over blocks scattered through a 1 GiB pool (382 against 126 us a layer), not
in the engine, which hands out a fresh pool's blocks in address order.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import logging
import math
import mmap
import os
import platform

import torch

from pagedray.workers.memory_limits import available_memory_bytes

logger = logging.getLogger(__name__)

# mallopt's parameter numbers (glibc's malloc.h).
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3
MMAP_THRESHOLD_BYTES = 32 << 20  # the most glibc accepts on 64-bit
TRIM_THRESHOLD_BYTES = 1 << 30  # freed heap kept mapped before any is returned
TOP_PAD_BYTES = 64 << 20  # the heap grows by at least this much at a time

_MADV_HUGEPAGE = 14
_MADV_POPULATE_WRITE = 23  # Linux 5.14
KV_HUGE_PAGES_ENV = "PAGEDRAY_KV_HUGE_PAGES"  # "1": the KV pool on transparent huge pages
HUGE_PAGE_BYTES = 2 << 20

# Allocators that replace malloc when preloaded: glibc's tuning would then be moot.
PRELOADED_ALLOCATORS = ("tcmalloc", "jemalloc", "mimalloc")


@functools.cache
def tune_malloc() -> bool:
    """Keep freed activations mapped for reuse; True when glibc's malloc was tuned.

    Idempotent and process-wide. Skipped where malloc is not glibc's (another libc, or an
    allocator preloaded) or where PAGEDRAY_TUNE_MALLOC=0.
    """
    if os.environ.get("PAGEDRAY_TUNE_MALLOC", "1") == "0":
        return False
    if preloaded_allocator() is not None:
        return False
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    settings = (
        (_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES),
        (_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES),
        (_M_TOP_PAD, TOP_PAD_BYTES),
    )
    ok = all(libc.mallopt(param, value) == 1 for param, value in settings)
    if not ok:
        logger.warning("glibc refused a malloc setting; large activations may fault each step")
    return ok


def preloaded_allocator() -> str | None:
    """The malloc replacement in LD_PRELOAD, if any (by name: tcmalloc, jemalloc, mimalloc)."""
    for entry in os.environ.get("LD_PRELOAD", "").replace(":", " ").split():
        name = os.path.basename(entry)
        for allocator in PRELOADED_ALLOCATORS:
            if allocator in name:
                return allocator
    return None


def kv_pool_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor, its pages faulted in now; on transparent huge pages where asked
    (PAGEDRAY_KV_HUGE_PAGES=1) and the kernel takes the advice. Raises MemoryError if it exceeds
    the memory available.

    Plain torch.zeros off Linux.
    """
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if platform.system() != "Linux" or nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    available = available_memory_bytes()
    if available is not None and nbytes > available:
        raise MemoryError(
            f"the KV pool needs {nbytes / 2**30:.2f} GiB; {available / 2**30:.2f} GiB of memory "
            "is available to this process, its cgroup's limit counted (lower kv_cache_memory_gb)"
        )
    # Private and anonymous: zero pages by the kernel's guarantee; shared anonymous memory would
    # be shmem, which takes no huge pages by default. Whole huge pages, and one more to start the
    # pool on a boundary, so every range advised below lies inside the mapping.
    length = -(-nbytes // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    mapping = mmap.mmap(-1, length + HUGE_PAGE_BYTES, flags=flags)
    raw = torch.frombuffer(mapping, dtype=torch.uint8)  # holds the mapping while it lives
    offset = -raw.data_ptr() % HUGE_PAGE_BYTES
    tensor = raw[offset : offset + nbytes].view(dtype).view(shape)
    if os.environ.get(KV_HUGE_PAGES_ENV, "0") == "1":
        error = _madvise(tensor.data_ptr(), length, _MADV_HUGEPAGE)
        if error:
            logger.debug("madvise(MADV_HUGEPAGE) refused: errno %d", error)
    error = _madvise(tensor.data_ptr(), length, _MADV_POPULATE_WRITE)
    if error == errno.ENOMEM:
        raise MemoryError(f"the KV pool ({nbytes / 2**30:.2f} GiB) could not be faulted in")
    if error:  # EINVAL before Linux 5.14, or no libc to ask
        tensor.zero_()  # touched from user space instead: the zeros are written again
    return tensor


def _madvise(address: int, length: int, advice: int) -> int:
    """0 if the kernel took the advice, else its errno (-1: libc could not be loaded)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:
        return -1
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return 0 if libc.madvise(address, length, advice) == 0 else ctypes.get_errno()
