"""The ingress's end of the engines' output channels (pagedray/engine/output_channel.py).

One subscription per engine replica that holds a streamed request of this ingress replica; each
step's batch is handed out to the requests waiting here, by request id. A subscription lasts
while that replica holds requests of ours (the engine ends an idle one).
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import pickle
import uuid
from typing import Any, Callable

from pagedray.engine.output_channel import REPLICA_ID_KWARG
from pagedray.engine.wire import RequestStepOutput

logger = logging.getLogger(__name__)
# Seconds between attempts to subscribe again after a subscription broke while requests of
# that replica were still open (if the replica died, their own calls fail and end the retries).
RESUBSCRIBE_AFTER_S = 0.5

Deliver = Callable[[RequestStepOutput], None]


class OutputSubscriber:
    """This ingress replica's channel id, its subscriptions, and the requests they feed."""

    def __init__(self, engine: Any) -> None:
        """`engine`: a handle to the engine deployment, routed by `EngineRequestRouter`."""
        self.engine = engine
        self.channel_id = f"ingress-{uuid.uuid4().hex}"
        self._deliveries: dict[str, Deliver] = {}
        self._replica_of: dict[str, str] = {}  # request id -> the engine replica holding it
        self._subscriptions: dict[str, asyncio.Task[None]] = {}

    def register(self, request_id: str, deliver: Deliver) -> None:
        """Have `request_id`'s outputs handed to `deliver` (before the request is sent)."""
        self._deliveries[request_id] = deliver

    def accepted(self, request_id: str, replica_id: str | None) -> None:
        """`replica_id` holds the request, or was just chosen for it (a retry may choose again):
        make sure its channel is read."""
        if request_id not in self._deliveries or replica_id is None:
            return  # ended meanwhile
        self._replica_of[request_id] = replica_id
        task = self._subscriptions.get(replica_id)
        if task is None or task.done():
            # NOTE: in a context of its own, not the HTTP request's that happened to start it:
            # Serve cancels a request's calls with it, and this one serves every request.
            reading = self._read(replica_id)
            task = asyncio.get_running_loop().create_task(reading, context=contextvars.Context())
            self._subscriptions[replica_id] = task

    def unregister(self, request_id: str) -> None:
        self._deliveries.pop(request_id, None)
        self._replica_of.pop(request_id, None)

    def close(self) -> None:
        """End every subscription (this ingress replica stops, its requests drained): an
        engine counts one as a call in flight, and stopping beside it would wait for it to go
        idle (`IDLE_S`)."""
        subscriptions, self._subscriptions = self._subscriptions, {}
        for task in subscriptions.values():
            task.cancel()  # its call is cancelled as the task unwinds

    async def _read(self, replica_id: str) -> None:
        """Hand out `replica_id`'s batches while requests of that replica are open here: its
        subscription ends itself once idle, and is made again if a request came meanwhile."""
        streaming = self.engine.options(stream=True)
        address = {REPLICA_ID_KWARG: replica_id}
        broke = False
        while replica_id in self._replica_of.values():
            if broke:
                broke = False
                await asyncio.sleep(RESUBSCRIBE_AFTER_S)
                continue  # asked again: a request may have ended meanwhile
            batches = streaming.subscribe.remote(self.channel_id, **address)
            try:
                async for pickled in batches:  # a list[RequestStepOutput] per engine step
                    self._deliver(pickle.loads(pickled), replica_id)
            except asyncio.CancelledError:
                batches.cancel()
                task = asyncio.current_task()
                if task is not None and task.cancelling():
                    raise  # cancelled here; otherwise Serve cancelled the call: it broke
                broke = True
            except Exception as exc:  # noqa: BLE001 - the replica died, or the call failed
                # Requests left on that channel were aborted: they fail through their calls.
                batches.cancel()
                logger.info("output channel of engine replica %s broke: %r", replica_id, exc)
                broke = True
        if self._subscriptions.get(replica_id) is asyncio.current_task():
            del self._subscriptions[replica_id]

    def _deliver(self, outputs: list[RequestStepOutput], replica_id: str) -> None:
        """Hand out a batch of `replica_id`'s; an output of a request that has since moved to
        another replica (its engine failed it) is late, and dropped."""
        for output in outputs:
            deliver = self._deliveries.get(output.request_id)
            if deliver is not None and self._replica_of.get(output.request_id) == replica_id:
                deliver(output)
                if output.finished:  # nothing more comes for it
                    self.unregister(output.request_id)
