"""How much memory this process may still take: the kernel's MemAvailable, capped by what its
cgroup (a container's memory limit, a Kubernetes pod's `resources.limits.memory`) has left.

MemAvailable counts the whole machine. In a container limited to less than that, a KV pool sized
against MemAvailable passes the check and is then faulted in past the cgroup's limit, and the
kernel's cgroup OOM killer ends the process instead of the engine refusing the size with a
message. The cgroup's headroom is its limit less what it uses, with the page cache the kernel
would reclaim first (inactive file pages) counted as free, as MemAvailable counts it and as
Kubernetes' working set leaves it out. cgroup v2 or v1, whichever the machine mounts.
"""

from __future__ import annotations

from pathlib import Path

from pagedray.workers.cgroups import CGROUP_ROOT, PROC_SELF_CGROUP, cgroup_levels, read_text

PROC_MEMINFO = Path("/proc/meminfo")
# v1 reports "no limit" as the largest page-aligned count (about 2^63): anything this large is.
V1_UNLIMITED_BYTES = 1 << 62


def available_memory_bytes(
    meminfo: Path = PROC_MEMINFO, proc_cgroup: Path = PROC_SELF_CGROUP, root: Path = CGROUP_ROOT
) -> int | None:
    """Bytes this process may still allocate: the smaller of MemAvailable and its cgroup's
    headroom; None where neither can be read (not Linux)."""
    figures = [_mem_available(meminfo), cgroup_headroom_bytes(proc_cgroup, root)]
    known = [figure for figure in figures if figure is not None]
    return min(known) if known else None


def cgroup_headroom_bytes(
    proc_cgroup: Path = PROC_SELF_CGROUP, root: Path = CGROUP_ROOT
) -> int | None:
    """The least headroom (limit less usage, reclaimable page cache counted as free) of this
    process's memory cgroup and its ancestors (cgroups.py); None when none of them sets a limit.
    """
    levels, v2 = cgroup_levels("memory", proc_cgroup, root)
    headroom_of = _v2_headroom if v2 else _v1_headroom
    headrooms = [headroom for level in levels if (headroom := headroom_of(level)) is not None]
    return min(headrooms) if headrooms else None


def _v2_headroom(level: Path) -> int | None:
    limit = read_text(level / "memory.max")
    if limit is None or not limit.isdigit():  # "max": no limit here
        return None
    usage = read_text(level / "memory.current")
    return _headroom(int(limit), usage, _stat(level / "memory.stat").get("inactive_file", 0))


def _v1_headroom(level: Path) -> int | None:
    own = read_text(level / "memory.limit_in_bytes")
    stat = _stat(level / "memory.stat")
    # "hierarchical_memory_limit" is the least limit of this cgroup and its ancestors: with the
    # container's own cgroup mounted at the root, the only sight of a limit set above it. Held
    # against this cgroup's usage, a lower bound of the ancestors', it errs towards more room.
    limits = [int(own)] if own is not None and own.isdigit() else []
    limits += [stat["hierarchical_memory_limit"]] if "hierarchical_memory_limit" in stat else []
    limit = min(limits, default=V1_UNLIMITED_BYTES)
    if limit >= V1_UNLIMITED_BYTES:
        return None
    usage = read_text(level / "memory.usage_in_bytes")
    # v1's "inactive_file" is this cgroup's own; "total_" adds its children's, as usage does.
    reclaimable = stat.get("total_inactive_file", stat.get("inactive_file", 0))
    return _headroom(limit, usage, reclaimable)


def _headroom(limit: int, usage: str | None, reclaimable: int) -> int | None:
    if usage is None or not usage.isdigit():
        return None
    in_use = max(0, int(usage) - reclaimable)
    return max(0, limit - in_use)


def _mem_available(meminfo: Path) -> int | None:
    text = read_text(meminfo)
    for line in (text or "").splitlines():
        if line.startswith("MemAvailable:"):
            fields = line.split()
            return int(fields[1]) * 1024 if len(fields) > 1 and fields[1].isdigit() else None
    return None


def _stat(path: Path) -> dict[str, int]:
    """A memory.stat file's "key value" lines."""
    entries = {}
    for line in (read_text(path) or "").splitlines():
        key, _, value = line.partition(" ")
        if value.strip().isdigit():
            entries[key] = int(value)
    return entries
