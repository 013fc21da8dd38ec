"""Process helpers for tests that start a server with its own Ray: free ports, bounded waits,
`pagedray_serve` (a real `pagedray serve` for the length of a `with`), and cleanup of exactly the
processes a test started, known by PID and start time (never `ray stop`, which kills every Ray
on the machine)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import httpx

SERVE_START_TIMEOUT_S = 150  # Ray, Serve, the engine replica and its workers on 2 CPU cores
SERVE_STOP_TIMEOUT_S = 60
RAY_EXIT_TIMEOUT_S = 30  # after the server exits, for its Ray processes to follow


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_for(
    what: str, check: Callable[[], bool], timeout_s: float, proc: subprocess.Popen | None = None
) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"{what}: the process exited with {proc.returncode}")
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout_s:.0f}s")
        time.sleep(0.5)


def get_ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def descendants(pid: int) -> set[int]:
    """Every live process below `pid` (Ray's head processes, agents and workers)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    found: set[int] = set()
    stack = [pid]
    while stack:
        for child in children.get(stack.pop(), []):
            if child not in found:
                found.add(child)
                stack.append(child)
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def stop(proc: subprocess.Popen, timeout_s: float) -> None:
    """SIGTERM, then SIGKILL what is still running after `timeout_s`: our process only."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def start_time(pid: int) -> int | None:
    """When the process started (clock ticks after boot); None once it is gone. With the PID it
    names one process: a PID alone may be reused by another once its process has exited."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return int(fields[19])  # field 22 of stat, counting from the pid


def same_process(pid: int, started: int) -> bool:
    """The process `pid` that started at `started` is still running (not a zombie)."""
    return alive(pid) and start_time(pid) == started


def kill_all(processes: set[tuple[int, int]], timeout_s: float) -> list[int]:
    """Wait up to `timeout_s` for `processes` ((PID, start time) each) to exit, then SIGKILL each
    one left, by PID, if it is still that process. Returns the PIDs that had to be killed."""
    deadline = time.monotonic() + timeout_s
    while any(same_process(*item) for item in processes) and time.monotonic() < deadline:
        time.sleep(0.5)
    left = sorted(pid for pid, started in processes if same_process(pid, started))
    for pid in left:
        with contextlib.suppress(ProcessLookupError):  # exited meanwhile
            os.kill(pid, signal.SIGKILL)
    return left


def thread_policies(pid: int) -> dict[str, set[int]]:
    """A process's threads' scheduling policies (os.SCHED_*), by OS thread name."""
    policies: dict[str, set[int]] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError):  # the thread ended meanwhile
            name = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
            policies.setdefault(name, set()).add(os.sched_getscheduler(int(tid)))
    return policies


def listeners(pids: set[int]) -> list[tuple[str, int, int]]:
    """(address, port, pid) of each TCP socket listening in one of `pids` (from /proc)."""
    inode_pid: dict[str, int] = {}
    for pid in pids:
        fd_dir = Path(f"/proc/{pid}/fd")
        try:
            for fd in fd_dir.iterdir():
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    inode_pid[target[8:-1]] = pid
        except OSError:  # exited, or not ours to read
            continue
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state == "0A" and inode in inode_pid:  # 0A: LISTEN
                address, port = local.rsplit(":", 1)
                found.append((_address(address), int(port, 16), inode_pid[inode]))
    return found


def _address(hex_address: str) -> str:
    """/proc/net's little-endian hex address as text ("127.0.0.1", "::ffff:127.0.0.1", "::")."""
    raw = bytes.fromhex(hex_address)
    words = [raw[i : i + 4][::-1] for i in range(0, len(raw), 4)]
    if len(raw) == 4:
        return ".".join(str(b) for b in words[0])
    joined = b"".join(words)
    if joined[:12] == b"\0" * 10 + b"\xff\xff":
        return "::ffff:" + ".".join(str(b) for b in joined[12:])
    return "::" if joined == b"\0" * 16 else joined.hex()


def command_line(pid: int) -> str:
    """The process's command line, arguments joined by spaces ('' once it is gone)."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return ""
    return raw.replace(b"\0", b" ").decode(errors="replace").strip()


@dataclass
class ServeProcess:
    """A running `pagedray serve`: its URL, process, private Ray temp dir and log."""

    url: str  # http://127.0.0.1:PORT, no trailing slash
    proc: subprocess.Popen
    workdir: Path  # RAY_TMPDIR: Ray's sockets, logs and service-discovery file live below it
    metrics_port: int  # the local Ray's Prometheus endpoint
    log_path: Path
    # Every descendant seen so far, (PID, start time): what this server started, and no other.
    started: set[tuple[int, int]] = field(default_factory=set)

    @property
    def ray_tmp(self) -> Path:
        return self.workdir / "ray"

    def processes(self, marker: str) -> list[int]:
        """Live descendants whose command line contains `marker` (e.g. "ray::WorkerActor");
        every PID returned is one this server started, so a test may signal it."""
        self.remember_descendants()
        return sorted(
            pid
            for pid, started in self.started
            if same_process(pid, started) and marker in command_line(pid)
        )

    def remember_descendants(self) -> None:
        for pid in descendants(self.proc.pid):
            started = start_time(pid)
            if started is not None:
                self.started.add((pid, started))

    def log_tail(self, num_chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-num_chars:]


@contextlib.contextmanager
def pagedray_serve(
    model: str | None,
    *flags: str,
    workdir: Path | None = None,
    env: dict[str, str] | None = None,
    start_timeout_s: float = SERVE_START_TIMEOUT_S,
    stop_timeout_s: float = SERVE_STOP_TIMEOUT_S,
    port: int | None = None,
) -> Iterator[ServeProcess]:
    """`pagedray serve MODEL FLAGS` on free ports with its own local Ray, healthy when yielded.

    Afterwards it is stopped (SIGTERM, which deletes the app and shuts Ray down) and every
    process it started is gone, killed by PID if need be. When the body raised nothing, it
    asserts that the server exited with 0 and that no process outlived it. `model` None serves
    the default model; `workdir` (default: a fresh one, removed after) is its RAY_TMPDIR;
    `port` (default: a free one) its API port.
    """
    own_workdir = workdir is None
    # NOTE: short, under /tmp: Ray's Unix sockets live below it, and their paths are limited.
    workdir = Path(tempfile.mkdtemp(prefix="pdr-", dir="/tmp")) if workdir is None else workdir
    port, metrics_port = port or free_port(), free_port()
    command = [str(Path(sys.executable).with_name("pagedray")), "serve"]
    command += [model] if model is not None else []
    command += ["--port", str(port), "--metrics-export-port", str(metrics_port), *flags]
    child_env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}
    child_env.update(OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", **(env or {}))
    child_env["RAY_TMPDIR"] = str(workdir)  # its own Ray temp dir: never another Ray's
    log_path = workdir / "serve.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen(command, env=child_env, stdout=log, stderr=subprocess.STDOUT)
    server = ServeProcess(f"http://127.0.0.1:{port}", proc, workdir, metrics_port, log_path)
    try:
        try:
            check = lambda: get_ok(f"{server.url}/health")  # noqa: E731
            wait_for("pagedray serve healthy", check, start_timeout_s, proc)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{server.log_tail()}") from exc
        server.remember_descendants()
        yield server
    except BaseException:
        _stop_server(server, stop_timeout_s)
        raise
    else:
        killed = _stop_server(server, stop_timeout_s)
        log = server.log_tail()
        assert proc.returncode == 0, f"pagedray serve exited with {proc.returncode}:\n{log}"
        assert not killed, f"processes outlived pagedray serve: {killed}\n{log}"
    finally:
        if own_workdir:
            shutil.rmtree(workdir, ignore_errors=True)


def _stop_server(server: ServeProcess, timeout_s: float) -> list[int]:
    """Stop the server, then kill what it started that is still running; returns those PIDs."""
    server.remember_descendants()
    stop(server.proc, timeout_s)
    return kill_all(server.started, RAY_EXIT_TIMEOUT_S)
