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
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, AsyncGenerator

from ray.serve.handle import DeploymentHandle

# NOTE: the module, not its `KV_VIEWS`: the router in this process reads the same object.
from pagedray.cluster import kv_views
from pagedray.cluster.engine_control import EngineControl
from pagedray.cluster.output_subscriber import OutputSubscriber
from pagedray.engine.engine_client import EngineLimits, Health
from pagedray.engine.step_outputs import merge_step_outputs
from pagedray.engine.wire import GenerateRequest, RequestStepOutput
from pagedray.scheduler.request_failure import FailureKind, RequestFailure

logger = logging.getLogger("ray.serve.pagedray.ingress")
# Seconds a streamed request's finish may trail its call's end (they travel on separate paths).
CHANNEL_LAG_S = 10.0
# On the queue of a streamed request: its call ended (its finish may still be on the channel).
_CALL_ENDED = object()


class ServeEngineClient:
    """The engine deployment behind `engine` (a handle routed by `EngineRequestRouter`)."""

    def __init__(self, engine: DeploymentHandle, control: EngineControl) -> None:
        self.engine = engine
        self.control = control
        self.subscriber = OutputSubscriber(engine)

    def generate(self, request: GenerateRequest) -> AsyncGenerator[RequestStepOutput, None]:
        """The request's one call to the engine deployment. Leaving early cancels the call,
        which aborts the request in the engine."""
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
        finished output."""
        call = self.engine.generate.remote(request)
        try:
            try:
                answer = await call
            except Exception as exc:  # noqa: BLE001 - the replica died, or the call failed
                answer = broken_call(request.request_id, exc)
            yield answer
        finally:
            call.cancel()

    async def _through_channel(
        self, request: GenerateRequest
    ) -> AsyncGenerator[RequestStepOutput, None]:
        """A streamed request: its outputs from the channel, a refusal or failure from its
        call's answer (or the channel's end, which the call then reports)."""
        request_id = request.request_id
        queue: asyncio.Queue[Any] = asyncio.Queue()
        request.channel_id = self.subscriber.channel_id
        self.subscriber.register(request_id, queue.put_nowait)
        loop = asyncio.get_running_loop()
        subscriber = self.subscriber

        def routed(replica_id: str) -> None:  # on the router's thread
            loop.call_soon_threadsafe(subscriber.accepted, request_id, replica_id)

        request.on_routed = routed
        call = self.engine.generate.remote(request)
        watcher = asyncio.create_task(_watch(call, queue, request_id, subscriber))
        try:
            held = None
            while True:
                item = held if held is not None else await queue.get()
                held = None
                if item is _CALL_ENDED:  # its finish may still be on its way through the channel
                    lost = broken_call(request_id, ChannelLostError(request_id))
                    loop.call_later(CHANNEL_LAG_S, queue.put_nowait, lost)
                    continue
                if item.error is not None:
                    yield item
                    return
                output, held = _with_queued(item, queue)
                yield output
                if output.finished:
                    return
        finally:
            watcher.cancel()
            # NOTE: cancelling a handle call cancels the replica's call, which aborts the
            # request there (a no-op for a call that ended).
            call.cancel()
            self.subscriber.unregister(request_id)

    def _add_routing_hashes(self, request: GenerateRequest) -> None:
        """With cache-aware routing and a choice of replicas, the prompt's block hashes, for the
        router to rank the replicas by the prefix each holds."""
        views = kv_views.KV_VIEWS
        views.follow_live_replicas()  # also lets the router's news reach this loop
        if views.attached and len(views.live_replica_ids) > 1:  # else nothing to choose
            request.routing_hashes = views.routing_hashes(
                request.prompt_token_ids, request.cache_salt
            )


class ChannelLostError(RuntimeError):
    """A streamed request's call ended, but its finish never came through the output channel."""


def broken_call(request_id: str, exc: BaseException) -> RequestStepOutput:
    """A call that failed (the replica died, the channel lost the request) as the request's
    failure: the client is told only that, with the request id; the cause goes to the log."""
    logger.warning("request %s: engine call failed: %r", request_id, exc)
    message = f"engine unavailable (request {request_id})"
    return RequestStepOutput(request_id, error=RequestFailure(FailureKind.DEAD, message))


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
