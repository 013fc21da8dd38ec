"""An engine's prefix-cache index as its routers see it: a snapshot, then each step's changes.

The engine core hands each step's `KVCacheDelta` over on the stepping thread; this keeps a mirror
of the hittable hashes on the event loop, so a new subscriber's snapshot and the deltas after it
line up exactly, without reading the live index while a step changes it. Hashes are cut to
`ROUTING_HASH_BYTES`: a router only ranks replicas, and a collision costs one prefill.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import AsyncIterator, Callable

from pagedray.scheduler.kv_events import KVCacheDelta

ROUTING_HASH_BYTES = 8
# Deltas a subscriber may fall behind by before it is sent one snapshot in their place.
MAX_QUEUED_DELTAS = 64
# Seconds without a change after which a subscription ends, so that it holds no Serve call open
# (a replica being drained or replaced waits for its calls); the router's view stays right, as
# nothing changed, and it subscribes again when traffic comes back.
IDLE_END_S = 5.0


def routing_hash(block_hash: bytes) -> bytes:
    return block_hash[:ROUTING_HASH_BYTES]


class KVIndexPublisher:
    """The mirror of one engine's hittable block hashes, and the queues of its subscribers."""

    def __init__(self) -> None:
        self.hashes: set[bytes] = set()  # routing hashes, as of the last delta published
        self.tier_hashes: set[bytes] = set()  # the node's host tier's, as this engine saw them
        self.disk_hashes: set[bytes] = set()  # and its disk tier's
        self._subscribers: set[asyncio.Queue[KVCacheDelta]] = set()

    def listener(self, loop: asyncio.AbstractEventLoop) -> Callable[[KVCacheDelta], None]:
        """The engine core's `kv_delta_listener`: hands each delta to `loop`, in step order."""

        def hand_over(delta: KVCacheDelta) -> None:
            # A closed loop (the replica is shutting down) has no one to read it.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(self.publish, delta)

        return hand_over

    def publish(self, delta: KVCacheDelta) -> None:
        """Apply `delta` to the mirror and pass it on to every subscriber (on the loop)."""
        cut = _cut(delta)
        cut.apply(self.hashes)
        if cut.tier is not None:
            cut.tier.apply(self.tier_hashes)
            if cut.tier.tier is not None:
                cut.tier.tier.apply(self.disk_hashes)
        for queue in self._subscribers:
            if queue.qsize() >= MAX_QUEUED_DELTAS:  # a slow reader: one snapshot replaces all
                while not queue.empty():
                    queue.get_nowait()
                queue.put_nowait(self.snapshot())
            else:
                queue.put_nowait(cut)

    def snapshot(self) -> KVCacheDelta:
        disk = KVCacheDelta(stored=list(self.disk_hashes), cleared=True)
        tier = KVCacheDelta(stored=list(self.tier_hashes), cleared=True, tier=disk)
        return KVCacheDelta(stored=list(self.hashes), cleared=True, tier=tier)

    async def subscribe(self, idle_end_s: float = IDLE_END_S) -> AsyncIterator[KVCacheDelta]:
        """A snapshot (`cleared`, every hash stored), then every delta, until closed or idle
        for `idle_end_s`."""
        queue: asyncio.Queue[KVCacheDelta] = asyncio.Queue()
        self._subscribers.add(queue)
        try:
            yield self.snapshot()
            while True:
                try:
                    delta = await asyncio.wait_for(queue.get(), idle_end_s)
                except asyncio.TimeoutError:
                    return
                yield delta
        finally:
            self._subscribers.discard(queue)

    @property
    def num_subscribers(self) -> int:
        return len(self._subscribers)


def _cut(delta: KVCacheDelta) -> KVCacheDelta:
    """`delta` (and its tier's) in routing hashes."""
    return KVCacheDelta(
        [routing_hash(h) for h in delta.stored],
        [routing_hash(h) for h in delta.removed],
        delta.cleared,
        _cut(delta.tier) if delta.tier is not None else None,
    )


PackedDelta = tuple[bytes, bytes, bool, "PackedDelta | None"]


def pack_delta(delta: KVCacheDelta) -> PackedDelta:
    """A delta of routing hashes as two byte strings (and its tier's likewise): a snapshot of
    a large pool pickles in microseconds this way, against ~0.1 s as a list of 100k small bytes
    objects."""
    tier = pack_delta(delta.tier) if delta.tier is not None else None
    return b"".join(delta.stored), b"".join(delta.removed), delta.cleared, tier


def unpack_delta(packed: PackedDelta) -> KVCacheDelta:
    # NOTE: an engine of the version before tiers sends three fields (during a rolling upgrade).
    stored, removed, cleared, *rest = packed
    tier = rest[0] if rest else None
    size = ROUTING_HASH_BYTES
    return KVCacheDelta(
        [stored[i : i + size] for i in range(0, len(stored), size)],
        [removed[i : i + size] for i in range(0, len(removed), size)],
        cleared,
        unpack_delta(tier) if tier is not None else None,
    )
