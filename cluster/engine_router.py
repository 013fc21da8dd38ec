"""The engine deployment's request router: Serve's power-of-two choices, plus calls addressed to
one replica (an ingress subscribing to that replica's output channel) delivered there.

A Serve handle has no way to call one chosen replica; a request router sees each call's
arguments and can. Serve builds it from the deployment's `request_router_config` in every
process that holds a handle to the engines (the ingress replicas).
"""

from __future__ import annotations

from typing import Any

# NOTE: Serve's default router, which Ray's own LLM routers extend too; not exported publicly.
from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter
from ray.serve.request_router import PendingRequest, RunningReplica

# The keyword argument that addresses a call to one engine replica (its unique id).
REPLICA_ID_KWARG = "replica_id"


class EngineRequestRouter(PowerOfTwoChoicesRequestRouter):
    """Power-of-two choices, except for a call with `replica_id=...`: that replica, or, if it is
    gone, any (which then refuses the call, so that it fails at once instead of waiting)."""

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        target = addressed_replica(pending_request)
        if target is None:
            return await super().choose_replicas(candidate_replicas, pending_request)
        addressed = [r for r in candidate_replicas if r.replica_id.unique_id == target]
        return [addressed or candidate_replicas[:1]]


def addressed_replica(pending_request: PendingRequest | None) -> str | None:
    kwargs: dict[str, Any] = pending_request.kwargs if pending_request is not None else {}
    return kwargs.get(REPLICA_ID_KWARG)
