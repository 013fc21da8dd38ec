"""The engine deployment's request router: power-of-two choices, plus calls addressed to one
replica (an ingress subscribing to that replica's output channel) delivered there.

A Serve handle has no way to call one chosen replica; a request router sees each call's
arguments and can. Serve builds it from the deployment's `request_router_config` in every
process that holds a handle to the engines (the ingress replicas).

NOTE: a routing task's replica goes to the oldest call waiting, as in Serve's own router: the
calls one HTTP request makes (a batch of prompts, a subscription) share Serve's internal request
id, so matching by id cannot tell them apart. An addressed call is only ever given its replica.
"""

from __future__ import annotations

import random
from typing import Any

from ray.serve.request_router import (
    LocalityMixin,
    PendingRequest,
    ReplicaID,
    RequestRouter,
    RunningReplica,
)

from pagedray.engine.output_channel import REPLICA_ID_KWARG


class EngineRequestRouter(LocalityMixin, RequestRouter):
    """Two random replicas (same node first), the less loaded taken; a call with
    `replica_id=...` goes to that replica, or, if it is gone, to any (which then refuses it,
    so that it fails at once instead of waiting)."""

    _live_replica_ids: frozenset[str] = frozenset()

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        self._live_replica_ids = frozenset(r.replica_id.unique_id for r in replicas)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        # NOTE: Serve drops a replica whose call failed with ActorDiedError here, well before
        # its controller's update: the calls addressed to it must then go elsewhere at once.
        super().on_replica_actor_died(replica_id)
        self._live_replica_ids = self._live_replica_ids - {replica_id.unique_id}

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        target = addressed_replica(pending_request)
        if target is not None:
            addressed = [r for r in candidate_replicas if r.replica_id.unique_id == target]
            if pending_request is not None and not addressed:
                pending_request.routing_context.should_backoff = True  # never a busy loop
            return [addressed or candidate_replicas[:1]]
        by_id = {replica.replica_id: replica for replica in candidate_replicas}
        local = [by_id[i] for i in self.apply_locality_routing(pending_request) if i in by_id]
        pool = local or candidate_replicas
        # The base class probes the queue length of both and sends to the shorter.
        return [random.sample(pool, k=min(2, len(pool)))] if pool else []

    def _fulfill_next_pending_request(
        self, replica: RunningReplica, request_metadata: Any = None
    ) -> None:
        """Give `replica` to the oldest waiting call that may have it (see the NOTE above).

        Overrides a private hook of Serve's `RequestRouter` (as its FIFO mixin does), using
        the same private bookkeeping; pinned Ray version.
        """
        unique_id = replica.replica_id.unique_id
        for position, pending in enumerate(self._pending_requests_to_fulfill):
            if pending.future.done():
                continue
            target = addressed_replica(pending)
            if target not in (None, unique_id) and target in self._live_replica_ids:
                continue  # addressed to another replica, which is there to take it
            del self._pending_requests_to_fulfill[position]  # by position: no __eq__ scan
            self._cancel_routing_task_for_pending_request(pending)
            self._record_queue_wait_time(pending)
            pending.future.set_result(replica)
            self._remove_pending_request_from_indices(pending)
            return


def addressed_replica(pending_request: PendingRequest | None) -> str | None:
    kwargs: dict[str, Any] = pending_request.kwargs if pending_request is not None else {}
    return kwargs.get(REPLICA_ID_KWARG)
