"""The allocator set-up: after tune_malloc, a freed activation's pages are reused, not refaulted."""

from __future__ import annotations

import platform
import subprocess
import sys
import textwrap

import pytest
import torch

from pagedray.workers import cpu_runtime

# An add + RMSNorm over 2,048 x 256 floats (a 2 MiB activation and its temporaries), 40 times as
# 40 forward steps would, printing the minor page faults taken: with glibc's defaults the freed
# temporaries go back to the kernel and every round faults their pages in again.
_FAULTS = textwrap.dedent(
    """
    import resource, sys, torch
    from pagedray.workers.cpu_runtime import tune_malloc
    tuned = tune_malloc() if sys.argv[1] == "tune" else False
    torch.set_num_threads(1)
    x, residual = torch.ones(2048, 256), torch.ones(2048, 256)

    def add_and_norm():
        y = x + residual
        return y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + 1e-6), y

    for _ in range(40):  # warm-up: the heap grows and its new pages are touched once
        add_and_norm()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(40):
        add_and_norm()
    print(tuned, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    """
)


def _faults(mode: str, env: dict[str, str] | None = None) -> tuple[str, int]:
    done = subprocess.run(
        [sys.executable, "-c", _FAULTS, mode], capture_output=True, text=True, env=env, check=True
    )
    tuned, faults = done.stdout.split()
    return tuned, int(faults)


@pytest.mark.skipif(
    cpu_runtime.preloaded_allocator() is not None or not sys.platform.startswith("linux"),
    reason="needs glibc's own malloc (Linux, no allocator preloaded)",
)
def test_tuned_malloc_stops_refaulting_freed_activations() -> None:
    default_tuned, default_faults = _faults("default")
    tuned, tuned_faults = _faults("tune")
    assert (default_tuned, tuned) == ("False", "True")
    # Untuned, glibc refaults ~1,000 pages a round in most runs (in some, its adaptive mmap
    # threshold happens to settle high enough and it does not); tuned, never.
    assert tuned_faults < 40 * 10, (tuned_faults, default_faults)


def test_preloaded_allocator_is_recognised(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LD_PRELOAD", "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4:x.so")
    assert cpu_runtime.preloaded_allocator() == "tcmalloc"
    monkeypatch.setenv("LD_PRELOAD", "/opt/lib/libjemalloc.so.2")
    assert cpu_runtime.preloaded_allocator() == "jemalloc"
    monkeypatch.setenv("LD_PRELOAD", "/venv/lib/libiomp5.so")
    assert cpu_runtime.preloaded_allocator() is None


def test_kv_pool_on_huge_pages_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cpu_runtime.KV_HUGE_PAGES_ENV, "1")
    pool = cpu_runtime.kv_pool_zeros((3, 2, 512, 16, 2, 64), torch.float32)  # 24 MiB
    assert pool.shape == (3, 2, 512, 16, 2, 64) and pool.dtype == torch.float32
    assert not pool.any()
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as setting:
            thp = setting.read()
    except OSError:
        pytest.skip("no transparent huge pages on this kernel")
    if "[never]" in thp:
        pytest.skip("transparent huge pages are off on this machine")
    # Eligible, not necessarily backed: whether 2 MiB pages are free right now depends on the
    # machine's fragmentation; the advice is what the code controls.
    huge = cpu_runtime.HUGE_PAGE_BYTES
    first_whole_page = -(-pool.data_ptr() // huge) * huge  # the advice covers whole pages only
    assert _thp_eligible(first_whole_page, first_whole_page + huge)


def test_kv_pool_is_resident_once_made() -> None:
    """Faulted in at start (under load, fresh pages slowed runs), zero, and writable."""
    if platform.system() != "Linux":
        pytest.skip("the populated mapping is the Linux path; elsewhere the pool is torch.zeros")
    before = _rss_bytes()
    # 66,000,000 bytes: not a whole number of 2 MiB pages, so the advised range must be the
    # mapping's own whole pages and not run past it.
    pool = cpu_runtime.kv_pool_zeros((1000, 16500), torch.float32)
    assert _rss_bytes() - before >= 60 << 20
    assert not pool.any()
    pool[7].fill_(3.0)
    pool[-1].fill_(4.0)
    assert pool[7].eq(3.0).all() and not pool[6].any() and not pool[8].any()
    assert pool[-1].eq(4.0).all()


def test_kv_pool_larger_than_available_memory_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    if platform.system() != "Linux":
        pytest.skip("MemAvailable is read from /proc/meminfo")
    monkeypatch.setattr(cpu_runtime, "available_memory_bytes", lambda: 16 << 20)
    with pytest.raises(MemoryError, match="lower kv_cache_memory_gb"):
        cpu_runtime.kv_pool_zeros((3, 2, 512, 16, 2, 64), torch.float32)  # 24 MiB


def _rss_bytes() -> int:
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024


def _thp_eligible(start: int, end: int) -> bool:
    """Whether the mapping holding [start, end) may take transparent huge pages (smaps)."""
    eligible, inside = False, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                low, high = (int(part, 16) for part in head.split("-"))
                inside = low <= start and end <= high
            elif inside and head == "THPeligible:":
                eligible = line.split()[1] == "1"
    return eligible
