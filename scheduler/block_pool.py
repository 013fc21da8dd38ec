"""The pool of physical KV blocks: refcounts, an LRU free queue and the prefix-hash index.

Freed blocks keep their hash and stay hittable until the free queue hands them out again, so
the queue doubles as the prefix cache's LRU eviction order. Every queue operation is O(1).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from pagedray.scheduler.kv_events import KVCacheDelta, KVEventRecorder
from pagedray.scheduler.prefix_hash import BlockHash


@dataclass(eq=False)
class KVCacheBlock:
    """One physical block of `block_size` KV slots."""

    block_id: int
    ref_cnt: int = 0  # block tables that hold this block; 0 = in the free queue
    block_hash: BlockHash | None = None  # set only while the block is in the prefix-cache index
    # Free-queue links; both None while the block is not queued (repr=False: they form cycles).
    prev_free: KVCacheBlock | None = field(default=None, repr=False)
    next_free: KVCacheBlock | None = field(default=None, repr=False)


class FreeBlockQueue:
    """Doubly linked list of free blocks, oldest freed at the head.

    Sentinel head and tail nodes mean no operation special-cases an empty list or an end node.
    """

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(block_id=-1)
        self._tail = KVCacheBlock(block_id=-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVCacheBlock:
        """Remove and return the block freed longest ago."""
        first = self._head.next_free
        if first is None or first is self._tail:
            raise ValueError("no free blocks left")
        self.remove(first)
        return first

    def append(self, block: KVCacheBlock) -> None:
        """Queue a block at the tail: it will be evicted last."""
        if block.prev_free is not None or block.next_free is not None:
            raise ValueError(f"block {block.block_id} is already in the free queue")
        last = self._tail.prev_free
        assert last is not None
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free_blocks += 1

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink a block from anywhere in the queue (a cached free block reused by a hit)."""
        prev_block, next_block = block.prev_free, block.next_free
        if prev_block is None or next_block is None:
            raise ValueError(f"block {block.block_id} is not in the free queue")
        prev_block.next_free = next_block
        next_block.prev_free = prev_block
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """The queued blocks from head to tail (O(n); for tests and invariant checks)."""
        blocks: list[KVCacheBlock] = []
        node = self._head.next_free
        while node is not None and node is not self._tail:
            blocks.append(node)
            node = node.next_free
        return blocks


class BlockPool:
    """All physical blocks, who holds them, and which full blocks are hittable by hash."""

    def __init__(
        self, num_blocks: int, enable_caching: bool, record_kv_events: bool = False
    ) -> None:
        """
        Args:
            num_blocks: Physical blocks in the pool.
            enable_caching: Index full blocks by hash (automatic prefix caching).
            record_kv_events: Keep the index's changes for `take_kv_delta`, which a
                cache-aware router reads; off, nothing is kept.
        """
        if num_blocks <= 0:
            raise ValueError(f"num_blocks: must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(block_id=idx) for idx in range(num_blocks)]
        self.free_block_queue = FreeBlockQueue(self.blocks)
        # Invariant: index[h] is b  <=>  b.block_hash == h.
        self.cached_block_hash_to_block: dict[BlockHash, KVCacheBlock] = {}
        self.kv_events = KVEventRecorder(num_blocks) if record_kv_events else None
        # (block id, hash) of cached blocks handed out for other tokens since the last
        # `take_evicted`, their KV still intact; kept only for a lower tier to save them.
        self.evicted: list[tuple[int, BlockHash]] | None = None

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take `num_blocks` blocks from the free queue head, evicting their cached hashes.

        Raises:
            ValueError: fewer than `num_blocks` blocks are free.
        """
        if num_blocks > self.free_block_queue.num_free_blocks:
            raise ValueError(
                f"cannot allocate {num_blocks} blocks: "
                f"only {self.free_block_queue.num_free_blocks} free"
            )
        new_blocks = []
        for _ in range(num_blocks):
            block = self.free_block_queue.popleft()
            assert block.ref_cnt == 0, f"block {block.block_id} in free queue is in use"
            # A block has a hash only while the index holds it (`cache_full_block`).
            if self.evicted is not None and block.block_hash is not None:
                self.evicted.append((block.block_id, block.block_hash))
            self._evict(block)
            block.ref_cnt = 1
            new_blocks.append(block)
        return new_blocks

    def take_evicted(self) -> list[tuple[int, BlockHash]]:
        """The cached blocks evicted since the last call, in eviction order (tracking must be
        on: `evicted` a list)."""
        assert self.evicted is not None, "eviction tracking is off"
        evicted, self.evicted = self.evicted, []
        return evicted

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        """The block holding the full block with this hash, in use or free, if any."""
        return self.cached_block_hash_to_block.get(block_hash)

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Add one reference to each block, pulling free ones (prefix hits) out of the queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each block; blocks reaching 0 join the queue tail in order.

        They keep their hash, so a later request can still hit them until they are evicted.
        """
        for block in ordered_blocks:
            assert block.ref_cnt > 0, f"block {block.block_id} freed more often than taken"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_block_queue.append(block)

    def cache_full_block(self, block: KVCacheBlock, block_hash: BlockHash) -> bool:
        """Make a full block that the step being planned computes hittable under `block_hash`;
        True if this block is now the one indexed under it.

        If another block already holds that hash (two requests computed the same prefix at
        once), the index keeps the first and this block stays unindexed.
        """
        if not self.enable_caching or block.block_hash is not None:
            return False
        if block_hash in self.cached_block_hash_to_block:
            return False
        block.block_hash = block_hash
        self.cached_block_hash_to_block[block_hash] = block
        if self.kv_events is not None:
            self.kv_events.stored(block_hash)
        return True

    def uncache(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop these blocks' hashes from the index: their step failed before writing them."""
        for block in blocks:
            self._evict(block)

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks held by at least one sequence (free cached blocks count as free)."""
        return 1.0 - self.get_num_free_blocks() / self.num_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self.cached_block_hash_to_block)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; refused (False) while any block is in use."""
        if self.get_num_free_blocks() != self.num_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
        self.cached_block_hash_to_block.clear()
        if self.kv_events is not None:
            self.kv_events.cleared()
        return True

    def take_kv_delta(self) -> KVCacheDelta:
        """The index's changes since the last call (recording must be on)."""
        if self.kv_events is None:
            raise RuntimeError("KV deltas are recorded only by BlockPool(record_kv_events=True)")
        return self.kv_events.take(self.cached_block_hash_to_block)

    def _evict(self, block: KVCacheBlock) -> None:
        """Drop a block's hash before it is overwritten with other tokens."""
        if block.block_hash is None:
            return
        if self.cached_block_hash_to_block.get(block.block_hash) is block:
            del self.cached_block_hash_to_block[block.block_hash]
            if self.kv_events is not None:
                self.kv_events.removed(block.block_hash)
        block.block_hash = None
