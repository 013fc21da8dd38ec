"""`EngineClient` over the engine deployment (engine/engine_client.py): an ingress replica's way
to its engine replicas through Ray Serve.

Every request is one unary call of the engine deployment's `generate`, answered when the
request ends. A request that wants one output at the end gets it as the answer: two messages,
the request and its answer. A streamed request's outputs come through the output channel of
the replica that holds it to this ingress replica (`OutputSubscriber`), a batch per step for
every request of ours there; the router names that replica as it sends the call, so that its
channel is read before the first token; the answer then brings only a refusal, a failure or the
end. With cache-aware routing, each request carries its prompt's block hashes to the router
(`EngineRequestRouter`), which keeps them (they are not sent).

A request whose engine fails it (the replica died, the engine died or aborted it from outside)
is sent again, to a live replica, up to `migration_limit` times: before any of its output
reached the client, whole; after, a streamed request resumes from the tokens the client has
(`GenerateRequest.output_token_ids`), which the new engine computes as context and samples on
from, so that a greedy or seeded request's stream goes on token for token; a request of n > 1
choices goes on as one request per unfinished choice, each as its engine ran it after the
prompt forked (its own seed, its own tokens), their outputs joined as the choices of one. A replica
that holds requests of ours but makes no progress (stopped, wedged, stalled) is found within
seconds (`ReplicaWatch`), and its requests move as from a dead one.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
from typing import Any, AsyncGenerator, Callable

from ray.serve.handle import DeploymentHandle

# NOTE: the module, not its `KV_VIEWS`: the router in this process reads the same object.
from pagedray.cluster import kv_views
from pagedray.cluster.engine_control import EngineControl
from pagedray.cluster.migration import (
    DEFAULT_MIGRATION_LIMIT,
    MigrationPolicy,
    Move,
    Placements,
    choice_request,
)
from pagedray.cluster.output_subscriber import OutputSubscriber
from pagedray.cluster.replica_watch import ReplicaWatch
from pagedray.engine.engine_client import EngineLimits, Health
from pagedray.engine.step_outputs import merge_step_outputs
from pagedray.engine.wire import GenerateRequest, RequestStepOutput
from pagedray.scheduler.request_failure import FailureKind, RequestFailure

logger = logging.getLogger(__name__)
# Seconds a streamed request's finish may trail its call's end (they travel on separate paths).
CHANNEL_LAG_S = 10.0
# On the queue of a streamed request: its call ended (its finish may still be on the channel).
_CALL_ENDED = object()


class ServeEngineClient:
    """The engine deployment behind `engine` (a handle routed by `EngineRequestRouter`)."""

    def __init__(
        self,
        engine: DeploymentHandle,
        control: EngineControl,
        migration_limit: int = DEFAULT_MIGRATION_LIMIT,
        on_migration: Callable[[str, float], None] | None = None,
        migration_max_seq_len: int | None = None,
    ) -> None:
        """`migration_limit`: how many times one request is sent again after its engine
        failed it; `on_migration(reason, seconds)` counts each time, with the seconds from the
        failure to the request's placement; `migration_max_seq_len`: a request with more
        tokens (prompt and delivered) does not move."""
        self.engine = engine
        self.control = control
        self.subscriber = OutputSubscriber(engine)
        self.watch = ReplicaWatch(engine)
        self.migration = MigrationPolicy(migration_limit, migration_max_seq_len, on_migration)

    def close(self) -> None:
        """This ingress replica stops: its calls that outlive requests (the output channels'
        subscriptions) end now."""
        self.subscriber.close()

    def generate(self, request: GenerateRequest) -> AsyncGenerator[RequestStepOutput, None]:
        """The request's one call to the engine deployment. Leaving early cancels the call,
        which aborts the request in the engine."""
        self.migration.seed_for_moving(request)
        self._add_routing_hashes(request)
        if request.stream_interval is None:
            return self._answer(request)
        return self._through_channel(request)

    async def not_ready(self, request_id: str) -> RequestFailure | None:
        return await self.control.not_ready(request_id)

    async def health(self, request_id: str) -> Health | RequestFailure:
        return await self.control.health(request_id)

    async def stats(self, request_id: str) -> list[dict[str, Any]] | RequestFailure:
        return await self.control.broadcast("stats", request_id)

    async def limits(self) -> EngineLimits:
        await self.control.learn_limits()
        return EngineLimits(self.control.max_model_len, self.control.max_num_waiting)

    async def _answer(self, request: GenerateRequest) -> AsyncGenerator[RequestStepOutput, None]:
        """A request that wants one output: the call's answer, its refusal, its failure or its
        finished output. Nothing reaches the client before it, so a failure of the engine is
        answered by sending the request again (`MigrationPolicy`)."""
        request_id = request.request_id
        loop = asyncio.get_running_loop()
        abandoned: asyncio.Future[RequestStepOutput] = loop.create_future()

        def abandon(why: str) -> None:  # its replica makes no progress
            if not abandoned.done():
                abandoned.set_result(broken_call(request_id, ReplicaStalledError(why)))

        placements = Placements(request, self.watch, abandon)
        answer = None
        move: Move | None = None
        num_tokens = len(request.prompt_token_ids) + len(request.output_token_ids)
        for attempt in itertools.count():
            placements.start_attempt()
            abandoned = loop.create_future()
            call = self.engine.generate.remote(request)
            try:
                if move is not None:  # sent again: counted once the router places it
                    if not await placements.placed_in_time():
                        break  # no live replica: the failure stands
                    self.migration.count(move)
                answer = await _answer_unless_abandoned(call, abandoned, request_id)
            finally:
                call.cancel()  # NOTE: when cancelled here, aborts the request in the engine
                placements.end_attempt()
            move = placements.move_of(answer.error)
            if not await self.migration.may_move(request_id, answer.error, attempt, num_tokens):
                break
            placements.leave(request)
        assert answer is not None
        yield answer

    async def _through_channel(
        self,
        request: GenerateRequest,
        moving: tuple[RequestStepOutput, Move, int] | None = None,
    ) -> AsyncGenerator[RequestStepOutput, None]:
        """A streamed request: its outputs from the channel, a refusal or failure from its
        call's answer (or the channel's end, which the call then reports). A failure of the
        engine sends it again (`MigrationPolicy`), resumed from the tokens that reached the
        caller (n > 1 choices: each from its own, `_resume_choices`). `moving`: a request
        already on the move (the failure that moved it, the move, its next attempt's number),
        placed, counted and limited as a request sent again is."""
        request_id = request.request_id
        request.channel_id = self.subscriber.channel_id
        loop = asyncio.get_running_loop()
        subscriber = self.subscriber

        def channel_lost() -> None:
            queue.put_nowait(broken_call(request_id, ChannelLostError(request_id)))

        def abandon(why: str) -> None:  # its replica makes no progress
            queue.put_nowait(broken_call(request_id, ReplicaStalledError(why)))

        def read_channel(replica_id: str) -> None:
            subscriber.accepted(request_id, replica_id)

        placements = Placements(request, self.watch, abandon, read_channel)
        resumed_from = list(request.output_token_ids)
        # Per choice, the tokens that reached the caller, once any did; the choices finished.
        delivered: dict[int, list[int]] | None = None
        finished_choices: set[int] = set()
        failure, move, first_attempt = moving if moving is not None else (None, None, 0)
        for attempt in itertools.count(first_attempt):
            placements.start_attempt()
            queue: asyncio.Queue[Any] = asyncio.Queue()
            subscriber.register(request_id, queue.put_nowait)
            call = self.engine.generate.remote(request)
            watcher = asyncio.create_task(_watch(call, queue, request_id, subscriber))
            lag_timer: asyncio.TimerHandle | None = None
            try:
                if failure is not None and move is not None:  # sent again: counted once placed
                    if not await placements.placed_in_time():
                        call.cancel()  # before the caller hears: it must not run meanwhile
                        yield failure  # no live replica: the failure stands
                        return
                    self.migration.count(move)
                failure = None
                held = None
                while True:
                    item = held if held is not None else await queue.get()
                    held = None
                    if item is _CALL_ENDED:  # its finish may still be coming through the channel
                        lag_timer = loop.call_later(CHANNEL_LAG_S, channel_lost)
                        continue
                    if item.error is not None:
                        failure = item
                        break
                    output, held = _with_queued(item, queue)
                    delivered = {} if delivered is None else delivered
                    for delta in output.deltas:
                        delivered.setdefault(delta.index, []).extend(delta.token_ids)
                        if delta.finish_reason is not None:
                            finished_choices.add(delta.index)
                    yield output
                    if output.finished:
                        return
            finally:
                watcher.cancel()
                if lag_timer is not None:
                    lag_timer.cancel()
                # NOTE: cancelling a handle call cancels the replica's call, which aborts the
                # request there (a no-op for a call that ended).
                call.cancel()
                subscriber.unregister(request_id)
                placements.end_attempt()
            move = placements.move_of(failure.error)
            longest = max(map(len, (delivered or {}).values()), default=0)
            num_tokens = len(request.prompt_token_ids) + len(resumed_from) + longest
            if not await self.migration.may_move(request_id, failure.error, attempt, num_tokens):
                yield failure
                return
            # Another engine continues from what reached the caller (`output_token_ids`),
            # with the same seed (see the module).
            placements.leave(request)
            if delivered is not None and request.sampling_params.n != 1:
                resumed = self._resume_choices(
                    request, delivered, finished_choices, (failure, move, attempt + 1)
                )
                async with contextlib.aclosing(resumed):
                    async for output in resumed:
                        yield output
                return
            request.output_token_ids = resumed_from + (delivered or {}).get(0, [])

    async def _resume_choices(
        self,
        request: GenerateRequest,
        delivered: dict[int, list[int]],
        finished: set[int],
        moving: tuple[RequestStepOutput, Move, int],
    ) -> AsyncGenerator[RequestStepOutput, None]:
        """A stream of n > 1 choices whose engine failed it once its tokens had begun: each
        unfinished choice goes on as a request of its own, with the seed and the tokens its
        engine gave it after the prompt forked (scheduler/request.py's `fork_child`), through
        the same moves as any stream (each counted once placed, within the moves left); their
        outputs come back as the choices of this one, and the first failure of one ends them
        all (as a failed choice ends its request)."""
        failure = moving[0]
        choices = [i for i in range(request.sampling_params.n) if i not in finished]
        if any(not delivered.get(i) for i in choices):
            yield failure  # a choice without a token yet: its first draw was its prompt's
            return
        queue: asyncio.Queue[tuple[int, RequestStepOutput | None]] = asyncio.Queue()

        async def follow(index: int) -> None:
            try:
                choice = choice_request(request, index, delivered[index])
                self._add_routing_hashes(choice)
                async for output in self._through_channel(choice, moving):
                    queue.put_nowait((index, output))
            except Exception as exc:  # noqa: BLE001 - a bug here fails the stream, loudly
                queue.put_nowait((index, broken_call(request.request_id, exc)))
            finally:
                queue.put_nowait((index, None))

        followers = [asyncio.create_task(follow(index)) for index in choices]
        try:
            open_choices = set(choices)
            while open_choices:
                index, output = await queue.get()
                if output is None:  # its stream ended (after its finish, or cancelled)
                    open_choices.discard(index)
                    continue
                if output.error is not None:
                    yield RequestStepOutput(request.request_id, error=output.error)
                    return
                if output.finished:
                    open_choices.discard(index)
                deltas = [
                    dataclasses.replace(delta, request_id=request.request_id, index=index)
                    for delta in output.deltas
                ]
                yield RequestStepOutput(
                    request.request_id, deltas, finished=output.finished and not open_choices
                )
        finally:
            for follower in followers:
                follower.cancel()

    def _add_routing_hashes(self, request: GenerateRequest) -> None:
        """With cache-aware routing and a choice of replicas, the prompt's block hashes, for the
        router to rank the replicas by the prefix each holds."""
        views = kv_views.KV_VIEWS
        views.follow_live_replicas()  # also lets the router's news reach this loop
        if views.attached and len(views.live_replica_ids) > 1:  # else nothing to choose
            request.routing_hashes = views.routing_hashes(
                request.prompt_token_ids, request.cache_salt, request.lora_key
            )


class ChannelLostError(RuntimeError):
    """A streamed request's call ended, but its finish never came through the output channel."""


class ReplicaStalledError(RuntimeError):
    """The replica holding a request makes no progress (`ReplicaWatch`): the request leaves it."""


def broken_call(request_id: str, exc: BaseException) -> RequestStepOutput:
    """A call that failed (the replica died, the channel lost the request) as the request's
    failure: the client is told only that, with the request id; the cause goes to the log."""
    logger.warning("request %s: engine call failed: %r", request_id, exc)
    message = f"engine unavailable (request {request_id})"
    return RequestStepOutput(request_id, error=RequestFailure(FailureKind.DEAD, message))


async def _answer_unless_abandoned(
    call: Any, abandoned: asyncio.Future[RequestStepOutput], request_id: str
) -> RequestStepOutput:
    """The call's answer (a failed call as the request's failure), or, should its replica be
    found to make no progress first, the failure `abandoned` brings."""
    answering = asyncio.ensure_future(_answer_of(call))
    try:
        await asyncio.wait({answering, abandoned}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not answering.done():
            answering.cancel()
    if answering.done() and not answering.cancelled():
        try:
            return answering.result()
        except Exception as exc:  # noqa: BLE001 - the replica died, or the call failed
            return broken_call(request_id, exc)
    return abandoned.result()


async def _answer_of(call: Any) -> RequestStepOutput:
    return await call


async def _watch(
    call: Any, queue: asyncio.Queue[Any], request_id: str, subscriber: OutputSubscriber
) -> None:
    """Feed `queue` the answer of a streamed request's call: its refusal or failure, or the end
    of the call (its outputs come through the channel of the replica the answer names: read it
    now, should the router's word not have come)."""
    try:
        answer = await call
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # noqa: BLE001 - the replica died, or the call failed
        queue.put_nowait(broken_call(request_id, exc))
        return
    if answer.error is not None:
        queue.put_nowait(answer)
        return
    subscriber.accepted(request_id, answer.replica_id)
    queue.put_nowait(_CALL_ENDED)


def _with_queued(
    output: RequestStepOutput, queue: asyncio.Queue[Any]
) -> tuple[RequestStepOutput, Any]:
    """`output` and the outputs queued right behind it, as one (vLLM's
    `RequestOutputCollector`): a reader that falls behind the engine's steps then writes
    fewer, larger chunks of the same text. Also returns the first queued item that could not
    join (a failure, the call's end), to be handled next."""
    joined = [output]
    while not joined[-1].finished and not queue.empty():
        item = queue.get_nowait()
        if not isinstance(item, RequestStepOutput) or item.error is not None:
            return merge_step_outputs(joined), item
        joined.append(item)
    return merge_step_outputs(joined), None
