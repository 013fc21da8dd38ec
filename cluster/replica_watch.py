"""Honest replicas: an engine replica that holds requests of this ingress replica but makes no
progress is taken out of routing within seconds, and its requests move to another.

Serve's health check finds a wedged replica only after its timeout (30 s here), and until then
routes requests to it. So while a replica holds requests of ours, this process probes it every
`PROBE_PERIOD_S` with an addressed `liveness` call, answered on the replica's event loop:
- no answer within `UNANSWERED_S`: the process is stopped (SIGSTOP), wedged, or its host gone;
- an answer naming a stall: its step loop runs one step far longer than its recent ones (a
  hung collective, a stuck worker; `AsyncEngine.stalled`).
Either way the replica is marked unhealthy, which the router reads (`UNHEALTHY_REPLICA_IDS`)
and routes around while another replica is there; and while another live replica that is not
marked is there, every request of ours on it fails as its engine's failure would
(`FailureKind.DEAD`): the engine client sends it again, resumed from what its client has
(cluster/serve_engine_client.py). With no other replica its requests stay (a slow step is not
worth failing them for; Serve's health check judges a replica that never answers). Probing goes
on; the first healthy answer puts the replica back in routing. A replica that died is not this
module's: its calls fail at once.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import threading
from typing import Any, Callable

from pagedray.engine.output_channel import REPLICA_ID_KWARG

logger = logging.getLogger(__name__)
# The migration reason of a request that left such a replica (`pagedray_request_migrations`).
STALLED_REASON = "stalled"
PROBE_PERIOD_S = 1.0
# Seconds without an answer after which a replica is taken for wedged: well above the probe's
# cost on a busy 2-core machine (milliseconds), well below Serve's health check timeout.
UNANSWERED_S = 3.0

# This process's unhealthy engine replicas, by id: written here, read by the router that Serve
# builds in this process (see cluster/kv_views.py for why a module global); and the live ones,
# as the router last saw them.
UNHEALTHY_REPLICA_IDS: set[str] = set()
LIVE_REPLICA_IDS: frozenset[str] = frozenset()


# This process's generation calls by engine replica, from the router's choice to the end of the
# call (cluster/migration.py's `Placements`): the load the cache-aware router compares. Serve's
# own count of a replica's calls also holds this process's subscriptions to it (output channel,
# KV index), liveness probes and /stats calls, and was measured to keep counting cancelled
# calls for seconds after they ended: fallbacks came and went with them.
_GENERATING: dict[str, int] = {}
_GENERATING_LOCK = threading.Lock()  # the router's thread adds, the event loop removes


def count_generation(replica_id: str, change: int) -> None:
    with _GENERATING_LOCK:
        count = _GENERATING.get(replica_id, 0) + change
        if count > 0:
            _GENERATING[replica_id] = count
        else:
            _GENERATING.pop(replica_id, None)


def generating(replica_id: str) -> int:
    """This process's generation calls on `replica_id` now."""
    return _GENERATING.get(replica_id, 0)


def set_live_replicas(replica_ids: frozenset[str]) -> None:
    """The router's word on which engine replicas are live (called on its thread)."""
    global LIVE_REPLICA_IDS
    LIVE_REPLICA_IDS = replica_ids


Fail = Callable[[str], None]  # fails one request, given why


class ReplicaWatch:
    """The requests of this ingress replica by engine replica, and a probe of each replica
    while it holds any."""

    def __init__(self, engine: Any) -> None:
        """`engine`: a handle to the engine deployment (routed by `EngineRequestRouter`)."""
        self.engine = engine
        self._requests: dict[str, dict[str, Fail]] = {}  # replica id -> request id -> fail
        self._probes: dict[str, asyncio.Task[None]] = {}

    def hold(self, replica_id: str, request_id: str, fail: Fail) -> None:
        """`replica_id` holds `request_id` now; `fail(reason)` fails the request should the
        replica be found unhealthy (it then moves). Called on the event loop."""
        self._requests.setdefault(replica_id, {})[request_id] = fail
        probe = self._probes.get(replica_id)
        if probe is None or probe.done():
            # NOTE: a context of its own: Serve cancels an HTTP request's calls with it.
            probing = self._probe(replica_id)
            probe = asyncio.get_running_loop().create_task(probing, context=contextvars.Context())
            self._probes[replica_id] = probe

    def release(self, replica_id: str, request_id: str) -> None:
        held = self._requests.get(replica_id)
        if held is not None:
            held.pop(request_id, None)
            if not held:
                del self._requests[replica_id]

    async def _probe(self, replica_id: str) -> None:
        """Ask `replica_id` every `PROBE_PERIOD_S` while it holds requests of ours (and while
        it is unhealthy, until it answers well again)."""
        address = {REPLICA_ID_KWARG: replica_id}
        try:
            while replica_id in self._requests or replica_id in UNHEALTHY_REPLICA_IDS:
                call: Any = None
                try:
                    call = self.engine.liveness.remote(**address)
                    stall = await asyncio.wait_for(call, UNANSWERED_S)
                except asyncio.TimeoutError:
                    call.cancel()
                    stall = f"no answer to a probe within {UNANSWERED_S:g}s"
                except Exception as exc:  # noqa: BLE001 - gone, or a call that failed
                    if replica_id not in LIVE_REPLICA_IDS:  # it died: its calls fail on their own
                        UNHEALTHY_REPLICA_IDS.discard(replica_id)
                        return
                    logger.info("engine replica %s: probe failed: %r", replica_id, exc)
                    stall = None  # it answered, if not as asked: no sign of a stall
                if stall is None:
                    self._healthy(replica_id)
                else:
                    self._unhealthy(replica_id, stall)
                await asyncio.sleep(PROBE_PERIOD_S)
        finally:
            if self._probes.get(replica_id) is asyncio.current_task():
                del self._probes[replica_id]

    def _healthy(self, replica_id: str) -> None:
        if replica_id in UNHEALTHY_REPLICA_IDS:
            UNHEALTHY_REPLICA_IDS.discard(replica_id)
            logger.warning("engine replica %s makes progress again: back in routing", replica_id)

    def _unhealthy(self, replica_id: str, stall: str) -> None:
        newly = replica_id not in UNHEALTHY_REPLICA_IDS
        UNHEALTHY_REPLICA_IDS.add(replica_id)
        others = LIVE_REPLICA_IDS - UNHEALTHY_REPLICA_IDS
        held = self._requests.pop(replica_id, {}) if others else self._requests.get(replica_id, {})
        if newly or (others and held):
            logger.warning(
                "engine replica %s makes no progress (%s): out of routing, %d requests %s",
                replica_id,
                stall,
                len(held),
                "move" if others else "stay (no other replica)",
            )
        if not others:
            return
        for request_id, fail in held.items():
            fail(f"engine replica {replica_id} makes no progress ({stall}): {request_id}")
