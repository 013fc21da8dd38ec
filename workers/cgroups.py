"""Where this process's cgroup limits lie: its own cgroup and each ancestor up to the mount,
for one controller (memory, cpu), on cgroup v2 or v1, with or without a cgroup namespace.

A container's limits (Docker's `--memory`/`--cpus`, a Kubernetes pod's `resources.limits`) are
set on a cgroup that may sit above the process's own: Kubernetes sets a pod's on the pod's
cgroup, above its containers'. In a container with its own cgroup namespace the process's path
reads "/" and the mount is already its own cgroup; without one (a process on the host, or a
container sharing the host's namespace), the path is looked up under the mount.
"""

from __future__ import annotations

from pathlib import Path

# This process's cgroups: "0::<path>" (v2), "<n>:<controllers>:<path>" (v1).
PROC_SELF_CGROUP = Path("/proc/self/cgroup")
# Where the hierarchies are mounted: v2 itself (it has cgroup.controllers), v1's one per
# controller (memory/, cpu/).
CGROUP_ROOT = Path("/sys/fs/cgroup")


def cgroup_levels(
    controller: str, proc_cgroup: Path = PROC_SELF_CGROUP, root: Path = CGROUP_ROOT
) -> tuple[list[Path], bool]:
    """(this process's cgroup directory for `controller` and its ancestors up to the mount,
    nearest first; whether the machine mounts v2). No directories where the process's cgroup
    cannot be read (not Linux, no such controller)."""
    v2 = (root / "cgroup.controllers").exists()
    mount = root if v2 else root / controller
    own = _own_path(read_text(proc_cgroup) or "", controller, v2)
    if own is None:
        return [], v2
    directory = mount / own.lstrip("/")
    # A path outside this namespace's view ("/../x": the process's cgroup is not under the
    # namespace's root) or not under the mount: the mount is then the process's own cgroup.
    if ".." in Path(own).parts or not directory.is_dir():
        directory = mount
    levels = []
    for level in [directory, *directory.parents]:
        levels.append(level)
        if level == mount:
            break
    return levels, v2


def _own_path(proc_cgroup_text: str, controller: str, v2: bool) -> str | None:
    for line in proc_cgroup_text.splitlines():
        number, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if v2 and number == "0" and controllers == "":
            return path
        if not v2 and controller in controllers.split(","):
            return path
    return None


def read_text(path: Path) -> str | None:
    """A cgroup or /proc file's text, stripped; None where it cannot be read."""
    try:
        return path.read_text().strip()
    except OSError:
        return None
