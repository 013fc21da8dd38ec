"""The engine requests of one client request: opened together, given their text here, merged.

One client request may be several engine requests (a batch of completion prompts); their
outputs are merged here, and choice `i` of prompt `p` becomes choice `p * n + i` as OpenAI
numbers them (`answers.py`). The engine sends token ids; the text, stop strings and the usage
a client sees are made here (`RequestText`).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, AsyncGenerator, AsyncIterator

from pagedray.engine.engine_client import EngineClient
from pagedray.engine.request_text import RequestText
from pagedray.engine.wire import GenerateRequest, RequestStepOutput
from pagedray.openai.request_log import RequestLog
from pagedray.scheduler.request_failure import FailureKind, RequestFailure

logger = logging.getLogger(__name__)


class EngineStreams:
    """The engine requests of one client request, through one `EngineClient`: `open` waits for
    each one's first output (its acceptance, its first tokens or its refusal), `merged` brings
    their outputs with text, as they come.

    A request whose every choice has ended here (a stop string) is finished at once and its
    stream closed, which aborts it in the engine.
    """

    def __init__(
        self,
        client: EngineClient,
        requests: list[GenerateRequest],
        tokenizer: Any,
        log: RequestLog | None = None,
    ) -> None:
        self.log = log  # the request log's, when the server keeps one
        self.request_ids = [request.request_id for request in requests]
        self.params = [request.sampling_params for request in requests]  # as the engine runs them
        self.texts = [
            RequestText(tokenizer, request.prompt_token_ids, request.sampling_params)
            for request in requests
        ]
        self.streams = [client.generate(request) for request in requests]
        # What each stream's first output brought (its first tokens, or a one-message answer).
        self.firsts: list[RequestStepOutput | None] = [None] * len(requests)
        # With several streams, the task per stream that feeds `merged` its outputs.
        self.pumps: dict[int, asyncio.Task[None]] = {}

    async def open(self) -> RequestFailure | None:
        """Wait until every engine request is taken; returns the first refusal, if any."""
        try:
            firsts = await asyncio.gather(
                *(anext(stream) for stream in self.streams), return_exceptions=True
            )
        except BaseException:  # cancelled: the client went away before admission
            await self.close()
            raise
        for index, first in enumerate(firsts):
            if isinstance(first, BaseException):  # a client breaks its contract: no output
                logger.error("request %s: no acceptance", self.request_ids[index], exc_info=first)
                first = RequestStepOutput(self.request_ids[index], error=self._internal(index))
            failure = self._failure(index, first)
            if failure is not None:
                await self.close()
                return failure
            if first.deltas or first.finished:
                self.firsts[index] = first
        return None

    async def merged(self) -> AsyncGenerator[tuple[int, RequestStepOutput], None]:
        """(prompt index, output) as they arrive, the last of each with its usage; a failure is
        an output whose `error` is set. Closing this closes every stream (aborting the rest)."""
        try:
            async for index, item in self._arrivals():
                failure = self._failure(index, item)
                if failure is not None:
                    yield index, RequestStepOutput(item.request_id, error=failure)
                    await self._close_stream(index)
                    continue
                output = self._with_text(index, item)
                if output.finished and not item.finished:  # ended here: the engine need not go on
                    await self._close_stream(index)
                yield index, output
        finally:
            await self.close()

    async def _arrivals(self) -> AsyncIterator[tuple[int, RequestStepOutput]]:
        """Each stream's outputs until its last, as they come; one stream is read directly, several
        through a queue that one task per stream feeds."""
        for index, first in enumerate(self.firsts):
            if first is not None:
                yield index, first
        open_streams = {i for i, first in enumerate(self.firsts) if not _is_last(first)}
        if len(self.streams) == 1:
            if open_streams:
                async for output in self.streams[0]:
                    yield 0, output
                    if _is_last(output):
                        break
            return
        queue: asyncio.Queue[tuple[int, RequestStepOutput]] = asyncio.Queue()
        self.pumps = {i: asyncio.create_task(self._pump(i, queue)) for i in open_streams}
        try:
            while open_streams:
                index, output = await queue.get()
                if index not in open_streams:
                    continue  # closed here meanwhile
                if _is_last(output):
                    open_streams.discard(index)
                yield index, output
        finally:
            for pump in self.pumps.values():
                pump.cancel()

    async def _pump(self, index: int, queue: asyncio.Queue[tuple[int, RequestStepOutput]]) -> None:
        async for output in self.streams[index]:
            queue.put_nowait((index, output))
            if _is_last(output):
                return

    def _failure(self, index: int, output: RequestStepOutput) -> RequestFailure | None:
        """The failure an output carries, fit for the client: an internal error says only that,
        with the request id; the detail goes to the log under that id."""
        failure = output.error
        if failure is not None and failure.kind is FailureKind.INTERNAL:
            request_id = self.request_ids[index]
            logger.error("request %s: engine error: %s", request_id, failure.message)
            return self._internal(index)
        return failure

    def _internal(self, index: int) -> RequestFailure:
        message = f"internal error (request {self.request_ids[index]})"
        return RequestFailure(FailureKind.INTERNAL, message)

    def _with_text(self, index: int, output: RequestStepOutput) -> RequestStepOutput:
        text = self.texts[index]
        deltas = [d for d in (text.apply(delta) for delta in output.deltas) if d is not None]
        if self.log is not None:
            for delta in deltas:
                self.log.output(delta, text.choices[delta.index].text)
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
            output.request_id, deltas, finished, usage, num_cached_tokens=output.num_cached_tokens
        )

    async def _close_stream(self, index: int) -> None:
        pump = self.pumps.get(index)
        if pump is not None and not pump.done():
            pump.cancel()
            await asyncio.wait([pump])  # NOTE: never raises the pump's own cancellation
        await self.streams[index].aclose()

    async def close(self) -> None:
        """Close every stream: those still open abort their engine requests."""
        for index in range(len(self.streams)):
            await self._close_stream(index)


def _is_last(output: RequestStepOutput | None) -> bool:
    return output is not None and (output.finished or output.error is not None)
