"""Each live sequence's block table over the shared `BlockPool`: prefix hits, growth, CoW, forks.

The scheduler asks this class for blocks and never touches refcounts itself, so every rule that
keeps KV memory consistent (refcounts, copy-on-write, prefix-cache indexing) lives here.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from pagedray.scheduler.block_pool import BlockPool, KVCacheBlock
from pagedray.scheduler.host_kv_tier import HostKVTier
from pagedray.scheduler.kv_events import KVCacheDelta
from pagedray.scheduler.messages import TIER_COPIES
from pagedray.scheduler.prefix_hash import BlockHash, compute_block_hashes
from pagedray.scheduler.request import Request

# Where a prompt's tokens come from (vLLM's `source` label): computed here, found in the pool,
# loaded from a tier below it.
PROMPT_TOKEN_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")


@dataclass
class Allocation:
    """What `allocate_slots` changed in one sequence's block table, for the workers' diff."""

    # Block ids added at the end of the table: prefix-hit blocks first (first admission), then
    # fresh ones. Old table (after CoW replacements) + new_block_ids == new table.
    new_block_ids: list[int]
    # Copy-on-write (src block id, dst block id): dst replaced src in this table; the workers
    # must copy src's slots into dst before the forward pass.
    copies: list[tuple[int, int]]
    replaced: bool  # some existing table entry changed (a CoW), not only appends
    # Prefix hits found in the host tier, (tier slot, block id): the workers load them into the
    # first fresh blocks before the forward pass; then those found in the disk tier.
    loads: list[tuple[int, int]] = field(default_factory=list)
    disk_loads: list[tuple[int, int]] = field(default_factory=list)


@dataclass
class TierHits:
    """A request's leading blocks found below the pool, past its pool hits, in prefix order:
    the host tier's slots, then the disk tier's (leased for their load)."""

    host: list[int] = field(default_factory=list)
    disk: list[int] = field(default_factory=list)

    @property
    def num_blocks(self) -> int:
        return len(self.host) + len(self.disk)


class KVCacheManager:
    """Block tables of all live sequences, with automatic prefix caching and copy-on-write."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        record_kv_events: bool = False,
        host_tier: HostKVTier | None = None,
    ) -> None:
        """`host_tier`: the node's tier that evicted blocks go to and prefix misses are looked
        up in (with prefix caching on); None: an evicted block is gone."""
        if block_size <= 0:
            raise ValueError(f"block_size: must be positive, got {block_size}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching, record_kv_events)
        self.host_tier = host_tier if enable_caching else None
        if self.host_tier is not None:
            self.block_pool.evicted = []
            if record_kv_events:  # routers score the tier's blocks too
                self.host_tier.record_events()
        self.saving: list[int] = []  # tier slots the step being run writes, published after it
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}  # the block tables
        self.req_to_block_hashes: dict[str, list[BlockHash]] = {}  # hashes of full blocks
        # Leading table blocks already offered to the index, so each step only looks at new ones.
        self.num_cached_blocks: dict[str, int] = {}
        self.prefix_cache_queries = 0  # tokens looked up, at each request's first admission
        self.prefix_cache_hits = 0  # tokens found
        # A preempted request's readmission finds its own freed blocks: counted apart (as vLLM
        # does), or the hit rate would rise with preemption instead of with shared prefixes.
        self.preempted_prefix_cache_queries = 0
        self.preempted_prefix_cache_hits = 0
        # vLLM's names for tokens looked up in, and found in, a tier below the pool.
        self.external_prefix_cache_queries = 0
        self.external_prefix_cache_hits = 0
        self.host_tier_loaded_blocks = 0  # a lookup leases; only an admitted one loads
        self.disk_tier_loaded_blocks = 0
        # vLLM's `prompt_tokens_by_source`: each request's prompt at its first admission, split
        # into tokens computed, found in the pool, and loaded from a tier.
        self.prompt_tokens_by_source = dict.fromkeys(PROMPT_TOKEN_SOURCES, 0)
        self.tier_copy_seconds = dict.fromkeys(TIER_COPIES, 0.0)  # rank 0's, summed

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    @property
    def usage(self) -> float:
        return self.block_pool.usage

    def stats(self) -> dict[str, float]:
        """Pool occupancy and prefix-cache counters (tokens), under the scheduler's stat names."""
        stats = {
            "num_kv_blocks": self.num_blocks,
            "num_free_blocks": self.num_free_blocks,
            "kv_usage": self.usage,
            "prefix_cache_queries": self.prefix_cache_queries,
            "prefix_cache_hits": self.prefix_cache_hits,
            "preempted_prefix_cache_queries": self.preempted_prefix_cache_queries,
            "preempted_prefix_cache_hits": self.preempted_prefix_cache_hits,
            "external_prefix_cache_queries": self.external_prefix_cache_queries,
            "external_prefix_cache_hits": self.external_prefix_cache_hits,
            **{f"prompt_tokens_{k}": n for k, n in self.prompt_tokens_by_source.items()},
        }
        if self.host_tier is not None:
            stats |= self.host_tier.stats()
            stats["host_tier_loaded_blocks"] = self.host_tier_loaded_blocks
            if self.host_tier.lower is not None:
                stats["disk_tier_loaded_blocks"] = self.disk_tier_loaded_blocks
            stats |= {f"{copy}_seconds": s for copy, s in self.tier_copy_seconds.items()}
        return stats

    def _count_prompt_sources(self, num_prompt: int, pool_hit: int, tier_hit: int) -> None:
        """Split a prompt by where its tokens came from; hits past the prompt (a resumed
        request's output) are not its."""
        local = min(pool_hit, num_prompt)
        external = min(pool_hit + tier_hit, num_prompt) - local
        counts = self.prompt_tokens_by_source
        counts["local_cache_hit"] += local
        counts["external_kv_transfer"] += external
        counts["local_compute"] += num_prompt - local - external

    def get_block_ids(self, req_id: str) -> list[int]:
        return [block.block_id for block in self.req_to_blocks.get(req_id, [])]

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()

    def get_computed_blocks(self, req: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest run of leading full blocks of `req` already in the prefix cache.

        Capped so at least one token is left to compute: the model must run on the last token to
        produce logits. Refcounts and stats are untouched; pass the blocks to `allocate_slots`,
        which counts the lookup once the request is admitted (a request that waits for blocks
        is looked up again each step and must not be counted again).

        A request that asks for prompt logprobs gets no hit (its blocks are still cached for
        others once planned).

        Returns:
            (the cached blocks in table order, the number of tokens they hold).
        """
        if not self.enable_caching or req.sampling_params.prompt_logprobs is not None:
            # NOTE: prompt logprobs need every prompt position's logits, which a hit skips.
            return [], 0
        block_hashes = self._update_block_hashes(req)
        max_hit_blocks = max(0, (req.num_tokens - 1) // self.block_size)
        computed_blocks: list[KVCacheBlock] = []
        for block_hash in block_hashes[:max_hit_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            computed_blocks.append(block)
        return computed_blocks, len(computed_blocks) * self.block_size

    def get_tier_hits(self, req: Request, num_device_blocks: int) -> TierHits:
        """The tiers' slots holding the full blocks that follow `req`'s `num_device_blocks` pool
        hits, leased for their load; capped as `get_computed_blocks` is. Pass them to
        `allocate_slots`."""
        if self.host_tier is None or req.sampling_params.prompt_logprobs is not None:
            return TierHits()
        block_hashes = self._update_block_hashes(req)
        max_hit_blocks = max(0, (req.num_tokens - 1) // self.block_size)
        wanted = block_hashes[num_device_blocks:max_hit_blocks]
        hits = TierHits(host=self.host_tier.lookup(wanted))
        disk = self.host_tier.lower
        if disk is not None and len(hits.host) < len(wanted):
            hits.disk = disk.lookup(wanted[len(hits.host) :])
        return hits

    def take_saves(
        self, computed: Sequence[KVCacheBlock]
    ) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """Tier slots for the blocks the step being planned must save, published by `step_done`:
        (block id, slot) of the cached blocks evicted while planning it that the tier lacks
        (saved before anything overwrites them), and of the full blocks it computes, `computed`
        (saved once computed). A block the tier holds already is not saved again.

        A hash both evicted and computed in this plan (evicted, then missed by a request admitted
        after, which computes it again) is saved from the evicted block, intact before the
        forward pass, never from the new one before it is computed."""
        if self.host_tier is None:
            return [], []
        # hash -> (block id, whether it is saved before the forward pass); evicted ones first.
        sources: dict[BlockHash, tuple[int, bool]] = {}
        for block_id, block_hash in self.block_pool.take_evicted():
            sources.setdefault(block_hash, (block_id, True))
        for block in computed:
            if block.block_hash is not None:
                sources.setdefault(block.block_hash, (block.block_id, False))
        if not sources:
            return [], []
        reserved = self.host_tier.reserve(list(sources))
        self.saving += [slot for _, slot in reserved]
        before: list[tuple[int, int]] = []
        after: list[tuple[int, int]] = []
        for block_hash, slot in reserved:
            block_id, is_evicted = sources[block_hash]
            (before if is_evicted else after).append((block_id, slot))
        return before, after

    def take_kv_delta(self) -> KVCacheDelta:
        """The prefix cache's changes since last asked (KV events on), with the node's host
        tier's as `tier`."""
        delta = self.block_pool.take_kv_delta()
        if self.host_tier is None or self.host_tier.events is None:
            return delta
        return dataclasses.replace(delta, tier=self.host_tier.take_events())

    def cached_blocks_by_recency(self) -> list[tuple[int, BlockHash]]:
        """(block id, hash) of the pool's cached free blocks, the most recently used first
        (the free queue holds the oldest freed at its head; idle, it holds every block)."""
        free = self.block_pool.free_block_queue.get_all_free_blocks()
        return [(b.block_id, b.block_hash) for b in reversed(free) if b.block_hash is not None]

    def offer_for_saving(self, blocks: Sequence[tuple[int, BlockHash]]) -> None:
        """Hand these cached blocks to the next plan's saves as if evicted (the tier skips
        those it has): the engine is going away, and what its pool held stays on the node; or
        another engine pulls them (scheduler/kv_transfer.py)."""
        assert self.block_pool.evicted is not None, "no host tier"
        self.block_pool.evicted.extend(blocks)

    def step_done(self, ran: bool, tier_copy_seconds: dict[str, float] | None = None) -> None:
        """The step planned last has run (`ran`), its copies taking `tier_copy_seconds` on rank
        0, or failed: publish or free its tier writes."""
        for copy, seconds in (tier_copy_seconds or {}).items():
            self.tier_copy_seconds[copy] += seconds
        if self.host_tier is None or not self.saving:
            return
        if ran:
            self.host_tier.publish(self.saving)
        else:
            self.host_tier.release(self.saving)
        self.saving = []

    def allocate_slots(
        self,
        req: Request,
        num_new_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock] = (),
        tier_hits: TierHits | None = None,
    ) -> Allocation | None:
        """Grow `req`'s table to hold its computed tokens, the prefix hit and `num_new_tokens`.

        Before a sequence writes into a block that other tables share (the partial tail after a
        fork), it gets a private copy: copy-on-write.

        Args:
            req: The sequence; `req.num_computed_tokens` excludes `new_computed_blocks`.
            num_new_tokens: Tokens to be computed (written into KV slots) this step.
            new_computed_blocks: Prefix-hit blocks from `get_computed_blocks`, first admission only.
            tier_hits: The tiers' hits that follow them (`get_tier_hits`): as many fresh blocks
                are loaded from the tiers and count as computed.

        Returns:
            The table's changes, or None (and nothing changed) if too few blocks are free.
        """
        table = self.req_to_blocks.get(req.req_id, [])
        tier_hits = tier_hits or TierHits()
        num_hit_blocks = len(new_computed_blocks) + tier_hits.num_blocks
        num_computed = req.num_computed_tokens + num_hit_blocks * self.block_size
        num_required = -(-(num_computed + num_new_tokens) // self.block_size)
        num_held = len(table) + len(new_computed_blocks)
        num_fresh = max(0, num_required - num_held)
        cow_indices = self._shared_write_indices(table, num_computed, num_new_tokens)
        # Touching a free cached block takes it out of the free queue, so it cannot also count
        # as a block available for fresh allocation.
        num_taken_from_free = sum(1 for block in new_computed_blocks if block.ref_cnt == 0)
        num_available = self.block_pool.get_num_free_blocks() - num_taken_from_free
        if num_fresh + len(cow_indices) > num_available:
            return None
        # NOTE: touch before get_new_blocks, or the free-queue head could hand out (and evict)
        # the very cached blocks this request is about to reuse.
        self.block_pool.touch(new_computed_blocks)
        table = table + list(new_computed_blocks)
        copies = [self._copy_on_write(table, idx) for idx in cow_indices]
        fresh_blocks = self.block_pool.get_new_blocks(num_fresh)
        table.extend(fresh_blocks)
        if req.req_id not in self.req_to_blocks:  # admission: count the prefix-cache lookup
            num_hits = len(new_computed_blocks) * self.block_size
            if self.host_tier is not None:
                self.external_prefix_cache_queries += req.num_tokens - num_hits
                self.external_prefix_cache_hits += tier_hits.num_blocks * self.block_size
            if req.num_preemptions:
                self.preempted_prefix_cache_queries += req.num_tokens
                self.preempted_prefix_cache_hits += num_hits
            else:
                self.prefix_cache_queries += req.num_tokens
                self.prefix_cache_hits += num_hits
                tier_hit = tier_hits.num_blocks * self.block_size
                self._count_prompt_sources(req.num_prompt_tokens, num_hits, tier_hit)
        self.req_to_blocks[req.req_id] = table
        new_block_ids = [block.block_id for block in new_computed_blocks]
        new_block_ids += [block.block_id for block in fresh_blocks]
        loads = [(slot, block.block_id) for slot, block in zip(tier_hits.host, fresh_blocks)]
        from_disk = fresh_blocks[len(loads) :]
        disk_loads = [(slot, block.block_id) for slot, block in zip(tier_hits.disk, from_disk)]
        self.host_tier_loaded_blocks += len(loads)
        self.disk_tier_loaded_blocks += len(disk_loads)
        return Allocation(new_block_ids, copies, bool(copies), loads, disk_loads)

    def cache_blocks(self, req: Request, num_computed_tokens: int) -> list[KVCacheBlock]:
        """Index every full block of `req` whose tokens are computed once the step being planned
        has run; returns the blocks this indexed (to be dropped if that step fails)."""
        if not self.enable_caching:
            return []
        table = self.req_to_blocks.get(req.req_id)
        start = self.num_cached_blocks.get(req.req_id, 0)
        if not table or num_computed_tokens // self.block_size <= start:
            return []  # most decode steps: no block filled up
        block_hashes = self._update_block_hashes(req)
        num_full = min(num_computed_tokens // self.block_size, len(table), len(block_hashes))
        indexed = [
            table[block_idx]
            for block_idx in range(start, num_full)
            if self.block_pool.cache_full_block(table[block_idx], block_hashes[block_idx])
        ]
        self.num_cached_blocks[req.req_id] = max(start, num_full)
        return indexed

    def fork(self, parent_req: Request, children: list[Request]) -> None:
        """Hand the parent's table to each child; every block is then shared by all children.

        The parent's own reference passes to the children and its table is dropped, so each
        block gains `len(children) - 1` references.
        """
        if not children:
            raise ValueError(f"fork of {parent_req.req_id!r}: needs at least one child")
        table = self.req_to_blocks.pop(parent_req.req_id, [])
        block_hashes = self.req_to_block_hashes.pop(parent_req.req_id, [])
        num_cached = self.num_cached_blocks.pop(parent_req.req_id, 0)
        for _ in range(len(children) - 1):
            self.block_pool.touch(table)
        for child in children:
            self.req_to_blocks[child.req_id] = list(table)
            self.req_to_block_hashes[child.req_id] = list(block_hashes)
            self.num_cached_blocks[child.req_id] = num_cached

    def free(self, req: Request) -> None:
        """Release `req`'s blocks and forget it; safe for a request that holds none.

        Blocks are freed tail first: the tail is the least likely to be shared, so it should be
        evicted before the prefix blocks other requests may hit.
        """
        table = self.req_to_blocks.pop(req.req_id, [])
        self.req_to_block_hashes.pop(req.req_id, None)
        self.num_cached_blocks.pop(req.req_id, None)
        self.block_pool.free_blocks(reversed(table))

    def check_invariants(self) -> None:
        """Raise AssertionError if refcounts, the free queue or the index are inconsistent."""
        holders = Counter(
            block.block_id for table in self.req_to_blocks.values() for block in table
        )
        queued = self.block_pool.free_block_queue.get_all_free_blocks()
        queued_ids = {block.block_id for block in queued}
        assert len(queued_ids) == len(queued), "a block is queued twice"
        assert len(queued) == self.block_pool.get_num_free_blocks(), "free count is off"
        for block in self.block_pool.blocks:
            assert block.ref_cnt == holders[block.block_id], (
                f"block {block.block_id}: ref_cnt {block.ref_cnt}, "
                f"held by {holders[block.block_id]} tables"
            )
            assert (block.ref_cnt == 0) == (block.block_id in queued_ids), (
                f"block {block.block_id}: ref_cnt {block.ref_cnt} but "
                f"{'in' if block.block_id in queued_ids else 'not in'} the free queue"
            )
            if block.block_hash is not None:
                indexed = self.block_pool.get_cached_block(block.block_hash)
                assert indexed is block, f"block {block.block_id}: hash not indexed to it"
        for block_hash, block in self.block_pool.cached_block_hash_to_block.items():
            assert block.block_hash == block_hash, f"index entry of block {block.block_id} stale"

    def _update_block_hashes(self, req: Request) -> list[BlockHash]:
        """Extend `req`'s stored hashes with its newly full blocks and return them."""
        block_hashes = self.req_to_block_hashes.setdefault(req.req_id, [])
        block_hashes.extend(
            compute_block_hashes(
                req.all_token_ids, self.block_size, req.cache_salt, block_hashes, req.lora_key
            )
        )
        return block_hashes

    def _shared_write_indices(
        self, table: list[KVCacheBlock], num_computed: int, num_new_tokens: int
    ) -> list[int]:
        """Indices of blocks already in `table` that this step writes into but others share."""
        if num_new_tokens <= 0:
            return []
        first_idx = num_computed // self.block_size
        last_idx = (num_computed + num_new_tokens - 1) // self.block_size
        return [
            idx for idx in range(first_idx, min(last_idx + 1, len(table))) if table[idx].ref_cnt > 1
        ]

    def _copy_on_write(self, table: list[KVCacheBlock], block_idx: int) -> tuple[int, int]:
        """Swap a shared block in `table` for a private one; return the (src, dst) copy op."""
        shared = table[block_idx]
        (private,) = self.block_pool.get_new_blocks(1)
        table[block_idx] = private
        # The shared block keeps at least one other holder, so this never frees it.
        self.block_pool.free_blocks([shared])
        return shared.block_id, private.block_id
