"""Random admit/step/fork/preempt/free sequences must keep KVCacheManager's invariants.

Besides refcount bookkeeping, a shadow KV store records which prefix each physical slot holds,
so a block evicted while still hit, or a shared block written without copy-on-write, shows up
as a sequence reading KV that is not its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pagedray.scheduler.block_pool import KVCacheBlock
from pagedray.scheduler.kv_cache_manager import Allocation, KVCacheManager
from pagedray.scheduler.request import EngineRequest, Request
from pagedray.scheduler.sampling_params import SamplingParams

VOCAB = st.integers(min_value=0, max_value=2)  # tiny vocabulary: prefixes collide often
SHARED_PREFIXES = ([0, 1, 2, 0, 1, 2, 0, 1], [2, 2, 2, 2, 1, 1], [])
MAX_LIVE = 6
T = TypeVar("T")


class KVCacheManagerMachine(RuleBasedStateMachine):
    """Drives a KVCacheManager the way the scheduler does, with a model of the KV contents."""

    @initialize(
        num_blocks=st.integers(min_value=8, max_value=24),
        block_size=st.sampled_from([2, 4]),
        enable_caching=st.booleans(),
    )
    def setup(self, num_blocks: int, block_size: int, enable_caching: bool) -> None:
        self.manager = KVCacheManager(num_blocks, block_size, enable_caching, record_kv_events=True)
        # A router's copy of the hittable hashes, kept only from the pool's KV deltas.
        self.router_view: set[bytes] = set()
        self.block_size = block_size
        self.waiting: dict[str, Request] = {}  # no table: new or preempted
        self.running: dict[str, Request] = {}  # holds a table
        self.pending: dict[str, int] = {}  # req_id -> tokens allocated but not computed yet
        # Shadow KV store: (block id, offset) -> the token prefix whose KV that slot holds.
        self.slots: dict[tuple[int, int], tuple[int, ...]] = {}
        self.next_id = 0

    # --- rules -------------------------------------------------------------------------------

    @precondition(lambda self: len(self.waiting) + len(self.running) < MAX_LIVE)
    @rule(
        prefix=st.sampled_from(SHARED_PREFIXES),
        suffix=st.lists(VOCAB, min_size=0, max_size=10),
        cache_salt=st.sampled_from([None, None, "tenant"]),
    )
    def add_request(self, prefix: list[int], suffix: list[int], cache_salt: str | None) -> None:
        token_ids = (prefix + suffix) or [0]
        req_id = f"r{self.next_id}"
        self.next_id += 1
        engine_request = EngineRequest(req_id, token_ids, SamplingParams(), cache_salt=cache_salt)
        self.waiting[req_id] = Request(engine_request)

    @precondition(lambda self: not self.running)
    @rule()
    def reset_prefix_cache(self) -> None:
        assert self.manager.reset_prefix_cache()

    @precondition(lambda self: self.waiting)
    @rule(pick=st.integers(min_value=0), chunk=st.integers(min_value=1, max_value=12))
    def admit(self, pick: int, chunk: int) -> None:
        req = _pick(list(self.waiting.values()), pick)
        blocks, num_hit = self.manager.get_computed_blocks(req)
        assert num_hit < req.num_tokens
        num_new = min(chunk, req.num_tokens - num_hit)
        allocation = self._allocate(req, num_new, blocks)
        if allocation is None:
            return
        req.num_computed_tokens = num_hit
        del self.waiting[req.req_id]
        self.running[req.req_id] = req
        self.pending[req.req_id] = num_new

    @precondition(lambda self: self._schedulable())
    @rule(pick=st.integers(min_value=0), chunk=st.integers(min_value=1, max_value=12))
    def schedule(self, pick: int, chunk: int) -> None:
        """Allocate the next chunk of a running request; preempt it if blocks ran out."""
        req = _pick(self._schedulable(), pick)
        num_new = min(chunk, req.num_tokens - req.num_computed_tokens)
        if self._allocate(req, num_new, []) is None:
            self._preempt(req)
        else:
            self.pending[req.req_id] = num_new

    @precondition(lambda self: self.pending)
    @rule(pick=st.integers(min_value=0), token=VOCAB, sample=st.booleans())
    def step(self, pick: int, token: int, sample: bool) -> None:
        """Run the forward pass of one request: write its KV, index full blocks, maybe sample."""
        req_id = _pick(list(self.pending), pick)
        req = self.running[req_id]
        num_new = self.pending.pop(req_id)
        block_ids = self.manager.get_block_ids(req_id)
        for pos in range(req.num_computed_tokens, req.num_computed_tokens + num_new):
            slot = (block_ids[pos // self.block_size], pos % self.block_size)
            self.slots[slot] = tuple(req.all_token_ids[: pos + 1])
        req.num_computed_tokens += num_new
        self.manager.cache_blocks(req, req.num_computed_tokens)
        if sample and req.num_computed_tokens == req.num_tokens:
            req.append_output_token_ids([token])

    @precondition(lambda self: self._forkable())
    @rule(pick=st.integers(min_value=0), n=st.integers(min_value=1, max_value=4), data=st.data())
    def fork(self, pick: int, n: int, data: st.DataObject) -> None:
        """A finished prompt samples n first tokens and splits into n children."""
        parent = _pick(self._forkable(), pick)
        first_tokens = data.draw(st.lists(VOCAB, min_size=n, max_size=n))
        children = [parent.fork_child(i) for i in range(n)]
        self.manager.fork(parent, children)
        for child, token in zip(children, first_tokens):
            child.append_output_token_ids([token])
        del self.running[parent.req_id]
        for child in children:
            self.running[child.req_id] = child

    @precondition(lambda self: self.waiting or self.running)
    @rule(pick=st.integers(min_value=0))
    def free(self, pick: int) -> None:
        req = _pick([*self.waiting.values(), *self.running.values()], pick)
        self.manager.free(req)
        self.waiting.pop(req.req_id, None)
        self.running.pop(req.req_id, None)
        self.pending.pop(req.req_id, None)

    # --- invariants --------------------------------------------------------------------------

    @invariant()
    def router_view_matches_index(self) -> None:
        """Read after every step (test_kv_events.py folds longer windows)."""
        self.manager.block_pool.take_kv_delta().apply(self.router_view)
        assert self.router_view == set(self.manager.block_pool.cached_block_hash_to_block)

    @invariant()
    def refcounts_and_free_queue_consistent(self) -> None:
        self.manager.check_invariants()
        used = sum(1 for block in self.manager.block_pool.blocks if block.ref_cnt > 0)
        assert self.manager.num_free_blocks + used == self.manager.num_blocks

    @invariant()
    def tables_cover_tokens(self) -> None:
        for req_id, req in self.running.items():
            num_slots = len(self.manager.get_block_ids(req_id)) * self.block_size
            assert num_slots >= req.num_computed_tokens + self.pending.get(req_id, 0)

    @invariant()
    def pending_writes_are_private(self) -> None:
        blocks_by_id = self.manager.block_pool.blocks
        for req_id, num_new in self.pending.items():
            req = self.running[req_id]
            block_ids = self.manager.get_block_ids(req_id)
            for pos in range(req.num_computed_tokens, req.num_computed_tokens + num_new):
                block = blocks_by_id[block_ids[pos // self.block_size]]
                assert block.ref_cnt == 1, f"{req_id} writes pos {pos} into shared {block}"
                assert block.block_hash is None, f"{req_id} writes into cached {block}"

    @invariant()
    def computed_kv_is_own_prefix(self) -> None:
        for req_id, req in self.running.items():
            block_ids = self.manager.get_block_ids(req_id)
            for pos in range(req.num_computed_tokens):
                slot = (block_ids[pos // self.block_size], pos % self.block_size)
                assert self.slots.get(slot) == tuple(req.all_token_ids[: pos + 1]), (
                    f"{req_id} reads foreign KV at pos {pos} from slot {slot}"
                )

    def teardown(self) -> None:
        if not hasattr(self, "manager"):
            return
        for req in [*self.waiting.values(), *self.running.values()]:
            self.manager.free(req)
        self.manager.check_invariants()
        assert self.manager.num_free_blocks == self.manager.num_blocks, "blocks leaked"
        assert self.manager.usage == 0.0
        assert self.manager.reset_prefix_cache()
        assert self.manager.block_pool.num_cached_blocks == 0
        self.router_view_matches_index()
        assert not self.router_view

    # --- helpers -----------------------------------------------------------------------------

    def _allocate(
        self, req: Request, num_new: int, blocks: list[KVCacheBlock]
    ) -> Allocation | None:
        """allocate_slots, checking that a refusal changes nothing and running the CoW copies."""
        before = _snapshot(self.manager)
        old_ids = self.manager.get_block_ids(req.req_id)
        allocation = self.manager.allocate_slots(req, num_new, blocks)
        if allocation is None:
            assert _snapshot(self.manager) == before
            return None
        new_ids = self.manager.get_block_ids(req.req_id)
        for src, dst in allocation.copies:
            idx = old_ids.index(src)
            old_ids[idx] = dst
            for offset in range(self.block_size):
                if (src, offset) in self.slots:
                    self.slots[(dst, offset)] = self.slots[(src, offset)]
        assert old_ids + allocation.new_block_ids == new_ids
        assert allocation.replaced == bool(allocation.copies)
        return allocation

    def _preempt(self, req: Request) -> None:
        self.manager.free(req)
        del self.running[req.req_id]
        req.num_computed_tokens = 0
        self.waiting[req.req_id] = req

    def _schedulable(self) -> list[Request]:
        return [
            req
            for req_id, req in self.running.items()
            if req_id not in self.pending and req.num_computed_tokens < req.num_tokens
        ]

    def _forkable(self) -> list[Request]:
        return [
            req
            for req_id, req in self.running.items()
            if req_id not in self.pending
            and req.num_output_tokens == 0
            and req.num_computed_tokens == req.num_tokens
        ]


def _pick(items: Sequence[T], pick: int) -> T:
    """The `pick`-th item, cycling: hypothesis draws any index and it lands on a live item."""
    return items[pick % len(items)]


def _snapshot(manager: KVCacheManager) -> tuple:
    pool = manager.block_pool
    return (
        [block.ref_cnt for block in pool.blocks],
        [block.block_id for block in pool.free_block_queue.get_all_free_blocks()],
        {req_id: manager.get_block_ids(req_id) for req_id in manager.req_to_blocks},
        dict(pool.cached_block_hash_to_block),
        [block.block_hash for block in pool.blocks],
    )


TestKVCacheManagerStateful = KVCacheManagerMachine.TestCase
TestKVCacheManagerStateful.settings = settings(
    max_examples=100,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
