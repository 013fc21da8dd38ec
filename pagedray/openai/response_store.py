"""A bounded in-memory store of Responses, so `previous_response_id` and `GET /v1/responses/{id}`
find them: bounded by count, by bytes and by age, as a server must not grow without limit.

Ray-free; a server reaches it through a `ResponseStoreClient`: in-process (`LocalResponseStore`),
or a Serve deployment that every ingress replica reaches (cluster/response_store_deployment.py).
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Protocol


@dataclass
class _Entry:
    data: str  # the record as JSON; a get decodes a fresh copy the caller may change
    expires_at: float  # on the store's clock


class ResponseStore:
    """Records `{"response": ..., "conversation": [...]}` by response id.

    A record lives `ttl_s` from its put (a get does not extend it). When a put would exceed
    `max_responses` or `max_bytes`, expired records go first, then the least recently used
    (put or got). Every operation is O(1) plus the cost of encoding its record.
    """

    def __init__(
        self,
        max_responses: int = 10_000,
        max_bytes: int = 256 * 2**20,
        ttl_s: float = 3600.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_responses < 1 or max_bytes < 1 or ttl_s <= 0:
            raise ValueError("ResponseStore: max_responses, max_bytes and ttl_s must be positive")
        self.max_responses = max_responses
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self._clock = clock
        # Two orders over the same entries: use (least recent first) for eviction, and put
        # (oldest first), which is expiry order since every record lives the same ttl_s.
        self._by_use: OrderedDict[str, _Entry] = OrderedDict()
        self._by_put: OrderedDict[str, _Entry] = OrderedDict()
        self._num_bytes = 0
        self._num_evicted = 0
        self._num_expired = 0

    def put(self, response_id: str, record: dict[str, Any]) -> None:
        """Store `record` (JSON-able) under `response_id`, replacing any record there.

        Raises ValueError if the record alone is larger than `max_bytes`.
        """
        data = json.dumps(record)
        if len(data) > self.max_bytes:
            raise ValueError(
                f"response: {len(data)} bytes is more than the store's {self.max_bytes}"
            )
        now = self._clock()
        self._drop_expired(now)
        if response_id in self._by_use:
            self._remove(response_id)
        entry = _Entry(data, now + self.ttl_s)
        self._by_use[response_id] = entry
        self._by_put[response_id] = entry
        self._num_bytes += len(data)
        # The new entry is the most recent and fits alone, so it is never the one evicted.
        while len(self._by_use) > self.max_responses or self._num_bytes > self.max_bytes:
            self._remove(next(iter(self._by_use)))
            self._num_evicted += 1

    def put_if_fits(self, response_id: str, record: dict[str, Any]) -> bool:
        """`put`, or False when the record alone is over `max_bytes` (it is then not kept)."""
        try:
            self.put(response_id, record)
        except ValueError:
            return False
        return True

    def get(self, response_id: str) -> dict[str, Any] | None:
        """The record stored under `response_id`, or None if unknown, evicted or expired."""
        self._drop_expired(self._clock())
        entry = self._by_use.get(response_id)
        if entry is None:
            return None
        self._by_use.move_to_end(response_id)
        record: dict[str, Any] = json.loads(entry.data)
        return record

    def delete(self, response_id: str) -> bool:
        """Remove a record; False if there was none."""
        self._drop_expired(self._clock())
        if response_id not in self._by_use:
            return False
        self._remove(response_id)
        return True

    def ids(self) -> list[str]:
        """The ids held, least recently used (the next to be evicted) first. O(n)."""
        self._drop_expired(self._clock())
        return list(self._by_use)

    def stats(self) -> dict[str, int]:
        """Counts: records and bytes held now, records evicted and expired so far."""
        self._drop_expired(self._clock())
        return {
            "num_responses": len(self._by_use),
            "num_bytes": self._num_bytes,
            "evicted": self._num_evicted,
            "expired": self._num_expired,
        }

    def _drop_expired(self, now: float) -> None:
        while self._by_put:
            response_id, entry = next(iter(self._by_put.items()))
            if entry.expires_at > now:
                return
            self._remove(response_id)
            self._num_expired += 1

    def _remove(self, response_id: str) -> None:
        entry = self._by_use.pop(response_id)
        del self._by_put[response_id]
        self._num_bytes -= len(entry.data)


class ResponseStoreClient(Protocol):
    """How a server reaches its store, wherever it is."""

    async def put(self, response_id: str, record: dict[str, Any]) -> bool:
        """False when the record alone is over the store's byte bound (it is then not kept)."""
        ...

    async def get(self, response_id: str) -> dict[str, Any] | None: ...

    async def delete(self, response_id: str) -> bool: ...


class LocalResponseStore:
    """A `ResponseStore` in this process, as a `ResponseStoreClient`."""

    def __init__(self, store: ResponseStore) -> None:
        self.store = store

    async def put(self, response_id: str, record: dict[str, Any]) -> bool:
        return self.store.put_if_fits(response_id, record)

    async def get(self, response_id: str) -> dict[str, Any] | None:
        return self.store.get(response_id)

    async def delete(self, response_id: str) -> bool:
        return self.store.delete(response_id)
