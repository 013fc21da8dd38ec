"""Output channels: a step's streamed outputs for many requests sent as one message.

Streamed through a Serve call of its own, every request costs the engine replica and the ingress
a message each step: serialising it, a gRPC frame, waking the reader. At 64 streams that was
about 0.2 ms of CPU per token on the engine replica alone (on 2 cores, beside the model). So an
ingress replica opens one channel per engine replica and subscribes to it once; its streamed
requests name the channel, and each step's outputs for all of them leave as one batch, as vLLM's
engine core sends one message per step to its front end.

A request's own call still anchors it: it answers acceptance or refusal, fails if the request
fails, and cancelling it aborts the request. The channel only carries the outputs. It holds them
while no subscriber reads (one has not connected yet, or is reconnecting), and goes away once it
has neither a subscriber, nor a request, nor an output unread.
"""

from __future__ import annotations

import asyncio
from typing import AsyncIterator

from pagedray.engine.step_outputs import RequestStepOutput


class OutputChannel:
    """The streamed outputs of one subscriber's requests, delivered as one batch per step."""

    def __init__(self) -> None:
        self.request_ids: set[str] = set()  # requests whose outputs come here
        self.subscribed = False
        self._batch: list[RequestStepOutput] = []
        self._ready = asyncio.Event()

    def put(self, output: RequestStepOutput) -> None:
        """Queue an output for the next batch; every output of one step lands before the
        subscriber wakes, since the engine loop publishes a step in one go."""
        self._batch.append(output)
        self._ready.set()

    def end(self, request_id: str, discard_outputs: bool) -> None:
        """A request's call ended; outputs it left unread go out still, unless `discard_outputs`
        (it was aborted: nobody waits for them)."""
        self.request_ids.discard(request_id)
        if discard_outputs and any(output.request_id == request_id for output in self._batch):
            self._batch = [output for output in self._batch if output.request_id != request_id]

    @property
    def unused(self) -> bool:
        return not self.subscribed and not self.request_ids and not self._batch

    async def batches(self) -> AsyncIterator[list[RequestStepOutput]]:
        """Each wake-up's outputs as one list, in order, while the caller reads."""
        while True:
            await self._ready.wait()
            self._ready.clear()
            batch, self._batch = self._batch, []
            if batch:
                yield batch


class OutputChannels:
    """This engine's channels, by the id their subscriber chose."""

    def __init__(self) -> None:
        self._channels: dict[str, OutputChannel] = {}

    def __len__(self) -> int:
        return len(self._channels)

    def open(self, channel_id: str) -> OutputChannel:
        """The channel `channel_id`, made on first use."""
        channel = self._channels.get(channel_id)
        if channel is None:
            channel = self._channels[channel_id] = OutputChannel()
        return channel

    def end_request(self, channel_id: str, request_id: str, discard_outputs: bool) -> None:
        """See `OutputChannel.end`."""
        channel = self._channels.get(channel_id)
        if channel is not None:
            channel.end(request_id, discard_outputs)
            self._forget_if_unused(channel_id, channel)

    async def subscribe(self, channel_id: str) -> AsyncIterator[list[RequestStepOutput]]:
        """The channel's batches until the caller stops reading; one subscriber at a time."""
        channel = self.open(channel_id)
        if channel.subscribed:
            raise RuntimeError(f"output channel {channel_id!r} already has a subscriber")
        channel.subscribed = True
        try:
            async for batch in channel.batches():
                yield batch
        finally:
            channel.subscribed = False
            self._forget_if_unused(channel_id, channel)

    def _forget_if_unused(self, channel_id: str, channel: OutputChannel) -> None:
        # NOTE: a channel whose subscriber went away with outputs unread is kept for its return.
        if channel.unused:
            self._channels.pop(channel_id, None)
