"""What the prefix cache gained and lost since last asked, as one net delta.

A cache-aware router (issue P8) replays these deltas to know exactly which block hashes an
engine holds: vLLM's KV events (BlockStored, BlockRemoved, AllBlocksCleared), folded so that a
read costs what changed since the last one, not the whole index. A recorder whose removals
outgrow the pool hands out a snapshot instead (never larger than the pool), so it never holds
more than about two pools' worth of hashes, however long it goes unread.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from pagedray.scheduler.prefix_hash import BlockHash


@dataclass(frozen=True)
class KVCacheDelta:
    """Changes to the set of hittable block hashes; `apply` them in the order they were taken."""

    stored: list[BlockHash] = field(default_factory=list)  # became hittable, first stored first
    removed: list[BlockHash] = field(default_factory=list)  # stopped being hittable
    cleared: bool = False  # the set was emptied before `removed` and `stored`
    # The tier below's own delta (below a pool, the node's host KV tier; below that, its disk
    # tier), as this engine's mirror of it saw it change (a tier's blocks are the node's,
    # whichever engine saved them); None: no tier, or none recorded. `apply` leaves it to the
    # caller, who keeps that set apart.
    tier: KVCacheDelta | None = None

    def apply(self, hashes: set[BlockHash]) -> None:
        """Bring a copy of the index (`hashes`) from the previous delta's state to this one's."""
        if self.cleared:
            hashes.clear()
        hashes.difference_update(self.removed)
        hashes.update(self.stored)

    def __bool__(self) -> bool:
        return self.cleared or bool(self.stored) or bool(self.removed) or bool(self.tier)


class KVEventRecorder:
    """Folds the prefix-cache index's changes into one net `KVCacheDelta` between reads."""

    def __init__(self, num_blocks: int) -> None:
        # Insertion-ordered sets: a delta's lists come out in a reproducible order.
        self._stored: dict[BlockHash, None] = {}  # a subset of the index: at most num_blocks
        self._removed: dict[BlockHash, None] = {}
        self._cleared = False
        # Past this many removals a snapshot (at most num_blocks hashes) is the smaller message.
        self._max_removed = num_blocks
        self._overflowed = False

    def stored(self, block_hash: BlockHash) -> None:
        self._removed.pop(block_hash, None)
        self._stored[block_hash] = None

    def removed(self, block_hash: BlockHash) -> None:
        # NOTE: kept even when stored since the last read: it may have been hittable before.
        self._stored.pop(block_hash, None)
        if self._overflowed:
            return
        self._removed[block_hash] = None
        if len(self._removed) > self._max_removed:
            self._overflowed = True  # the next read is a snapshot; stop growing
            self._removed.clear()

    def cleared(self) -> None:
        self._stored.clear()
        self._removed.clear()
        self._cleared = True

    def take(self, index: Iterable[BlockHash]) -> KVCacheDelta:
        """The changes since the last `take`; a snapshot of `index` (the live hashes) if the
        recorder overflowed."""
        if self._overflowed:
            delta = KVCacheDelta(stored=list(index), cleared=True)
        else:
            delta = KVCacheDelta(list(self._stored), list(self._removed), self._cleared)
        self._stored, self._removed = {}, {}
        self._cleared = self._overflowed = False
        return delta
