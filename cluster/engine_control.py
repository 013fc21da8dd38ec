"""The Serve engine client's control calls to the engine replicas: readiness, health, stats and
limits (cluster/serve_engine_client.py).

Each is a broadcast to every replica. What a failed replica said (an actor death, a timeout) is
logged under a request id and replaced by an opaque "engine unavailable (request ...)": clients
see that something is down, not the cluster's internals.

Readiness is one fact for every route that needs the engine: until Serve reports the engine
deployment HEALTHY (all its target replicas running) and every replica answers its health
check, /health, /v1/models and the generation routes answer 503. Benchmark clients (guidellm,
aiperf) probe /v1/models once and then send load, so a 200 there must mean the engine serves.
Once ready, it stays ready: a later failure shows per request and on /health.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from ray import serve

from pagedray.engine.config import EngineConfig
from pagedray.engine.engine_client import Health
from pagedray.engine.request_errors import RETRY_AFTER_S
from pagedray.scheduler.request_failure import FailureKind, RequestFailure

logger = logging.getLogger(__name__)
# Seconds the ingress waits for every engine replica to answer a health or stats call.
CONTROL_TIMEOUT_S = 10.0


class EngineControl:
    """Broadcasts to the engine deployment behind a DeploymentHandle (`engine`)."""

    def __init__(self, engine: Any, max_model_len: int) -> None:
        """`max_model_len` is what the config implies, until the replicas report theirs."""
        self.engine = engine
        self.max_model_len = max_model_len
        # The most requests one replica queues: a batch of more prompts is never admitted.
        self.max_num_waiting: int | None = None
        self._limits_known = False
        self._lock = asyncio.Lock()
        self.ready = False
        self._ready_lock = asyncio.Lock()

    async def broadcast(
        self, method: str, request_id: str
    ) -> list[dict[str, Any]] | RequestFailure:
        """Every replica's answer to `method`, a failed one as an unhealthy entry; the engine
        unavailable if no replica could be asked."""
        try:
            response = self.engine.broadcast(method)
            results = await response.results_async(
                timeout_s=CONTROL_TIMEOUT_S, return_exceptions=True
            )
        except Exception as exc:  # noqa: BLE001 - no replica is up
            logger.warning("%s: engine %s broadcast failed: %r", request_id, method, exc)
            return unavailable(request_id)
        answers = []
        for result in results:
            if isinstance(result, dict):
                answers.append(result)
                continue
            logger.warning("%s: engine replica failed %s: %r", request_id, method, result)
            error = f"engine unavailable (request {request_id})"
            answers.append({"healthy": False, "error": error})
        return answers

    async def not_ready(self, request_id: str) -> RequestFailure | None:
        """None once every engine replica can serve; until then, the engine unavailable."""
        if self.ready:
            return None
        health = await self.health(request_id)
        return health if isinstance(health, RequestFailure) else None

    async def health(self, request_id: str) -> Health | RequestFailure:
        """200 `ok`, 200 `degraded` (a replica is saturated but steps), or 503 if a replica
        cannot step or the engine is not ready yet; nothing else (no replica ids, no step
        counts, no errors)."""
        if not self.ready:
            return await self._become_ready(request_id)
        return await self._replica_health(request_id)

    async def _become_ready(self, request_id: str) -> Health | RequestFailure:
        # One check at a time: requests arriving meanwhile wait for its answer.
        async with self._ready_lock:
            if self.ready:
                return await self._replica_health(request_id)
            state = await self._deployment_state()
            if state != "HEALTHY":
                logger.debug("%s: engine not ready: deployment %s", request_id, state)
                return unavailable(request_id)
            health = await self._replica_health(request_id)
            if not isinstance(health, RequestFailure):
                logger.info("engine ready: every replica of %s serves", self._deployment_name)
                self.ready = True
            return health

    @property
    def _deployment_name(self) -> str:
        return f"{self.engine.app_name}/{self.engine.deployment_name}"

    async def _deployment_state(self) -> str:
        """Serve's status of the engine deployment: HEALTHY once its target replicas run."""
        try:
            # NOTE: a blocking call to Serve's controller, so in a thread; made only until ready.
            status = await asyncio.to_thread(serve.status)
            app = status.applications[self.engine.app_name]
            state = app.deployments[self.engine.deployment_name].status
            return str(getattr(state, "value", state))
        except Exception as exc:  # noqa: BLE001 - not ready is the answer, the cause is logged
            logger.warning("engine deployment status unknown: %r", exc)
            return "UNKNOWN"

    async def _replica_health(self, request_id: str) -> Health | RequestFailure:
        replicas = await self.broadcast("health", request_id)
        if isinstance(replicas, RequestFailure):
            return replicas
        unhealthy = [r for r in replicas if not r.get("healthy")]
        if unhealthy or not replicas:
            logger.warning("%s: engine unhealthy: %s", request_id, unhealthy or "no replicas")
            return unavailable(request_id)
        return "degraded" if any(r.get("degraded", False) for r in replicas) else "ok"

    async def learn_limits(self) -> None:
        """Once: the engine's real `max_model_len` (the KV pool may cap it below the model's)
        and `max_num_waiting`, each the min over replicas. Until a replica answers, the
        config's `max_model_len` stands and the queue is taken as unbounded."""
        if self._limits_known:
            return
        async with self._lock:
            if self._limits_known:
                return
            replicas = await self.broadcast("stats", "engine-limits")
            if isinstance(replicas, RequestFailure):
                return
            answered = [r for r in replicas if "num_kv_blocks" in r]  # stats, not failures
            limits = [r["max_model_len"] for r in answered if _is_int(r.get("max_model_len"))]
            if limits:
                self.max_model_len = min(self.max_model_len, *limits)
            queues = [r["max_num_waiting"] for r in answered if _is_int(r.get("max_num_waiting"))]
            if queues:
                self.max_num_waiting = min(queues)
            # An engine that does not report a limit keeps the default: ask no more.
            self._limits_known = bool(answered)


def unavailable(request_id: str) -> RequestFailure:
    """What a client is told when the engines cannot be reached or cannot step: no detail but
    the request id (the cause is logged under it)."""
    message = f"engine unavailable (request {request_id})"
    return RequestFailure(FailureKind.DEAD, message, retry_after_s=RETRY_AFTER_S)


def config_max_model_len(config: EngineConfig) -> int:
    """The limit the config implies: the model's, capped by an explicit KV pool's capacity."""
    limit = config.resolved_max_model_len()
    if config.num_kv_blocks is not None:
        limit = min(limit, config.num_kv_blocks * config.block_size)
    return limit


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
