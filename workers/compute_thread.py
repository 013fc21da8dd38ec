"""The one thread of a process that runs the model, so that OpenMP keeps a single team of threads.

GNU OpenMP (torch's on Linux) keeps a team of worker threads for each thread that opens a parallel
region. Once a second thread has opened one, the process manages more OpenMP threads than the
machine has CPUs, and libgomp stops spinning between regions: its idle workers sleep on a futex
("throttled" spinning), and every parallel op pays to wake them, for the rest of the process's
life. A server steps its engine in a thread so that its event loop stays free, while the engine
was built, its weights packed and its primitives warmed up on another: measured on 2 cores, SiLU
over 64 x 2,048 floats went from 17 to 27 us, a decode step over 64 sequences from 5.4 to 7.6 ms,
and a whole offline benchmark run ran 28% slower once one thread had built and another stepped.

So every call that runs the model in a process (building the worker, sizing and allocating its
KV pool, each step) goes through `compute_thread()`: one daemon thread, created on first use.
"""

from __future__ import annotations

import ctypes
import queue
import threading
from concurrent.futures import Executor, Future
from typing import Any, Callable, TypeVar

from pagedray.workers.cpu_scheduling import run_model_under_normal_policy

T = TypeVar("T")

_PR_SET_NAME = 15  # prctl's option number (linux/prctl.h)
NAME = "pagedray-compute"
# What the OS (and /proc/<pid>/task/<tid>/comm) calls the thread, and the OpenMP threads it starts.
OS_THREAD_NAME = NAME[:15]


class ComputeThread(Executor):
    """A daemon thread that runs submitted calls one at a time, in order.

    An `Executor`, so that asyncio's `run_in_executor` takes it. Daemon: a call still running
    at interpreter exit (a worker waiting on a dead collective) does not hold the exit up.
    """

    def __init__(self, name: str = NAME) -> None:
        self._calls: queue.SimpleQueue[tuple[Future[Any], Callable[..., Any], tuple, dict]] = (
            queue.SimpleQueue()
        )
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        future: Future[T] = Future()
        self._calls.put((future, fn, args, kwargs))
        return future

    def run(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
        """`fn(*args, **kwargs)` on this thread, waited for; called at once when already on it
        (so that a call made from a call on this thread cannot deadlock)."""
        if self.is_current():
            return fn(*args, **kwargs)
        return self.submit(fn, *args, **kwargs).result()

    def is_current(self) -> bool:
        """Whether the caller runs on this thread."""
        return threading.current_thread() is self._thread

    def _serve(self) -> None:
        name_os_thread(self._thread.name)
        # Before any parallel region: the OpenMP team this thread starts inherits its policy.
        run_model_under_normal_policy()
        while True:
            future, fn, args, kwargs = self._calls.get()
            if not future.set_running_or_notify_cancel():
                continue  # cancelled while queued
            try:
                result = fn(*args, **kwargs)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller, who raises it
                future.set_exception(exc)
            else:
                future.set_result(result)
            del future, fn, args, kwargs  # hold no reference to the last call's values


def name_os_thread(name: str) -> None:
    """Give the calling thread `name` in the OS (Linux: 15 bytes at most), so that `top -H`, py-spy
    and /proc tell the model's CPU apart; the OpenMP threads it starts inherit the name."""
    try:
        libc = ctypes.CDLL(None)
        libc.prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0)
    except (OSError, AttributeError):  # not Linux, or no prctl: the name is only cosmetic
        pass


_instance: ComputeThread | None = None
_instance_lock = threading.Lock()


def compute_thread() -> ComputeThread:
    """This process's compute thread, started on first use."""
    global _instance
    with _instance_lock:
        if _instance is None:
            _instance = ComputeThread()
        return _instance
