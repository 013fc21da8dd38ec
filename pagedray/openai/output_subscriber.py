"""The ingress's end of the engines' output channels (pagedray/engine/output_channel.py).

One subscription per engine replica that holds a streamed request of this ingress replica; each
step's batch is handed out to the requests waiting here, by request id.
"""

from __future__ import annotations

import asyncio
import logging
import pickle
import uuid
from typing import Any, Callable

from pagedray.engine.step_outputs import RequestStepOutput

logger = logging.getLogger("ray.serve.pagedray.ingress")
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
        """`replica_id` holds the request: make sure its channel is read."""
        if request_id not in self._deliveries or replica_id is None:
            return  # ended meanwhile
        self._replica_of[request_id] = replica_id
        task = self._subscriptions.get(replica_id)
        if task is None or task.done():
            task = asyncio.get_running_loop().create_task(self._read(replica_id))
            self._subscriptions[replica_id] = task

    def unregister(self, request_id: str) -> None:
        self._deliveries.pop(request_id, None)
        self._replica_of.pop(request_id, None)

    async def _read(self, replica_id: str) -> None:
        """Hand out `replica_id`'s batches; once the subscription breaks, subscribe again while
        requests of that replica are open here."""
        streaming = self.engine.options(stream=True)
        while True:
            try:
                batches = streaming.subscribe.remote(self.channel_id, replica_id=replica_id)
                async for pickled in batches:  # a list[RequestStepOutput] per engine step
                    for output in pickle.loads(pickled):
                        deliver = self._deliveries.get(output.request_id)
                        if deliver is not None:
                            deliver(output)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - the replica died, or the call failed
                logger.info("output channel of engine replica %s broke: %r", replica_id, exc)
            if replica_id not in self._replica_of.values():
                self._subscriptions.pop(replica_id, None)
                return
            await asyncio.sleep(RESUBSCRIBE_AFTER_S)

    async def close(self) -> None:
        for task in self._subscriptions.values():
            task.cancel()
        await asyncio.gather(*self._subscriptions.values(), return_exceptions=True)
        self._subscriptions.clear()
