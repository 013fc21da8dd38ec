"""Admission control for a serving engine: a bounded waiting queue, per-request deadlines, and
which waiting request gives way to a better-priority one when the queue is full.

Kept apart from the step loop (`async_engine.py`): these are decisions about requests, taken on
the event loop between steps; carrying them out (failing a stream, aborting) is the loop's job.
"""

from __future__ import annotations

import heapq
import time
from dataclasses import dataclass
from typing import Callable, Container, Iterable

from pagedray.engine.request_errors import EngineOverloadedError, RequestTimeoutError
from pagedray.scheduler.request import EngineRequest, Request, RequestStatus

# A request not finished this long after it arrived is aborted, its blocks freed (504).
DEFAULT_REQUEST_TIMEOUT_S = 600.0
# Without `max_num_waiting`, the serving queue holds at most this many full batches, and no more
# requests than the pool has blocks (each needs one to start): beyond it a request waits for
# minutes, so it is refused at once (503) and the client can go elsewhere.
DEFAULT_WAITING_BATCHES = 2
# After refusing a request, health reports the engine degraded for this long.
DEGRADED_HOLD_S = 5.0


def default_max_num_waiting(max_num_seqs: int, num_kv_blocks: int) -> int:
    """The serving queue's bound when none is configured (see DEFAULT_WAITING_BATCHES)."""
    return max(1, min(DEFAULT_WAITING_BATCHES * max_num_seqs, num_kv_blocks))


@dataclass(frozen=True)
class WaitingRequest:
    """A queued request that has not started: what choosing one to give way needs."""

    priority: int  # lower runs first
    arrival_time: float  # seconds, time.time()
    request_id: str


def not_started(
    pending: Iterable[EngineRequest], waiting: Iterable[Request], live: Callable[[str], bool]
) -> list[WaitingRequest]:
    """Accepted requests that have not run yet: `pending` (not yet handed to the scheduler), or
    `waiting` in the scheduler never admitted (a preempted one has streamed tokens: it keeps its
    place) and still `live`."""
    found = [WaitingRequest(req.priority, req.arrival_time, req.req_id) for req in pending]
    for req in waiting:
        if req.status is RequestStatus.WAITING and live(req.req_id):
            found.append(WaitingRequest(req.priority, req.arrival_time, req.req_id))
    return found


class Admission:
    """Decides whether a new request may queue, and when queued ones have run out of time."""

    def __init__(
        self, max_num_waiting: int, request_timeout_s: float | None, by_priority: bool
    ) -> None:
        """`by_priority`: the engine orders by priority, so a full queue lets a better-priority
        newcomer displace the worst waiting request instead of refusing the newcomer."""
        self.max_num_waiting = max_num_waiting
        self.request_timeout_s = request_timeout_s
        self.by_priority = by_priority
        self._deadlines: list[tuple[float, str]] = []  # heap of (time.monotonic(), request_id)
        self._last_refusal: float | None = None  # time.monotonic() of the last 503

    def admit(
        self, num_waiting: int, priority: int, waiting: Callable[[], Iterable[WaitingRequest]]
    ) -> str | None:
        """Room for one more waiting request: None, or the id of a worse-priority waiting
        request that must give way to it (fail and abort it).

        Raises:
            EngineOverloadedError: the queue is full and nothing waiting is worse.
        """
        if num_waiting < self.max_num_waiting:
            return None
        self._last_refusal = time.monotonic()
        if self.by_priority:
            worst = max(waiting(), key=lambda w: (w.priority, w.arrival_time), default=None)
            if worst is not None and worst.priority > priority:
                return worst.request_id
        raise EngineOverloadedError(
            f"the waiting queue is full ({self.max_num_waiting} requests); retry later"
        )

    def degraded(self, num_waiting: int) -> bool:
        """The queue is full, or a request was refused moments ago."""
        refused_lately = (
            self._last_refusal is not None
            and time.monotonic() - self._last_refusal < DEGRADED_HOLD_S
        )
        return refused_lately or num_waiting >= self.max_num_waiting

    def track(self, request_id: str, live: Container[str], num_live: int) -> None:
        """Start `request_id`'s deadline; `live` holds the requests still in flight."""
        if self.request_timeout_s is None:
            return
        if len(self._deadlines) > 2 * num_live + 64:  # mostly finished ones: compact
            self._deadlines = [d for d in self._deadlines if d[1] in live]
            heapq.heapify(self._deadlines)
        deadline = time.monotonic() + self.request_timeout_s
        heapq.heappush(self._deadlines, (deadline, request_id))

    def expired(self, live: Container[str]) -> list[str]:
        """The requests of `live` whose deadline has passed (each reported once)."""
        now = time.monotonic()
        found = []
        while self._deadlines and self._deadlines[0][0] <= now:
            _, request_id = heapq.heappop(self._deadlines)
            if request_id in live:  # else finished or aborted before its deadline
                found.append(request_id)
        return found

    def timeout_error(self) -> RequestTimeoutError:
        return RequestTimeoutError(
            f"the request did not finish within {self.request_timeout_s:g} s "
            "(request_timeout_s); it was aborted"
        )
