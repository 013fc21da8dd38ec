"""Each request's life in the serving engine outside the scheduler: accepted (admitted against
the waiting queue's bound, then held until the step loop hands it to the scheduler), streaming
its outputs (its `RequestStream`), and ended: finished, failed, aborted or past its deadline.

The step loop (async_engine.py) takes what changed between steps (`take_changes`) and hands each
step's outputs back (`deliver`); only the loop touches `EngineCore`, so everything the engine
does to the scheduler stays in one place, and this one holds the requests' side.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import AsyncGenerator, Callable, Iterable

from pagedray.engine.admission import Admission, WaitingRequest, not_started
from pagedray.engine.request_errors import EngineOverloadedError, RequestAbortedError
from pagedray.engine.request_stream import RequestStream, Sink
from pagedray.engine.wire import RequestStepOutput
from pagedray.scheduler.request import EngineRequest, Request
from pagedray.scheduler.request_failure import refusal


@dataclass
class PendingRequest:
    """Accepted, not yet in the scheduler."""

    engine_request: EngineRequest
    prompt: str | None
    at_end: bool  # its outputs go out once, at the end (see `RequestState`)


class RequestLifecycle:
    """The engine's requests in flight: their streams, those not yet queued, the aborts not yet
    applied, and their admission (queue bound, deadlines)."""

    def __init__(self, admission: Admission, wake: Callable[[], None]) -> None:
        """`wake`: tells the step loop that something changed for it to take."""
        self.admission = admission
        self.wake = wake
        self.streams: dict[str, RequestStream] = {}
        self.pending: dict[str, PendingRequest] = {}
        self.aborts: set[str] = set()

    def accept(
        self,
        request: EngineRequest,
        prompt: str | None,
        stream_interval: int | None,
        sink: Sink | None,
        num_waiting: int,
        scheduler_waiting: Callable[[], Iterable[Request]],
    ) -> AsyncGenerator[RequestStepOutput, None]:
        """Admit `request` (`num_waiting` queued in the scheduler besides those pending here)
        and return its stream of outputs; closing it before the end aborts the request.

        Raises:
            ValueError: its id is already in use.
            EngineOverloadedError: the waiting queue is full and nothing waiting gives way.
        """
        request_id = request.req_id
        if request_id in self.streams:
            raise refusal("request_id", f"{request_id!r} is already in use")

        def waiting() -> list[WaitingRequest]:
            # NOTE: a step may be in flight; list() copies the queue in one go (the GIL holds),
            # and a request admitted meanwhile that is then picked is aborted like any other.
            pending = [item.engine_request for item in self.pending.values()]
            return not_started(pending, list(scheduler_waiting()), self._live)

        displaced = self.admission.admit(num_waiting + len(self.pending), request.priority, waiting)
        if displaced is not None:
            self.fail(
                displaced,
                EngineOverloadedError(
                    "the waiting queue is full and this request gave way to one of better "
                    "priority; retry later"
                ),
            )
            self.drop(displaced)
        self.pending[request_id] = PendingRequest(request, prompt, stream_interval is None)
        request_stream = RequestStream(stream_interval, sink)
        self.streams[request_id] = request_stream
        self.admission.track(request_id, self.streams, len(self.streams))
        self.wake()
        return request_stream.read(lambda: self.abort(request_id))

    def abort(self, request_id: str) -> None:
        """Abort a request: blocks freed before the next step, its stream failed (for a sink)."""
        if (request_stream := self.streams.pop(request_id, None)) is not None:
            request_stream.fail(RequestAbortedError(f"request {request_id} was aborted"))
            self.drop(request_id)

    def drop(self, request_id: str) -> None:
        """Drop an accepted request whose stream is gone: unqueue it, or have the loop abort it
        in the engine."""
        if self.pending.pop(request_id, None) is not None:
            return
        self.aborts.add(request_id)
        self.wake()

    def fail(self, request_id: str, exc: BaseException) -> None:
        """End `request_id`'s stream with `exc` (its blocks are the loop's to free)."""
        request_stream = self.streams.pop(request_id, None)
        if request_stream is not None:
            request_stream.fail(exc)

    def fail_all(self, exc: BaseException) -> list[str]:
        """End every stream with `exc`; returns the ids that had one."""
        self.pending.clear()
        failed = list(self.streams)
        for request_id in failed:
            self.fail(request_id, exc)
        return failed

    def expire(self) -> None:
        """Fail every request past its deadline with a timeout, and drop it."""
        for request_id in self.admission.expired(self.streams):
            self.fail(request_id, self.admission.timeout_error())
            self.drop(request_id)

    def take_changes(self) -> tuple[list[str], list[PendingRequest]]:
        """The aborts and the accepted requests to hand to the scheduler now (no step runs)."""
        aborts, self.aborts = list(self.aborts), set()
        pending, self.pending = list(self.pending.values()), {}
        return aborts, pending

    def has_changes(self) -> bool:
        return bool(self.pending or self.aborts)

    def deliver(self, request_id: str, output: RequestStepOutput) -> None:
        """A step's output to its stream (gone when the request was aborted meanwhile)."""
        request_stream = self.streams.get(request_id)
        if request_stream is not None:
            request_stream.put(output)
            if output.finished:
                del self.streams[request_id]

    def any_streaming(self) -> bool:
        """What the workers' thread count depends on (workers/cpu_threads.py)."""
        return any(stream.streaming for stream in self.streams.values())

    def _live(self, request_id: str) -> bool:
        return request_id in self.streams and request_id not in self.aborts
