"""KVCacheManager: prefix hits, eviction order, forks and copy-on-write, with exact block ids."""

from __future__ import annotations

import pytest

from pagedray.scheduler.kv_cache_manager import Allocation, KVCacheManager
from pagedray.scheduler.request import EngineRequest, Request
from pagedray.scheduler.sampling_params import SamplingParams


def make_request(req_id: str, token_ids: list[int], cache_salt: str | None = None) -> Request:
    engine_request = EngineRequest(req_id, token_ids, SamplingParams(), cache_salt=cache_salt)
    return Request(engine_request)


def admit(manager: KVCacheManager, req: Request, num_new_tokens: int | None = None) -> Allocation:
    """First admission the way the scheduler does it; asserts it fits."""
    blocks, num_hit = manager.get_computed_blocks(req)
    if num_new_tokens is None:
        num_new_tokens = req.num_tokens - num_hit
    allocation = manager.allocate_slots(req, num_new_tokens, blocks)
    assert allocation is not None
    req.num_computed_tokens = num_hit
    return allocation


def fork_children(parent: Request, first_token_ids: list[int]) -> list[Request]:
    """The parent's n children, each continuing the prompt with its own first sampled token."""
    children = [parent.fork_child(i) for i in range(len(first_token_ids))]
    for child, token_id in zip(children, first_token_ids):
        child.append_output_token_ids([token_id])
    return children


def compute(manager: KVCacheManager, req: Request, num_tokens: int) -> None:
    """What the scheduler does after a step ran `num_tokens` of `req`."""
    req.num_computed_tokens += num_tokens
    manager.cache_blocks(req, req.num_computed_tokens)


def ref_cnts(manager: KVCacheManager) -> list[int]:
    return [block.ref_cnt for block in manager.block_pool.blocks]


def free_ids(manager: KVCacheManager) -> list[int]:
    return [b.block_id for b in manager.block_pool.free_block_queue.get_all_free_blocks()]


def snapshot(manager: KVCacheManager) -> tuple:
    pool = manager.block_pool
    return (
        ref_cnts(manager),
        free_ids(manager),
        {req_id: manager.get_block_ids(req_id) for req_id in manager.req_to_blocks},
        dict(pool.cached_block_hash_to_block),
        [block.block_hash for block in pool.blocks],
    )


def test_first_request_allocates_in_order_and_caches_full_blocks() -> None:
    manager = KVCacheManager(num_blocks=10, block_size=4)
    req = make_request("a", list(range(10)))
    assert manager.get_computed_blocks(req) == ([], 0)
    allocation = manager.allocate_slots(req, 10)
    assert allocation == Allocation(new_block_ids=[0, 1, 2], copies=[], replaced=False)
    assert manager.get_block_ids("a") == [0, 1, 2]
    assert manager.num_free_blocks == 7
    assert manager.usage == pytest.approx(0.3)
    compute(manager, req, 10)
    assert manager.block_pool.num_cached_blocks == 2  # block 2 holds 2 of 4 tokens
    req.append_output_token_ids([50, 51])  # decode fills block 2
    assert manager.allocate_slots(req, 1) == Allocation([], [], False)
    compute(manager, req, 1)
    assert manager.allocate_slots(req, 1) == Allocation([], [], False)
    compute(manager, req, 1)
    assert manager.block_pool.num_cached_blocks == 3
    req.append_output_token_ids([52])
    assert manager.allocate_slots(req, 1) == Allocation([3], [], False)  # crosses a boundary
    manager.check_invariants()


def test_second_request_shares_two_block_prefix() -> None:
    manager = KVCacheManager(num_blocks=10, block_size=4)
    first = make_request("a", list(range(10)))
    admit(manager, first)
    compute(manager, first, 10)
    second = make_request("b", list(range(8)) + [90, 91, 92])
    blocks, num_hit = manager.get_computed_blocks(second)
    assert [block.block_id for block in blocks] == [0, 1] and num_hit == 8
    assert ref_cnts(manager)[:2] == [1, 1]  # lookups do not touch refcounts
    allocation = manager.allocate_slots(second, 3, blocks)
    assert allocation == Allocation(new_block_ids=[0, 1, 3], copies=[], replaced=False)
    assert ref_cnts(manager)[:4] == [2, 2, 1, 1]
    assert manager.prefix_cache_queries == 10 + 11
    assert manager.prefix_cache_hits == 8
    manager.check_invariants()


def test_different_cache_salt_gets_no_hit() -> None:
    manager = KVCacheManager(num_blocks=10, block_size=4)
    owner = make_request("a", list(range(12)), cache_salt="tenant-a")
    admit(manager, owner)
    compute(manager, owner, 12)
    same_tenant = make_request("b", list(range(12)), cache_salt="tenant-a")
    other_tenant = make_request("c", list(range(12)), cache_salt="tenant-b")
    no_salt = make_request("d", list(range(12)))
    assert manager.get_computed_blocks(same_tenant)[1] == 8
    assert manager.get_computed_blocks(other_tenant) == ([], 0)
    assert manager.get_computed_blocks(no_salt) == ([], 0)


def test_hit_is_capped_to_leave_one_token_to_compute() -> None:
    manager = KVCacheManager(num_blocks=10, block_size=16)
    owner = make_request("a", list(range(33)))
    admit(manager, owner)
    compute(manager, owner, 33)
    exact = make_request("b", list(range(32)))
    blocks, num_hit = manager.get_computed_blocks(exact)
    assert [block.block_id for block in blocks] == [0] and num_hit == 16
    longer = make_request("c", list(range(33)))
    blocks, num_hit = manager.get_computed_blocks(longer)
    assert [block.block_id for block in blocks] == [0, 1] and num_hit == 32


def test_free_is_reverse_order_and_eviction_is_lru() -> None:
    manager = KVCacheManager(num_blocks=6, block_size=4)
    first = make_request("a", list(range(12)))
    admit(manager, first)
    compute(manager, first, 12)
    manager.free(first)
    assert free_ids(manager) == [3, 4, 5, 2, 1, 0]  # tail block first: evicted first
    assert manager.block_pool.num_cached_blocks == 3
    other = make_request("b", list(range(100, 116)))
    assert admit(manager, other).new_block_ids == [3, 4, 5, 2]
    assert manager.block_pool.num_cached_blocks == 2  # block 2's hash was evicted
    again = make_request("c", list(range(12)) + [7])
    blocks, num_hit = manager.get_computed_blocks(again)
    assert [block.block_id for block in blocks] == [0, 1] and num_hit == 8
    # Blocks 0 and 1 are the only free ones and the hit takes them: no room for 2 more.
    before = snapshot(manager)
    assert manager.allocate_slots(again, 5, blocks) is None
    assert snapshot(manager) == before
    manager.free(other)
    assert free_ids(manager) == [1, 0, 2, 5, 4, 3]
    allocation = manager.allocate_slots(again, 5, blocks)
    assert allocation == Allocation(new_block_ids=[0, 1, 2, 5], copies=[], replaced=False)
    assert free_ids(manager) == [4, 3]
    manager.check_invariants()


def test_allocate_slots_out_of_blocks_changes_nothing() -> None:
    manager = KVCacheManager(num_blocks=4, block_size=4)
    first = make_request("a", list(range(8)))
    admit(manager, first)
    compute(manager, first, 8)
    big = make_request("b", list(range(100, 112)))
    before = snapshot(manager)
    assert manager.get_computed_blocks(big) == ([], 0)
    assert manager.allocate_slots(big, 12) is None
    assert snapshot(manager) == before
    assert manager.get_block_ids("b") == []
    manager.free(big)  # never admitted: still safe
    manager.check_invariants()


def test_same_prefix_computed_twice_keeps_first_in_index() -> None:
    manager = KVCacheManager(num_blocks=8, block_size=4)
    first = make_request("a", list(range(9)))
    second = make_request("b", list(range(9)))
    admit(manager, first)
    admit(manager, second)  # nothing cached yet: no hit
    assert manager.get_block_ids("b") == [3, 4, 5]
    compute(manager, first, 9)
    compute(manager, second, 9)
    pool = manager.block_pool
    assert pool.num_cached_blocks == 2
    assert [pool.blocks[i].block_hash is None for i in (0, 1, 3, 4)] == [False, False, True, True]
    manager.free(first)
    manager.free(second)
    third = make_request("c", list(range(9)))
    assert [block.block_id for block in manager.get_computed_blocks(third)[0]] == [0, 1]
    manager.check_invariants()


def test_fork_shares_every_prompt_block() -> None:
    manager = KVCacheManager(num_blocks=10, block_size=4)
    parent = make_request("p", list(range(12)))
    admit(manager, parent)
    compute(manager, parent, 12)
    children = fork_children(parent, [100, 101, 102, 103])
    manager.fork(parent, children)
    assert ref_cnts(manager)[:3] == [4, 4, 4]
    assert manager.get_block_ids("p") == []
    assert all(manager.get_block_ids(child.req_id) == [0, 1, 2] for child in children)
    manager.check_invariants()
    for child in children:
        manager.free(child)
    assert manager.num_free_blocks == 10
    manager.check_invariants()


def test_copy_on_write_after_fork() -> None:
    manager = KVCacheManager(num_blocks=10, block_size=16)
    parent = make_request("p", list(range(20)))
    admit(manager, parent)
    compute(manager, parent, 20)
    children = fork_children(parent, [100, 101, 102, 103])
    manager.fork(parent, children)
    assert ref_cnts(manager)[:2] == [4, 4]
    for private_id, child in zip([2, 3, 4], children[:3]):
        allocation = manager.allocate_slots(child, 1)
        assert allocation == Allocation(new_block_ids=[], copies=[(1, private_id)], replaced=True)
        assert manager.get_block_ids(child.req_id) == [0, private_id]
    assert ref_cnts(manager)[:5] == [4, 1, 1, 1, 1]
    last = manager.allocate_slots(children[3], 1)
    assert last == Allocation(new_block_ids=[], copies=[], replaced=False)  # sole holder now
    assert manager.get_block_ids(children[3].req_id) == [0, 1]
    manager.check_invariants()
    for child in children:
        compute(manager, child, 1)
        manager.free(child)
    assert manager.num_free_blocks == 10
    manager.check_invariants()


def test_copy_on_write_out_of_blocks_changes_nothing() -> None:
    manager = KVCacheManager(num_blocks=2, block_size=4)
    parent = make_request("p", list(range(6)))
    admit(manager, parent)
    compute(manager, parent, 6)
    children = fork_children(parent, [100, 101])
    manager.fork(parent, children)
    before = snapshot(manager)
    assert manager.allocate_slots(children[0], 1) is None
    assert snapshot(manager) == before
    manager.free(children[1])
    assert manager.allocate_slots(children[0], 1) == Allocation([], [], False)
    manager.check_invariants()


def test_caching_disabled() -> None:
    manager = KVCacheManager(num_blocks=8, block_size=4, enable_caching=False)
    first = make_request("a", list(range(9)))
    admit(manager, first)
    compute(manager, first, 9)
    assert manager.block_pool.num_cached_blocks == 0
    second = make_request("b", list(range(9)))
    assert manager.get_computed_blocks(second) == ([], 0)
    assert manager.allocate_slots(second, 9) is not None
    assert manager.prefix_cache_queries == 18 and manager.prefix_cache_hits == 0


def test_reset_prefix_cache() -> None:
    manager = KVCacheManager(num_blocks=4, block_size=4)
    req = make_request("a", list(range(8)))
    admit(manager, req)
    compute(manager, req, 8)
    assert manager.reset_prefix_cache() is False
    manager.free(req)
    assert manager.reset_prefix_cache() is True
    assert manager.get_computed_blocks(make_request("b", list(range(9)))) == ([], 0)


def test_check_invariants_catches_corruption() -> None:
    manager = KVCacheManager(num_blocks=4, block_size=4)
    admit(manager, make_request("a", list(range(8))))
    manager.check_invariants()
    manager.block_pool.blocks[0].ref_cnt += 1
    with pytest.raises(AssertionError):
        manager.check_invariants()
