"""The engine-side streams of one client request: opened together, given their text here, merged.

One client request may be several engine requests (a batch of completion prompts); their streams
are merged here, and choice `i` of prompt `p` becomes choice `p * n + i` as OpenAI numbers them
(`answers.py`). The engine streams token ids; the text, stop strings included, is made here
(`RequestText`).
"""

from __future__ import annotations

import asyncio
import functools
import logging
from typing import Any, AsyncGenerator

from pagedray.engine.request_text import RequestText
from pagedray.engine.step_outputs import RequestStepOutput, merge_step_outputs
from pagedray.openai.output_subscriber import OutputSubscriber
from pagedray.scheduler.request_failure import FailureKind, RequestFailure

logger = logging.getLogger("ray.serve.pagedray.ingress")
# Seconds a streamed request's finish may trail its call's end (they travel on separate streams).
CHANNEL_LAG_S = 10.0


class EngineStreams:
    """The engine-side streams of one client request, opened together, given their text here
    (the engine streams token ids) and merged.

    With a `subscriber`, streamed requests (a `stream_interval`) take their outputs from the
    engines' output channels, and their own calls carry only acceptance and failure. A request
    that wants one output at the end (`stream_interval` None) is one unary call
    (`generate_once`): its answer is its refusal, failure or output, so it is not waited for
    in `open`.

    A stream whose every choice has ended here (a stop string) is finished at once and its
    engine request cancelled, which aborts it in the engine.
    """

    def __init__(
        self,
        engine: Any,
        requests: list[dict[str, Any]],
        tokenizer: Any,
        subscriber: OutputSubscriber | None = None,
    ) -> None:
        streaming = engine.options(stream=True)
        self.request_ids = [request["request_id"] for request in requests]
        self.texts = [
            RequestText(tokenizer, request["prompt_token_ids"], request["sampling_params"])
            for request in requests
        ]
        # (prompt index, an output, an error, or None: the request's own call ended)
        self.queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
        self.subscriber = subscriber
        self.by_channel: set[int] = set()
        self.unary = {
            index
            for index, request in enumerate(requests)
            if "stream_interval" in request and request["stream_interval"] is None
        }
        if subscriber is not None:
            for index, request in enumerate(requests):
                if request.get("stream_interval") is not None:
                    request["channel_id"] = subscriber.channel_id
                    deliver = functools.partial(_put_indexed, self.queue, index)
                    subscriber.register(request["request_id"], deliver)
                    self.by_channel.add(index)
        # A stream (DeploymentResponseGenerator) per request, or a DeploymentResponse if unary.
        self.calls = [
            engine.generate_once.remote(request)
            if index in self.unary
            else streaming.generate.remote(request)
            for index, request in enumerate(requests)
        ]

    async def open(self) -> RequestFailure | None:
        """Wait until every streamed engine request is accepted; returns the first refusal, if
        any. A unary request's refusal comes as its answer, through `merged`."""
        streamed = [i for i in range(len(self.calls)) if i not in self.unary]
        try:
            firsts = await asyncio.gather(
                *(self.calls[i].__anext__() for i in streamed), return_exceptions=True
            )
        except BaseException:  # cancelled: the client went away before admission
            self.close()
            raise
        first_of = dict(zip(streamed, firsts))
        for index, first in first_of.items():
            error = _error_of(first, self.request_ids[index])
            if error is not None:
                self.close()
                return error
        for index in self.by_channel:
            assert self.subscriber is not None
            replica_id = getattr(first_of[index], "replica_id", None)
            self.subscriber.accepted(self.request_ids[index], replica_id)
        return None

    async def merged(self) -> AsyncGenerator[tuple[int, RequestStepOutput], None]:
        """(prompt index, output) as they arrive; the streams are cancelled if this is closed."""
        queue = self.queue
        tasks = self._pump_calls()
        done: set[int] = set()  # streams finished here: later items are dropped
        calls_ended: set[int] = set()
        held: tuple[int, Any] | None = None  # taken from the queue, not yet handled
        try:
            while len(calls_ended) < len(tasks) or len(done) < len(tasks):
                if held is not None:
                    (index, item), held = held, None
                else:
                    index, item = await queue.get()
                if item is None:
                    calls_ended.add(index)
                    if index in self.by_channel and index not in done:
                        # Its finish travels on the channel, which may lag the call's end.
                        lost = ChannelLostError(self.request_ids[index])
                        asyncio.get_running_loop().call_later(
                            CHANNEL_LAG_S, queue.put_nowait, (index, lost)
                        )
                    else:
                        done.add(index)
                    continue
                if index in done:
                    continue
                error = _error_of(item, self.request_ids[index])
                if error is not None:
                    done.add(index)
                    yield index, RequestStepOutput("", error=error)
                    continue
                item, held = self._with_queued(index, item)
                output = self._with_text(index, item)
                if output.finished:
                    done.add(index)
                    if not item.finished:  # ended here: the engine need not go on
                        tasks[index].cancel()
                        self.calls[index].cancel()
                yield index, output
        finally:
            for task in tasks:
                task.cancel()
            self.close()

    def _pump_calls(self) -> list[asyncio.Task[None]]:
        """A task per engine call feeding the queue its items, then a None when it ends."""

        async def pump(index: int, call: Any) -> None:
            try:
                if index in self.unary:
                    self.queue.put_nowait((index, await call))
                    return
                async for item in call:
                    self.queue.put_nowait((index, item))
            except asyncio.CancelledError:
                pass  # ended here (a stop string) or by the caller
            except Exception as exc:  # noqa: BLE001 - the replica died or the call failed
                self.queue.put_nowait((index, exc))

        def ended(index: int, _task: asyncio.Task[None]) -> None:
            self.queue.put_nowait((index, None))

        tasks = []
        for index, call in enumerate(self.calls):
            task = asyncio.create_task(pump(index, call))
            # NOTE: a callback, not the pump's `finally`: a task cancelled before it first ran
            # (a stop string in outputs the channel queued early) never runs its body.
            task.add_done_callback(functools.partial(ended, index))
            tasks.append(task)
        return tasks

    def _with_queued(
        self, index: int, output: RequestStepOutput
    ) -> tuple[RequestStepOutput, tuple[int, Any] | None]:
        """`output` and the outputs of the same engine request queued right behind it, as one
        (vLLM's `RequestOutputCollector`): a reader that falls behind the engine's steps then
        writes fewer, larger chunks of the same text, and the ingress spends less per token
        where it is busiest. Also returns the first queued item that could not join (another
        prompt's, an error, a call's end), to be handled next."""
        queued = [output]
        while not queued[-1].finished and not self.queue.empty():
            next_index, item = self.queue.get_nowait()
            mergeable = isinstance(item, RequestStepOutput) and item.error is None
            if next_index != index or not mergeable:
                return merge_step_outputs(queued), (next_index, item)
            queued.append(item)
        return merge_step_outputs(queued), None

    def _with_text(self, index: int, output: RequestStepOutput) -> RequestStepOutput:
        text = self.texts[index]
        deltas = [d for d in (text.apply(delta) for delta in output.deltas) if d is not None]
        finished = output.finished or text.finished
        usage = None
        if finished:
            completion_tokens = text.num_completion_tokens
            usage = {
                "prompt_tokens": text.num_prompt_tokens,
                "completion_tokens": completion_tokens,
                "total_tokens": text.num_prompt_tokens + completion_tokens,
                "cached_tokens": output.num_cached_tokens,
            }
        return RequestStepOutput(
            output.request_id,
            deltas,
            finished,
            usage,
            output.metrics,
            num_cached_tokens=output.num_cached_tokens,
        )

    def close(self) -> None:
        # NOTE: cancelling a handle call cancels the replica's generator, which aborts the request.
        for call in self.calls:
            call.cancel()
        if self.subscriber is not None:
            for index in self.by_channel:
                self.subscriber.unregister(self.request_ids[index])


class ChannelLostError(RuntimeError):
    """A streamed request's call ended, but its finish never came through the output channel."""


def _put_indexed(queue: asyncio.Queue[tuple[int, Any]], index: int, output: Any) -> None:
    queue.put_nowait((index, output))


def _error_of(item: Any, request_id: str) -> RequestFailure | None:
    """The failure an engine stream item carries, fit for the client: a raised exception (the
    replica died, the call failed) or an internal error says only that, with the request id;
    the detail goes to the log under that id."""
    if isinstance(item, BaseException):
        logger.warning("request %s: engine call failed: %r", request_id, item)
        message = f"engine unavailable (request {request_id})"
        return RequestFailure(FailureKind.DEAD, message)
    failure: RequestFailure | None = item.error
    if failure is not None and failure.kind is FailureKind.INTERNAL:
        logger.error("request %s: engine error: %s", request_id, failure.message)
        return RequestFailure(FailureKind.INTERNAL, f"internal error (request {request_id})")
    return failure
