"""Output channels: a step's streamed outputs for many requests sent as one message.

Streamed through a Serve call of its own, every request costs the engine replica and the ingress
a message each step: serialising it, a gRPC frame, waking the reader. So an ingress replica
subscribes once to each engine replica that holds its streamed requests; those requests name its
channel, and each step's outputs for all of them leave as one batch, as vLLM's engine core sends
one message per step to its front end.

A request's own call still anchors it: its answer is the refusal, the failure or the end, and
cancelling it aborts the request. The channel only carries the outputs, and lives as
long as its subscription: it holds outputs until the subscriber first reads; a subscription that
ends (the ingress went away, the stream broke) aborts the requests still on it, which then fail
through their own calls rather than lose outputs silently; one idle for `IDLE_S` ends itself,
so that it holds no Serve call open for nothing (autoscaling and draining count open calls); a
channel nobody subscribes to within `UNSUBSCRIBED_TTL_S` is closed the same way.
"""

from __future__ import annotations

import asyncio
from typing import AsyncIterator, Callable

from pagedray.engine.wire import RequestStepOutput

# The keyword argument that addresses a subscription to one engine replica (its unique id);
# the engine deployment's request router reads it.
REPLICA_ID_KWARG = "replica_id"
# Seconds a subscription with no request on its channel lasts before it ends itself.
IDLE_S = 5.0
# Seconds a channel waits for its first subscriber before its requests are aborted.
UNSUBSCRIBED_TTL_S = 30.0


class OutputChannel:
    """The streamed outputs of one subscriber's requests, delivered as one batch per step."""

    def __init__(self) -> None:
        self.request_ids: set[str] = set()  # requests whose outputs come here
        self.subscription: int | None = None  # the current subscription's number
        self.num_subscriptions = 0
        self.sent_by: int | None = None  # the subscription that sent the last batch
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
        if not self.request_ids:
            self._ready.set()  # a reader waiting without a timer starts its idle countdown
        if discard_outputs and any(output.request_id == request_id for output in self._batch):
            self._batch = [output for output in self._batch if output.request_id != request_id]

    def take_over(self) -> tuple[int, bool]:
        """Start a subscription; one still reading stops at its next wake-up (its end was not
        seen here). Returns its number, and whether the one before sent batches: those may
        never have arrived, so the requests on the channel cannot go on without a gap."""
        lost = self.subscription is not None and self.sent_by == self.subscription
        self.num_subscriptions += 1
        self.subscription = self.num_subscriptions
        self._ready.set()
        return self.subscription, lost

    async def batches(
        self, subscription: int, idle_s: float
    ) -> AsyncIterator[list[RequestStepOutput]]:
        """The outputs as they come, a list per wake-up, while `subscription` is the current one
        and the channel has had a request within `idle_s`."""
        while self.subscription == subscription:
            if not self._batch:
                self._ready.clear()
                if self.request_ids:  # the streaming case: no timer per step
                    await self._ready.wait()
                    continue
                try:
                    await asyncio.wait_for(self._ready.wait(), idle_s)
                except asyncio.TimeoutError:
                    if not self.request_ids:
                        return
                continue
            batch, self._batch = self._batch, []
            self.sent_by = subscription
            yield batch


class OutputChannels:
    """This engine's channels, by the id their subscriber chose."""

    def __init__(
        self,
        abort: Callable[[str], None],
        idle_s: float = IDLE_S,
        unsubscribed_ttl_s: float = UNSUBSCRIBED_TTL_S,
    ) -> None:
        """`abort(request_id)` aborts a request whose channel closed."""
        self._abort = abort
        self.idle_s = idle_s
        self.unsubscribed_ttl_s = unsubscribed_ttl_s
        self._channels: dict[str, OutputChannel] = {}
        self.num_batches = 0  # sent, over this engine's life

    def __len__(self) -> int:
        return len(self._channels)

    def open(self, channel_id: str) -> OutputChannel:
        """The channel `channel_id`, made on first use."""
        channel = self._channels.get(channel_id)
        if channel is None:
            channel = self._channels[channel_id] = OutputChannel()
            asyncio.get_running_loop().call_later(
                self.unsubscribed_ttl_s, self._close_if_unsubscribed, channel_id, channel
            )
        return channel

    def end_request(self, channel_id: str, request_id: str, discard_outputs: bool) -> None:
        """See `OutputChannel.end`."""
        channel = self._channels.get(channel_id)
        if channel is not None:
            channel.end(request_id, discard_outputs)

    async def subscribe(self, channel_id: str) -> AsyncIterator[list[RequestStepOutput]]:
        """The channel's batches until the caller stops reading or the channel is idle; then
        the channel closes, aborting what is still on it (unless another subscription took
        over)."""
        channel = self.open(channel_id)
        subscription, lost = channel.take_over()
        if lost:  # fail those requests (503 through their calls) rather than leave holes
            for request_id in list(channel.request_ids):
                self._abort(request_id)
        try:
            async for batch in channel.batches(subscription, self.idle_s):
                self.num_batches += 1
                yield batch
        finally:
            if channel.subscription == subscription:
                self._close(channel_id, channel)

    def _close_if_unsubscribed(self, channel_id: str, channel: OutputChannel) -> None:
        if channel.subscription is None and self._channels.get(channel_id) is channel:
            self._close(channel_id, channel)

    def _close(self, channel_id: str, channel: OutputChannel) -> None:
        if self._channels.get(channel_id) is channel:
            del self._channels[channel_id]
        for request_id in list(channel.request_ids):
            self._abort(request_id)
