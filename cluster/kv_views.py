"""This process's copies of every engine replica's prefix-cache index, for cache-aware routing.

Each engine replica publishes a snapshot of its hittable block hashes and then each step's
changes (`subscribe_kv`, pagedray/engine/kv_index_publisher.py); an ingress replica follows every
live replica's stream, and `EngineRequestRouter` (which Serve builds in this process, out of the
ingress's reach, hence one `KV_VIEWS` per process) ranks replicas by how many of a request's
leading blocks they hold. A view may lag by a step or miss a dead stream's changes until its
resubscription's snapshot: a wrong guess costs one prefill, never a wrong answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import pickle
from typing import Any

from pagedray.engine.kv_index_publisher import routing_hash, unpack_delta
from pagedray.engine.output_channel import REPLICA_ID_KWARG
from pagedray.scheduler.kv_events import KVCacheDelta
from pagedray.scheduler.prefix_hash import compute_block_hashes

logger = logging.getLogger(__name__)
# Seconds between attempts to follow a live replica again after its stream broke.
RESUBSCRIBE_AFTER_S = 1.0


class KVViews:
    """Per engine replica, the routing hashes it holds; kept while its replica is live."""

    def __init__(self) -> None:
        self.by_replica: dict[str, set[bytes]] = {}
        # What each replica's node's host KV tier holds, as that replica last published it.
        self.tier_by_replica: dict[str, set[bytes]] = {}
        self.disk_by_replica: dict[str, set[bytes]] = {}  # and its disk tier
        self.live_replica_ids: frozenset[str] = frozenset()  # the router's, as it last saw
        self._engine: Any = None
        self._block_size = 0
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None  # the ingress's, where views follow

    def attach(self, engine: Any, block_size: int) -> None:
        """Follow the replicas of `engine` (a handle routed by `EngineRequestRouter`)."""
        self._engine, self._block_size = engine, block_size

    def close(self) -> None:
        """Stop following (this ingress replica stops): an engine counts each stream as a call
        in flight, and could not stop beside it until the stream went idle."""
        self._engine, self.live_replica_ids = None, frozenset()
        tasks, self._tasks = self._tasks, {}
        for task in tasks.values():
            task.cancel()  # its stream is cancelled as the task unwinds

    @property
    def attached(self) -> bool:
        return self._engine is not None

    def routing_hashes(
        self, token_ids: list[int], cache_salt: str | None, lora_key: str | None
    ) -> list[bytes]:
        """The request's full blocks, hashed as the engines hash them, cut as they publish."""
        hashes = compute_block_hashes(token_ids, self._block_size, cache_salt, [], lora_key)
        return [routing_hash(block_hash) for block_hash in hashes]

    def set_live_replicas(self, replica_ids: frozenset[str]) -> None:
        """The router's news (on whatever thread Serve runs it): the views follow at once, not
        at the next request, so that a new replica's cache is known before requests need it."""
        self.live_replica_ids = replica_ids
        if self._loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop closed: the replica is stopping
                self._loop.call_soon_threadsafe(self.follow_live_replicas)

    def follow_live_replicas(self) -> None:
        """Start following new replicas and forget gone ones (on the ingress's event loop, which
        it remembers for the router's later news)."""
        if self._engine is None:
            return
        loop = self._loop = asyncio.get_running_loop()
        live = self.live_replica_ids
        for replica_id in list(self._tasks):
            if replica_id not in live:
                self._tasks.pop(replica_id).cancel()
                self.by_replica.pop(replica_id, None)
                self.tier_by_replica.pop(replica_id, None)
                self.disk_by_replica.pop(replica_id, None)
        for replica_id in live:
            task = self._tasks.get(replica_id)
            if task is None or task.done():
                # NOTE: a context of its own: Serve would cancel it with the HTTP request.
                following = self._follow(replica_id)
                self._tasks[replica_id] = loop.create_task(following, context=contextvars.Context())

    def matched_blocks(self, replica_id: str, hashes: list[bytes]) -> int:
        """How many of `hashes`' leading blocks `replica_id` holds."""
        return _leading_run(self.by_replica.get(replica_id), hashes)

    def tier_blocks(self, replica_id: str, hashes: list[bytes], start: int) -> int:
        """How many of `hashes` from `start` on (past the pool's match) `replica_id`'s node
        holds in its host tier: blocks the replica would load rather than compute."""
        return _leading_run(self.tier_by_replica.get(replica_id), hashes[start:])

    def disk_blocks(self, replica_id: str, hashes: list[bytes], start: int) -> int:
        """Likewise in its node's disk tier, from `start` on (past the pool's and host tier's)."""
        return _leading_run(self.disk_by_replica.get(replica_id), hashes[start:])

    async def _follow(self, replica_id: str) -> None:
        """Keep `replica_id`'s view until its stream ends: idle (the engine ends it; the view
        stays right, nothing changed, and the next request follows again) or broken (the view
        is dropped, and followed again after a pause while the replica is live)."""
        while replica_id in self.live_replica_ids:
            view: set[bytes] = set()
            tier_view: set[bytes] = set()
            disk_view: set[bytes] = set()
            stream = None
            try:
                streaming = self._engine.options(stream=True)
                stream = streaming.subscribe_kv.remote(**{REPLICA_ID_KWARG: replica_id})
                async for pickled in stream:
                    delta = unpack_delta(pickle.loads(pickled))
                    view = self.by_replica[replica_id] = _applied(delta, view)
                    if delta.tier is not None:
                        tier_view = _applied(delta.tier, tier_view)
                        self.tier_by_replica[replica_id] = tier_view
                        if delta.tier.tier is not None:
                            disk_view = _applied(delta.tier.tier, disk_view)
                            self.disk_by_replica[replica_id] = disk_view
                return
            except asyncio.CancelledError:
                if stream is not None:
                    stream.cancel()
                raise
            except Exception as exc:  # noqa: BLE001 - the replica died or restarted
                if stream is not None:
                    stream.cancel()
                logger.info("KV view of engine replica %s broke: %r", replica_id, exc)
            self.by_replica.pop(replica_id, None)
            self.tier_by_replica.pop(replica_id, None)
            self.disk_by_replica.pop(replica_id, None)
            await asyncio.sleep(RESUBSCRIBE_AFTER_S)


def _applied(delta: KVCacheDelta, view: set[bytes]) -> set[bytes]:
    """`view` brought up to `delta`; a snapshot makes a new set, so that the router never
    reads one half rebuilt."""
    if delta.cleared:
        view = set()
    delta.apply(view)
    return view


def _leading_run(held: set[bytes] | None, hashes: list[bytes]) -> int:
    """How many of `hashes`, from the first, `held` has without a gap."""
    if not held:
        return 0
    matched = 0
    for block_hash in hashes:
        if block_hash not in held:
            break
        matched += 1
    return matched


KV_VIEWS = KVViews()
