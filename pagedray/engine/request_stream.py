"""One request's way out of the engine loop: the outputs held back for `--stream-interval`, the
queue its reader waits on, and the reading itself.

What is held back (`StreamCoalescer`) stays on the loop's side, so a reader is woken only when
there is something to send: a client that does not stream wakes once, at the end, instead of
every step (the loop then spends less time, and holds the GIL less, beside the running model).
A stream with a sink hands each message to it at once instead (an output channel's, which
batches a step's messages for many requests into one).
"""

from __future__ import annotations

import asyncio
from typing import AsyncGenerator, Callable

from pagedray.engine.step_outputs import StreamCoalescer, merge_step_outputs
from pagedray.engine.wire import RequestStepOutput

Sink = Callable[[RequestStepOutput | BaseException], None]


class RequestStream:
    """Outputs in, coalesced; read once, by the request's caller, or handed to `sink`."""

    def __init__(self, stream_interval: int | None, sink: Sink | None = None) -> None:
        self.coalescer = StreamCoalescer(stream_interval)
        self.queue: asyncio.Queue[RequestStepOutput | BaseException] = asyncio.Queue()
        self.send: Sink = sink if sink is not None else self.queue.put_nowait
        # Whether its outputs go out as they come (a streaming client, or stop strings to watch),
        # rather than once, at the end.
        self.streaming = stream_interval is not None

    def put(self, output: RequestStepOutput) -> None:
        self.coalescer.add(output)
        if self.coalescer.ready():
            self.send(self.coalescer.take())

    def fail(self, exc: BaseException) -> None:
        """End the stream with `exc`; what was held is dropped (the request failed)."""
        self.send(exc)

    async def read(self, on_close: Callable[[], None]) -> AsyncGenerator[RequestStepOutput, None]:
        """The outputs until the finished one (or the failure, raised); closing or cancelling it
        before the end calls `on_close` (which aborts the request)."""
        finished = False
        try:
            while not finished:
                item = await self.queue.get()
                # A reader that fell behind takes what piled up as one output.
                batch: list[RequestStepOutput] = []
                while not isinstance(item, BaseException):
                    batch.append(item)
                    if item.finished or self.queue.empty():
                        break
                    item = self.queue.get_nowait()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = batch[-1].finished
                yield merge_step_outputs(batch)
        finally:
            if not finished:
                on_close()
