"""Moving a request whose engine failed it to another engine replica (issue P14): when it may
move, where its attempts went, and how a begun request of n > 1 choices goes on as n requests.

The Serve engine client (cluster/serve_engine_client.py) runs the attempts; this module holds
what it decides them by: `MigrationPolicy` (how many moves, how long a request may be, the pause
before each, how long the router may take to place it, what is counted), `Placements` (the
replica of each attempt as the router names it, held in the `ReplicaWatch` while the attempt
runs) and `choice_request` (one choice of a forked request as a request of its own).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import secrets
import time
from dataclasses import dataclass
from typing import Callable

from pagedray.cluster import replica_watch
from pagedray.cluster.replica_watch import STALLED_REASON, ReplicaWatch
from pagedray.engine.request_errors import MIGRATED_FAILURES
from pagedray.engine.wire import GenerateRequest
from pagedray.scheduler.request import child_seed
from pagedray.scheduler.request_failure import RequestFailure

logger = logging.getLogger(__name__)
# Times a request is sent again after its engine failed it, by default, and the first pause
# before it is (doubling with each).
DEFAULT_MIGRATION_LIMIT = 3
MIGRATION_PAUSE_S = 0.25
# Seconds the router may take to place a request sent again before there is taken to be no
# live replica (it places one in milliseconds when there is).
MIGRATION_ROUTE_S = 2.0


@dataclass(frozen=True)
class Move:
    """Why a request's engine failed it, and when: what its move is counted by."""

    reason: str  # the failure's kind, or `STALLED_REASON`
    failed_at: float  # time.monotonic()


class MigrationPolicy:
    """Whether a request whose engine failed it moves, and the counting of each move."""

    def __init__(
        self,
        limit: int = DEFAULT_MIGRATION_LIMIT,
        max_seq_len: int | None = None,
        on_migration: Callable[[str, float], None] | None = None,
    ) -> None:
        """`limit`: moves per request; `max_seq_len`: a request holding more tokens (prompt
        and delivered) does not move; `on_migration(reason, seconds)` counts each move once
        placed, with the seconds from the failure to the placement."""
        self.limit = limit
        self.max_seq_len = max_seq_len
        self.on_migration = on_migration

    async def may_move(
        self, request_id: str, failure: RequestFailure | None, attempt: int, num_tokens: int
    ) -> bool:
        """Whether to send again a request whose engine failed it, after a pause that lets the
        router learn of the failure: a replica that died leaves the router's choice at once, one
        whose engine died when Serve's health check sees it. Not for a failure of the request
        itself (a refusal, its deadline), which is its answer. (Sent again, a request that the
        router cannot place within `MIGRATION_ROUTE_S` fails too: see `placed_in_time`.)
        """
        if failure is None or failure.kind not in MIGRATED_FAILURES:
            return False
        if attempt >= self.limit:
            logger.warning("request %s: engine failed it; no migration left", request_id)
            return False
        if self.max_seq_len is not None and num_tokens > self.max_seq_len:
            logger.warning(
                "request %s: engine failed it; %d tokens, past --migration-max-seq-len",
                request_id,
                num_tokens,
            )
            return False
        reason = failure.kind.value
        logger.warning("request %s: engine failed it (%s); sending it again", request_id, reason)
        await asyncio.sleep(MIGRATION_PAUSE_S * 2**attempt)
        return True

    def seed_for_moving(self, request: GenerateRequest) -> None:
        """A sampled request that came without a seed gets one as it enters, so that, should it
        move, it goes on with the draws it would have made (keyed by seed and position) instead
        of fresh ones. Its draws are as random as before: the seed is drawn anew each time."""
        params = request.sampling_params
        if self.limit > 0 and params.seed is None and not params.greedy:
            request.sampling_params = params.clone(seed=secrets.randbits(63))

    def count(self, move: Move) -> None:
        """A request sent again has a replica: it moved."""
        if self.on_migration is not None:
            self.on_migration(move.reason, time.monotonic() - move.failed_at)


class Placements:
    """Where a request's attempts went, as its router names them (on the router's thread,
    handed to this loop), each held in the `ReplicaWatch` while its attempt runs; and the
    replicas the watch found making no progress with it."""

    def __init__(
        self,
        request: GenerateRequest,
        watch: ReplicaWatch,
        abandon: Callable[[str], None],
        on_place: Callable[[str], None] | None = None,
    ) -> None:
        """`abandon(why)` fails the running attempt (its replica makes no progress);
        `on_place(replica_id)` is told of each placement first."""
        self.request_id = request.request_id
        self.watch = watch
        self.abandon = abandon
        self.on_place = on_place
        self.replica_ids: list[str] = []  # of every attempt, in order
        self.stalled_on: set[str] = set()
        self.routed = asyncio.Event()
        self._attempt_open = False
        self._held: list[str] = []  # the running attempt's replicas (Serve may route it twice)
        loop = asyncio.get_running_loop()

        def on_routed(replica_id: str) -> None:  # on the router's thread
            # Counted at once: the router's next choice, maybe before this loop runs, sees it.
            replica_watch.count_generation(replica_id, 1)
            try:
                loop.call_soon_threadsafe(self._place, replica_id)
            except RuntimeError:  # the loop closed: the ingress is going away
                replica_watch.count_generation(replica_id, -1)

        request.on_routed = on_routed

    def start_attempt(self) -> None:
        self.routed.clear()
        self._attempt_open = True

    def end_attempt(self) -> None:
        """The attempt is over: no replica holds it for the watch any more, and a placement
        the router still hands over is ignored."""
        self._attempt_open = False
        for replica_id in self._held:
            self.watch.release(replica_id, self.request_id)
            replica_watch.count_generation(replica_id, -1)
        self._held = []

    def move_of(self, failure: RequestFailure | None) -> Move:
        """The move the last attempt's failure calls for."""
        stalled = bool(self.stalled_on & set(self.replica_ids[-1:]))
        kind = failure.kind.value if failure is not None else "none"
        return Move(STALLED_REASON if stalled else kind, time.monotonic())

    def leave(self, request: GenerateRequest) -> None:
        """The request moves away from the last attempt's replica, never to go back."""
        request.failed_replica_ids.update(self.replica_ids[-1:])

    async def placed_in_time(self) -> bool:
        """Whether the router placed a request sent again within `MIGRATION_ROUTE_S`: it
        waits for a live replica other than those that failed it, and when there was only one,
        its replacement takes seconds to start, so the request fails now, as it would have
        without the move."""
        try:
            await asyncio.wait_for(self.routed.wait(), MIGRATION_ROUTE_S)
        except asyncio.TimeoutError:
            logger.warning("request %s: no live engine replica to move it to", self.request_id)
            return False
        return True

    def _place(self, replica_id: str) -> None:
        if not self._attempt_open:  # its attempt ended while the router's word travelled
            replica_watch.count_generation(replica_id, -1)
            return
        self._held.append(replica_id)  # first: released at the attempt's end whatever follows
        if self.on_place is not None:
            self.on_place(replica_id)
        self.replica_ids.append(replica_id)
        self.watch.hold(replica_id, self.request_id, functools.partial(self._abandon, replica_id))
        self.routed.set()

    def _abandon(self, replica_id: str, why: str) -> None:
        if self.replica_ids[-1:] != [replica_id]:
            return  # a replica Serve routed the attempt away from: not where it runs
        self.stalled_on.add(replica_id)
        self.abandon(why)


def choice_request(request: GenerateRequest, index: int, tokens: list[int]) -> GenerateRequest:
    """Choice `index` of a request of n > 1 choices as a request of one choice that goes on from
    `tokens`, as its engine ran it after the prompt forked (scheduler/request.py's
    `fork_child`: its own seed) and never back to a replica that failed it."""
    params = request.sampling_params.clone(
        n=1, seed=child_seed(request.sampling_params.seed, index), prompt_logprobs=None
    )
    return dataclasses.replace(
        request,
        request_id=f"{request.request_id}-choice{index}",
        sampling_params=params,
        output_token_ids=list(tokens),
        channel_id=None,
        pull_from=None,
        routing_hashes=None,
        routing_decision=None,
        on_routed=None,
        failed_replica_ids=set(request.failed_replica_ids),
    )
