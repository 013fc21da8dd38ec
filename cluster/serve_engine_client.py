"""`EngineClient` over the engine deployment (engine/engine_client.py): an ingress replica's way
to its engine replicas through Ray Serve.

A request that streams (a `stream_interval`) is one streaming call that carries only its
acceptance, naming the replica that holds it, and its failure; its outputs come through that
replica's output channel to this ingress replica (`OutputSubscriber`), a batch per step for
every request of ours there. A request that wants one message at the end is one unary call
(`generate_once`), answered with it: a stream of acceptance, output and end would cost the two
sides about 0.8 ms more of CPU a request. With cache-aware routing, each request carries its
prompt's block hashes to the router (`EngineRequestRouter`), which keeps them (they are not sent).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, AsyncGenerator, cast

from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

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
        self.streaming = engine.options(stream=True)
        self.control = control
        self.subscriber = OutputSubscriber(engine)

    def generate(self, request: GenerateRequest) -> AsyncGenerator[RequestStepOutput, None]:
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
        """A request that wants one message: one unary call, whose answer is its refusal, its
        failure or its finished output. Cancelling the call aborts the request."""
        call = self.engine.generate_once.remote(request)
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
        """A streamed request: acceptance (or refusal) from its call, outputs from the channel,
        a failure from whichever brings it first. Leaving early cancels the call, which aborts
        the request in the engine."""
        request_id = request.request_id
        queue: asyncio.Queue[Any] = asyncio.Queue()
        request.channel_id = self.subscriber.channel_id
        self.subscriber.register(request_id, queue.put_nowait)
        call = cast(DeploymentResponseGenerator, self.streaming.generate.remote(request))
        watcher: asyncio.Task[None] | None = None
        try:
            try:
                first = await call.__anext__()
            except Exception as exc:  # noqa: BLE001 - the replica died, or the call failed
                first = broken_call(request_id, exc)
            if first.error is not None:
                yield first
                return
            self.subscriber.accepted(request_id, first.replica_id)
            watcher = asyncio.create_task(_watch(call, queue, request_id))
            yield RequestStepOutput(request_id)  # accepted
            held = None
            while True:
                item = held if held is not None else await queue.get()
                held = None
                if item is _CALL_ENDED:  # its finish may still be on its way through the channel
                    lost = broken_call(request_id, ChannelLostError(request_id))
                    asyncio.get_running_loop().call_later(CHANNEL_LAG_S, queue.put_nowait, lost)
                    continue
                if item.error is not None:
                    yield item
                    return
                output, held = _with_queued(item, queue)
                yield output
                if output.finished:
                    return
        finally:
            if watcher is not None:
                watcher.cancel()
            # NOTE: cancelling a handle call cancels the replica's generator, which aborts the
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


async def _watch(call: Any, queue: asyncio.Queue[Any], request_id: str) -> None:
    """Feed `queue` what a streamed request's call brings after its acceptance: its failure, or
    the end of the call."""
    try:
        async for item in call:
            queue.put_nowait(item)
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # noqa: BLE001 - the replica died, or the call failed
        queue.put_nowait(broken_call(request_id, exc))
        return
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
