"""The Responses API's store as a Serve deployment: one replica that every ingress replica
reaches, so a conversation continues (`previous_response_id`) whichever ingress and engine
replicas serve its turns. Ray Serve LLM keeps the store per engine replica, where a follow-up
routed elsewhere finds nothing (ray#65773).

It is memory only: bounded by count, bytes and age (`ResponseStore`), and lost if its replica
restarts, as any in-memory cache would be; a client then gets a 404 for the old id.
"""

from __future__ import annotations

from typing import Any

from ray import serve
from ray.serve.handle import DeploymentHandle

from pagedray.cluster.server_config import DEFAULT_MAX_RESPONSES, DEFAULT_RESPONSES_TTL_S
from pagedray.openai.response_store import ResponseStore

DEFAULT_MAX_BYTES = 256 * 2**20


@serve.deployment(
    name="ResponseStore",
    num_replicas=1,
    ray_actor_options={"num_cpus": 0},
    max_ongoing_requests=1000,
    # Serve waits this long before it first looks whether a stopping replica's calls are done
    # (2 s by default): this one's take microseconds, and an app's deletion waited for it.
    graceful_shutdown_wait_loop_s=0.5,
)
class ResponseStoreDeployment:
    """Put, get and delete stored Responses by id (calls through a DeploymentHandle)."""

    def __init__(
        self,
        max_responses: int = DEFAULT_MAX_RESPONSES,
        ttl_s: float = DEFAULT_RESPONSES_TTL_S,
        max_bytes: int = DEFAULT_MAX_BYTES,
    ) -> None:
        self.store = ResponseStore(max_responses=max_responses, max_bytes=max_bytes, ttl_s=ttl_s)

    def put(self, response_id: str, record: dict[str, Any]) -> bool:
        """False when the record alone is over the byte bound (it is then not kept)."""
        return self.store.put_if_fits(response_id, record)

    def get(self, response_id: str) -> dict[str, Any] | None:
        return self.store.get(response_id)

    def delete(self, response_id: str) -> bool:
        return self.store.delete(response_id)

    def stats(self) -> dict[str, int]:
        return self.store.stats()


class ServeResponseStore:
    """The store deployment behind `handle`, as a `ResponseStoreClient`."""

    def __init__(self, handle: DeploymentHandle) -> None:
        self.handle = handle

    async def put(self, response_id: str, record: dict[str, Any]) -> bool:
        return bool(await self.handle.put.remote(response_id, record))

    async def get(self, response_id: str) -> dict[str, Any] | None:
        record: dict[str, Any] | None = await self.handle.get.remote(response_id)
        return record

    async def delete(self, response_id: str) -> bool:
        return bool(await self.handle.delete.remote(response_id))
