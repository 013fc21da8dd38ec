"""The call recorder `request_path.py` installs in every Ray worker process of the server it
starts (Ray's `worker_process_setup_hook`), to count the hops of a request's path.

A hop is a call from a function in one of the project's source files into a function in
another (or, from the framework, into one of ours): the edges a newcomer follows from file to
file. The recorder runs as a profile function on every thread and records only while its
control directory holds `arm`; `dump` (holding a window's name) makes it write what it saw to
`calls-<window>-<pid>.json` there.
Between the two the whole process is observed, so the script compares a window with the
request against an idle one.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

CONTROL_DIR_ENV = "PAGEDRAY_TRACE_DIR"
SOURCE_ROOT_ENV = "PAGEDRAY_TRACE_ROOT"
POLL_S = 0.05
# Frames that start a call on their own schedule (a task, a thread, a future's callback): a call
# below one has no caller of ours, it is an entry from the framework.
SCHEDULING_PARTS = ("/asyncio/", "/concurrent/futures/", "/threading.py")
MAX_WALK = 40  # frames walked up from a call to find the caller of ours


class _Recorder:
    def __init__(self, root: str, control: Path) -> None:
        self.root = root
        self.control = control
        self.armed = False
        self.edges: set[tuple[str, str]] = set()
        self._ours: dict[str, str | None] = {}  # co_filename -> repository path, or None

    def ours(self, filename: str) -> str | None:
        known = self._ours.get(filename, "")
        if known != "":
            return known
        real = os.path.realpath(filename) if filename.endswith(".py") else ""  # not "<frozen os>"
        path = os.path.relpath(real, self.root) if real.startswith(self.root + os.sep) else None
        if path is not None and (path.startswith((".venv", "tests", "benchmarks"))):
            path = None
        self._ours[filename] = path
        return path

    def profile(self, frame, event, arg):  # noqa: ANN001 - sys.setprofile's signature
        if not self.armed or event != "call":
            return
        callee_file = self.ours(frame.f_code.co_filename)
        if callee_file is None:
            return
        callee = f"{callee_file}:{frame.f_code.co_qualname}"
        caller = "(framework)"
        walker = frame.f_back
        for _ in range(MAX_WALK):
            if walker is None:
                break
            filename = walker.f_code.co_filename
            if any(part in filename for part in SCHEDULING_PARTS):
                break
            caller_file = self.ours(filename)
            if caller_file is not None:
                if caller_file == callee_file:
                    return  # within one file: not a hop
                caller = f"{caller_file}:{walker.f_code.co_qualname}"
                break
            walker = walker.f_back
        self.edges.add((caller, callee))

    def watch(self) -> None:
        while True:
            armed = (self.control / "arm").exists()
            if armed and not self.armed:
                self.edges = set()
            self.armed = armed
            dump = self.control / "dump"
            if dump.exists():
                out = self.control / f"calls-{dump.read_text().strip()}-{os.getpid()}.json"
                if not out.exists():
                    out.write_text(json.dumps(sorted(self.edges)))
            time.sleep(POLL_S)


def install() -> None:
    """Ray's `worker_process_setup_hook`: profile every thread of this process from now on."""
    control = os.environ.get(CONTROL_DIR_ENV)
    root = os.environ.get(SOURCE_ROOT_ENV)
    if not control or not root:
        return
    recorder = _Recorder(os.path.realpath(root), Path(control))
    sys.setprofile(recorder.profile)
    threading.setprofile(recorder.profile)
    threading.Thread(target=recorder.watch, name="request-path-recorder", daemon=True).start()
