"""The memory a process may take: MemAvailable capped by its cgroup, read from cgroup trees laid
out as the kernel mounts them (v2 with and without a cgroup namespace, a pod's limit above its
container's, v1 seen from the host), and from this machine's own /proc."""

from __future__ import annotations

import platform
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pagedray.workers import memory_limits
from pagedray.workers.memory_limits import available_memory_bytes, cgroup_headroom_bytes

GIB, MIB = 1 << 30, 1 << 20


def _meminfo(tmp_path: Path, available: int) -> Path:
    path = tmp_path / "meminfo"
    path.write_text(f"MemTotal: 99999999 kB\nMemAvailable: {available // 1024} kB\n")
    return path


def _proc_cgroup(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "self_cgroup"
    path.write_text(text)
    return path


def _v2_level(directory: Path, limit: int | str, usage: int, inactive_file: int = 0) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "memory.max").write_text(f"{limit}\n")
    (directory / "memory.current").write_text(f"{usage}\n")
    (directory / "memory.stat").write_text(f"anon {usage}\ninactive_file {inactive_file}\n")


def _v2_root(tmp_path: Path) -> Path:
    root = tmp_path / "cgroup"
    root.mkdir()
    (root / "cgroup.controllers").write_text("cpu memory pids\n")
    return root


def test_a_container_limit_caps_mem_available(tmp_path: Path) -> None:
    """v2 in a cgroup namespace: the mount is the container's cgroup, its path reads "/"."""
    root = _v2_root(tmp_path)
    _v2_level(root, 1 * GIB, 600 * MIB, inactive_file=100 * MIB)
    proc = _proc_cgroup(tmp_path, "0::/\n")
    assert cgroup_headroom_bytes(proc, root) == 1 * GIB - 500 * MIB
    meminfo = _meminfo(tmp_path, 20 * GIB)
    assert available_memory_bytes(meminfo, proc, root) == 1 * GIB - 500 * MIB
    # The machine's own figure wins where it is the smaller.
    assert available_memory_bytes(_meminfo(tmp_path, 100 * MIB), proc, root) == 100 * MIB


def test_a_pod_limit_above_the_container_counts(tmp_path: Path) -> None:
    """Kubernetes limits the pod's cgroup; the container's own says "max"."""
    root = _v2_root(tmp_path)
    _v2_level(root / "kubepods" / "pod1", 2 * GIB, int(1.5 * GIB))
    _v2_level(root / "kubepods" / "pod1" / "c1", "max", 1 * GIB)
    proc = _proc_cgroup(tmp_path, "0::/kubepods/pod1/c1\n")
    assert cgroup_headroom_bytes(proc, root) == GIB // 2
    # The tighter of two limits along the path.
    _v2_level(root / "kubepods" / "pod1" / "c1", 1 * GIB + 100 * MIB, 1 * GIB)
    assert cgroup_headroom_bytes(proc, root) == 100 * MIB


def test_no_limit_leaves_mem_available(tmp_path: Path) -> None:
    root = _v2_root(tmp_path)
    _v2_level(root, "max", 5 * GIB)
    proc = _proc_cgroup(tmp_path, "0::/\n")
    assert cgroup_headroom_bytes(proc, root) is None
    assert available_memory_bytes(_meminfo(tmp_path, 7 * GIB), proc, root) == 7 * GIB


def test_v1_seen_from_the_host(tmp_path: Path) -> None:
    """No namespace: /proc/self/cgroup names the cgroup under the mount, whose root is
    unlimited (v1's "no limit" is a count near 2^63)."""
    root = tmp_path / "cgroup"
    memory = root / "memory"
    memory.mkdir(parents=True)
    (memory / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    own = memory / "process_api" / "abc"
    own.mkdir(parents=True)
    (own / "memory.limit_in_bytes").write_text(f"{4 * GIB}\n")
    (own / "memory.usage_in_bytes").write_text(f"{3 * GIB}\n")
    (own / "memory.stat").write_text(f"inactive_file 5\ntotal_inactive_file {GIB // 2}\n")
    proc = _proc_cgroup(tmp_path, "5:devices:/\n4:memory:/process_api/abc\n0::/\n")
    assert cgroup_headroom_bytes(proc, root) == int(1.5 * GIB)
    (own / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    assert cgroup_headroom_bytes(proc, root) is None


def test_v1_a_limit_above_a_container_mounted_at_the_root(tmp_path: Path) -> None:
    """Docker on v1 mounts the container's own memory cgroup at the root: a limit set above it
    shows only as memory.stat's hierarchical_memory_limit."""
    memory = tmp_path / "cgroup" / "memory"
    memory.mkdir(parents=True)
    (memory / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    (memory / "memory.usage_in_bytes").write_text(f"{GIB}\n")
    stat = f"total_inactive_file 0\nhierarchical_memory_limit {3 * GIB}\n"
    (memory / "memory.stat").write_text(stat)
    proc = _proc_cgroup(tmp_path, "4:memory:/docker/0123abcd\n")
    assert cgroup_headroom_bytes(proc, tmp_path / "cgroup") == 2 * GIB
    # Unlimited all the way up: v1 shows the same near-2^63 count there.
    (memory / "memory.stat").write_text("hierarchical_memory_limit 9223372036854771712\n")
    assert cgroup_headroom_bytes(proc, tmp_path / "cgroup") is None


def test_a_path_outside_the_view_reads_the_mount(tmp_path: Path) -> None:
    """A container without a cgroup namespace but with its own cgroup mounted at the root."""
    root = _v2_root(tmp_path)
    _v2_level(root, 3 * GIB, 1 * GIB)
    proc = _proc_cgroup(tmp_path, "0::/docker/0123abcd\n")
    assert cgroup_headroom_bytes(proc, root) == 2 * GIB
    # Outside the namespace's root: not a path under the mount, even where one would resolve.
    _v2_level(tmp_path / "x", 1 * GIB, 1 * GIB)
    proc = _proc_cgroup(tmp_path, "0::/../x\n")
    assert cgroup_headroom_bytes(proc, root) == 2 * GIB


def test_unreadable_files_give_no_figure(tmp_path: Path) -> None:
    root = tmp_path / "nothing"
    proc = tmp_path / "absent"
    assert cgroup_headroom_bytes(proc, root) is None
    assert available_memory_bytes(tmp_path / "no_meminfo", proc, root) is None


@given(
    limit=st.integers(0, 1 << 40),
    usage=st.integers(0, 1 << 40),
    inactive=st.integers(0, 1 << 40),
)
def test_headroom_lies_between_zero_and_the_limit(limit: int, usage: int, inactive: int) -> None:
    headroom = memory_limits._headroom(limit, str(usage), inactive)
    assert headroom is not None and 0 <= headroom <= limit
    if inactive == 0 and usage <= limit:
        assert headroom == limit - usage


def test_this_machine() -> None:
    """The real files: a figure on Linux, and not above MemAvailable (read a moment apart, so
    within what other processes may have freed meanwhile)."""
    if platform.system() != "Linux":
        pytest.skip("/proc/meminfo is Linux's")
    available = available_memory_bytes()
    assert available is not None and available > 0
    mem_available = memory_limits._mem_available(memory_limits.PROC_MEMINFO)
    assert mem_available is not None and available <= mem_available + (256 << 20)
