"""Step dispatch over named pipes: the driver and every rank block in the kernel, none polls.

An engine's ranks share the driver's node (STRICT_PACK), so a step needs no Ray task at all:
the driver writes the pickled `SchedulerOutput` into one FIFO per rank and sleeps in `poll()`
until rank 0 writes the pickled `ModelRunnerOutput` back into its reply FIFO. Each rank runs a
daemon thread asleep in `os.read` on its FIFO. Unlike a compiled graph's channels, nothing spins
between steps, which matters when ranks + driver outnumber the cores.

Wire format, both ways: an 8-byte little-endian length, then that many bytes of pickle. A
zero-length frame on a plan FIFO stops the rank's thread. Ranks other than 0 write to their reply
FIFO only when a step fails: rank 0 may then be stuck in a collective waiting for them, and the
driver must hear of it from the rank that failed.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import select
import shutil
import struct
import tempfile
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass

import ray
from ray.actor import ActorHandle

from pagedray.scheduler.messages import ModelRunnerOutput, SchedulerOutput
from pagedray.workers.compute_thread import name_os_thread
from pagedray.workers.cpu_scheduling import run_model_under_normal_policy

logger = logging.getLogger(__name__)

_HEADER = struct.Struct("<Q")  # payload length in bytes; 0 = stop
_READ_CHUNK = 1 << 16  # bytes per read of a reply: the default Linux pipe buffer
_POLL_IN = select.POLLIN | select.POLLHUP | select.POLLERR


class WorkerStepError(RuntimeError):
    """A rank raised while running a step; `__cause__` is its exception when it could be pickled.

    After one, the ranks may be out of step with each other (one stuck in a collective the
    other never joined), so the dispatcher refuses further steps: the engine must be rebuilt.
    """


@dataclass
class _StepFailure:
    """What a rank sends back instead of an output when its step raised."""

    rank: int
    step_id: int
    description: str  # "KeyError: 'x'"
    traceback: str  # formatted on the rank
    # The exception, pickled on its own: it may not pickle, or not unpickle on the driver.
    exception: bytes | None

    def to_error(self) -> WorkerStepError:
        message = f"rank {self.rank} failed in step {self.step_id}: {self.description}"
        error = WorkerStepError(f"{message}\n--- traceback on the rank ---\n{self.traceback}")
        with contextlib.suppress(Exception):
            error.__cause__ = pickle.loads(self.exception) if self.exception else None
        return error


def _frame(payload: bytes) -> bytes:
    return _HEADER.pack(len(payload)) + payload


def _write_all(fd: int, data: bytes) -> None:
    """Write every byte to a blocking fd; a pipe takes at most its buffer size per call."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _read_exact(fd: int, size: int) -> bytes | None:
    """Exactly `size` bytes from a blocking fd, over as many reads as it takes; None at EOF."""
    chunks, remaining = [], size
    while remaining:
        chunk = os.read(fd, remaining)
        if not chunk:
            return None
        chunks.append(chunk)
        remaining -= len(chunk)
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


class PipeWorkerLoop:
    """A rank's end: a daemon thread that reads plans, runs them and (rank 0) replies.

    Built by `WorkerActor.open_pipe_channel` while the driver holds the FIFOs' other ends open;
    `start()` follows once the driver has opened the plan FIFO for writing, so the first read
    blocks for a plan instead of seeing end-of-file.
    """

    def __init__(
        self,
        rank: int,
        plan_path: str,
        reply_path: str,
        execute: Callable[[SchedulerOutput], ModelRunnerOutput],
    ) -> None:
        self.rank = rank
        self.execute = execute
        # NOTE: non-blocking opens return at once (a blocking read-open would wait for the
        # driver's write-open); the reply open fails with ENXIO if the driver is not reading.
        self.plan_fd = os.open(plan_path, os.O_RDONLY | os.O_NONBLOCK)
        try:
            self.reply_fd = os.open(reply_path, os.O_WRONLY | os.O_NONBLOCK)
        except OSError:
            os.close(self.plan_fd)
            raise
        os.set_blocking(self.reply_fd, True)
        self.thread = threading.Thread(target=self._run, name=plan_reader_name(rank), daemon=True)

    def start(self) -> None:
        os.set_blocking(self.plan_fd, True)
        self.thread.start()

    def _run(self) -> None:
        name_os_thread(self.thread.name)
        # NOTE: each plan and reply passes this thread, on the step's critical path: it takes a
        # core on waking like the compute thread does (workers/cpu_scheduling.py).
        run_model_under_normal_policy()
        try:
            while True:
                header = _read_exact(self.plan_fd, _HEADER.size)
                if header is None:  # the driver closed its end
                    return
                (size,) = _HEADER.unpack(header)
                payload = _read_exact(self.plan_fd, size) if size else None
                if payload is None:  # a stop frame, or the driver went away mid-plan
                    return
                reply = self._step(payload)
                if reply is not None:
                    _write_all(self.reply_fd, _frame(reply))
        except OSError as error:  # EPIPE: the driver closed the reply FIFO (shut down or died)
            logger.info("rank %d pipe loop stopped: %s", self.rank, error)
        finally:
            os.close(self.plan_fd)
            os.close(self.reply_fd)

    def _step(self, payload: bytes) -> bytes | None:
        """Run one plan; the pickled reply, or None on a rank other than 0 that succeeded."""
        step_id = -1
        try:
            scheduler_output: SchedulerOutput = pickle.loads(payload)
            step_id = scheduler_output.step_id
            output = self.execute(scheduler_output)
            if self.rank != 0:
                return None
            return pickle.dumps(output, pickle.HIGHEST_PROTOCOL)
        except Exception as error:  # reported to the driver, which raises it
            logger.exception("rank %d failed in step %d", self.rank, step_id)
            exception = None
            with contextlib.suppress(Exception):  # an unpicklable one is sent as text only
                exception = pickle.dumps(error, pickle.HIGHEST_PROTOCOL)
            description = f"{type(error).__name__}: {error}"
            failure = _StepFailure(
                self.rank, step_id, description, traceback.format_exc(), exception
            )
            return pickle.dumps(failure, pickle.HIGHEST_PROTOCOL)


def plan_reader_name(rank: int) -> str:
    """The name of a rank's thread that reads its plans (also its OS name, for /proc and py-spy)."""
    return f"pipe-rank{rank}"


class PipeDispatcher:
    """The driver's end: a plan FIFO per rank, a reply FIFO per rank, and no Ray call per step.

    The FIFOs live in a fresh private temp dir only while both ends are opened; they are
    unlinked right after, so nothing is left on disk even if the driver is killed.
    NOTE: the driver may run steps and `shutdown()` from different threads (a serving loop
    steps in a worker thread); a wake-up pipe in the poll set lets `shutdown()` interrupt a
    step, and a lock keeps the file descriptors open until that step has returned.
    """

    def __init__(self, workers: list[ActorHandle]) -> None:
        self.pipe_dir = tempfile.mkdtemp(prefix="pagedray-pipes-")
        self.plan_fds: list[int] = []  # index = rank, write ends, non-blocking
        self.reply_fds: list[int] = []  # index = rank, read ends, non-blocking
        self._wake_read, self._wake_write = os.pipe()
        self._poller = select.poll()
        self._lock = threading.Lock()  # held for a whole step; shutdown() waits for it
        self._shutdown_lock = threading.Lock()
        self._failure: str | None = None  # set by the first failed step
        self._closed = False
        try:
            self._connect(workers)
        except BaseException:
            self.shutdown()
            raise
        finally:
            shutil.rmtree(self.pipe_dir, ignore_errors=True)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Write the plan to every rank, then sleep until rank 0's output or any rank's error.

        Raises:
            WorkerStepError: a rank raised during the step.
            RuntimeError: a worker exited, the dispatcher was shut down, or an earlier step
                failed (the ranks may be out of step since then).
        """
        frame = _frame(pickle.dumps(scheduler_output, pickle.HIGHEST_PROTOCOL))
        with self._lock:
            if self._closed:
                raise RuntimeError("the pipe dispatcher is shut down")
            if self._failure is not None:
                raise RuntimeError(
                    f"an earlier step failed ({self._failure}); the workers may be out of "
                    "step with each other: shut down and rebuild the engine"
                )
            try:
                return self._round_trip(frame)
            except BaseException as error:
                self._failure = f"{type(error).__name__}: {str(error).splitlines()[0]}"
                raise

    def dead_rank(self) -> int | None:
        """A rank whose process exited since the last step, found without a step; None if all
        are alive or a step is in flight (that step finds it). Lets an idle engine's health
        report a dead worker at once instead of at the next request."""
        if not self._lock.acquire(blocking=False):
            return None
        try:
            if self._closed:
                return None
            poller = select.poll()
            for fd in self.reply_fds:
                poller.register(fd, select.POLLHUP | select.POLLERR)
            # NOTE: between steps a reply pipe holds nothing, so any event is its writer gone.
            events = poller.poll(0)
            ranks = [self.reply_fds.index(fd) for fd, _ in events]
            return min(ranks) if ranks else None
        finally:
            self._lock.release()

    def shutdown(self) -> None:
        """Stop the ranks' threads with a stop frame and close every pipe; idempotent."""
        with self._shutdown_lock:  # a second caller waits, then finds everything closed
            if self._closed:
                return
            self._closed = True
            os.write(self._wake_write, b"\0")  # interrupts a step in flight on another thread
            with self._lock:
                for fd in self.plan_fds:
                    # NOTE: 8 bytes go in whole or not at all (< PIPE_BUF); a rank that is gone
                    # or stuck gets end-of-file instead once the fd is closed below.
                    with contextlib.suppress(OSError):
                        os.write(fd, _HEADER.pack(0))
                for fd in (*self.plan_fds, *self.reply_fds, self._wake_read, self._wake_write):
                    os.close(fd)
                self.plan_fds, self.reply_fds = [], []
            shutil.rmtree(self.pipe_dir, ignore_errors=True)

    def _connect(self, workers: list[ActorHandle]) -> None:
        """Open both ends of every FIFO without ever blocking in open(), then start the ranks.

        A non-blocking read-open succeeds at once, and a non-blocking write-open succeeds once
        a reader exists, so each side opens its read ends before the other opens to write.
        """
        paths = [
            tuple(os.path.join(self.pipe_dir, f"{kind}-{rank}") for kind in ("plan", "reply"))
            for rank in range(len(workers))
        ]
        for plan_path, reply_path in paths:
            os.mkfifo(plan_path, 0o600)
            os.mkfifo(reply_path, 0o600)
            self.reply_fds.append(os.open(reply_path, os.O_RDONLY | os.O_NONBLOCK))
        ray.get([w.open_pipe_channel.remote(*p) for w, p in zip(workers, paths)])
        for plan_path, _ in paths:
            self.plan_fds.append(os.open(plan_path, os.O_WRONLY | os.O_NONBLOCK))
        ray.get([w.start_pipe_loop.remote() for w in workers])
        for fd in (*self.reply_fds, self._wake_read):
            self._poller.register(fd, _POLL_IN)

    def _round_trip(self, frame: bytes) -> ModelRunnerOutput:
        # Every rank gets its plan before the driver waits: ranks need each other to finish.
        pending = {fd: self._write_some(fd, memoryview(frame)) for fd in self.plan_fds}
        pending = {fd: rest for fd, rest in pending.items() if rest}
        for fd in pending:  # a plan larger than the pipe buffer: the rest as the rank reads
            self._poller.register(fd, select.POLLOUT)
        buffers: dict[int, bytearray] = {}
        output: ModelRunnerOutput | None = None
        while output is None or pending:
            for fd, _ in self._poller.poll():  # no timeout: a step may take long
                if fd in pending:
                    pending[fd] = self._write_some(fd, pending[fd])
                    if not pending[fd]:
                        del pending[fd]
                        self._poller.unregister(fd)
                elif fd == self._wake_read:
                    raise RuntimeError("the pipe dispatcher was shut down during a step")
                else:
                    output = self._receive(fd, buffers) or output
        return output

    def _write_some(self, fd: int, data: memoryview) -> memoryview:
        """Write what the pipe takes now; the part still to write."""
        try:
            return data[os.write(fd, data) :]
        except BlockingIOError:
            return data
        except BrokenPipeError as error:
            rank = self.plan_fds.index(fd)
            raise RuntimeError(f"rank {rank} closed its plan pipe: the worker exited") from error

    def _receive(self, fd: int, buffers: dict[int, bytearray]) -> ModelRunnerOutput | None:
        """Read what a reply pipe holds; rank 0's output once a whole frame is in."""
        rank = self.reply_fds.index(fd)
        try:
            chunk = os.read(fd, _READ_CHUNK)
        except BlockingIOError:
            return None
        if not chunk:
            raise RuntimeError(f"rank {rank} closed its reply pipe: the worker exited")
        buffer = buffers.setdefault(fd, bytearray())
        buffer += chunk
        if len(buffer) < _HEADER.size:
            return None
        (size,) = _HEADER.unpack_from(buffer)
        if len(buffer) < _HEADER.size + size:
            return None
        del buffers[fd]
        if len(buffer) > _HEADER.size + size:
            raise RuntimeError(f"rank {rank} sent more than one reply in a step")
        result = pickle.loads(memoryview(buffer)[_HEADER.size :])
        if isinstance(result, _StepFailure):
            raise result.to_error()
        if rank != 0:
            raise RuntimeError(f"rank {rank} sent an output; only rank 0 replies")
        return result
