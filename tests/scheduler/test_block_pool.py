"""BlockPool and FreeBlockQueue: exact block ids, refcounts and LRU eviction order."""

from __future__ import annotations

import pytest

from pagedray.scheduler.block_pool import BlockPool, FreeBlockQueue, KVCacheBlock
from pagedray.scheduler.prefix_hash import hash_block_tokens


def _ids(blocks: list[KVCacheBlock]) -> list[int]:
    return [block.block_id for block in blocks]


def _free_ids(pool: BlockPool) -> list[int]:
    return _ids(pool.free_block_queue.get_all_free_blocks())


def test_free_queue_initial_order_and_o1_ops() -> None:
    blocks = [KVCacheBlock(block_id=i) for i in range(5)]
    queue = FreeBlockQueue(blocks)
    assert queue.num_free_blocks == 5
    assert _ids(queue.get_all_free_blocks()) == [0, 1, 2, 3, 4]
    queue.remove(blocks[2])
    queue.remove(blocks[0])
    queue.remove(blocks[4])
    assert _ids(queue.get_all_free_blocks()) == [1, 3]
    assert blocks[2].prev_free is None and blocks[2].next_free is None
    assert queue.popleft() is blocks[1]
    queue.append(blocks[4])
    queue.append(blocks[0])
    assert _ids(queue.get_all_free_blocks()) == [3, 4, 0]
    assert queue.num_free_blocks == 3


def test_free_queue_errors() -> None:
    blocks = [KVCacheBlock(block_id=i) for i in range(2)]
    queue = FreeBlockQueue(blocks)
    with pytest.raises(ValueError):
        queue.append(blocks[0])  # already queued
    queue.popleft()
    queue.popleft()
    with pytest.raises(ValueError):
        queue.popleft()
    with pytest.raises(ValueError):
        queue.remove(blocks[0])
    assert queue.num_free_blocks == 0


def test_block_repr_does_not_recurse() -> None:
    pool = BlockPool(3, enable_caching=True)
    assert "block_id=1" in repr(pool.blocks[1])


def test_get_new_blocks_pops_head_and_sets_ref_cnt() -> None:
    pool = BlockPool(6, enable_caching=True)
    blocks = pool.get_new_blocks(3)
    assert _ids(blocks) == [0, 1, 2]
    assert [block.ref_cnt for block in blocks] == [1, 1, 1]
    assert pool.get_num_free_blocks() == 3
    assert pool.usage == pytest.approx(0.5)
    with pytest.raises(ValueError):
        pool.get_new_blocks(4)
    assert pool.get_num_free_blocks() == 3  # a refused request takes nothing


def test_lru_eviction_of_freed_cached_blocks_oldest_first() -> None:
    pool = BlockPool(4, enable_caching=True)
    blocks = pool.get_new_blocks(4)
    hashes = [hash_block_tokens(None, [i]) for i in range(4)]
    for block, block_hash in zip(blocks, hashes):
        pool.cache_full_block(block, block_hash)
    assert pool.num_cached_blocks == 4
    # Free in the order 2, 0, 3, 1: that is the eviction order.
    pool.free_blocks([blocks[2], blocks[0], blocks[3], blocks[1]])
    assert _free_ids(pool) == [2, 0, 3, 1]
    assert pool.usage == 0.0
    # Free blocks keep their hash and are still hittable.
    assert pool.get_cached_block(hashes[2]) is blocks[2]
    (first,) = pool.get_new_blocks(1)
    assert first.block_id == 2 and first.block_hash is None
    assert pool.get_cached_block(hashes[2]) is None  # evicted
    assert pool.get_cached_block(hashes[0]) is blocks[0]  # not yet
    assert _ids(pool.get_new_blocks(2)) == [0, 3]
    assert pool.num_cached_blocks == 1
    assert pool.get_cached_block(hashes[1]) is blocks[1]


def test_touch_pulls_cached_free_block_out_of_queue() -> None:
    pool = BlockPool(4, enable_caching=True)
    blocks = pool.get_new_blocks(2)
    block_hash = hash_block_tokens(None, [9])
    pool.cache_full_block(blocks[1], block_hash)
    pool.free_blocks(blocks)
    assert _free_ids(pool) == [2, 3, 0, 1]
    hit = pool.get_cached_block(block_hash)
    assert hit is blocks[1]
    pool.touch([hit])
    assert hit.ref_cnt == 1
    assert _free_ids(pool) == [2, 3, 0]
    pool.touch([hit])  # a second holder: not in the queue, no change there
    assert hit.ref_cnt == 2 and pool.get_num_free_blocks() == 3
    pool.free_blocks([hit])
    assert hit.ref_cnt == 1 and pool.get_num_free_blocks() == 3
    pool.free_blocks([hit])
    assert _free_ids(pool) == [2, 3, 0, 1]


def test_cache_full_block_keeps_first_holder_of_a_hash() -> None:
    pool = BlockPool(4, enable_caching=True)
    first, second = pool.get_new_blocks(2)
    block_hash = hash_block_tokens(None, [1, 2])
    pool.cache_full_block(first, block_hash)
    pool.cache_full_block(second, block_hash)
    assert pool.get_cached_block(block_hash) is first
    assert second.block_hash is None
    # Evicting the duplicate must not drop the index entry of the first holder.
    pool.free_blocks([second])
    pool.get_new_blocks(3)
    assert pool.get_cached_block(block_hash) is first


def test_caching_disabled_never_indexes() -> None:
    pool = BlockPool(2, enable_caching=False)
    (block,) = pool.get_new_blocks(1)
    block_hash = hash_block_tokens(None, [1])
    pool.cache_full_block(block, block_hash)
    assert block.block_hash is None
    assert pool.get_cached_block(block_hash) is None
    assert pool.num_cached_blocks == 0


def test_free_more_than_taken_is_an_error() -> None:
    pool = BlockPool(2, enable_caching=True)
    (block,) = pool.get_new_blocks(1)
    pool.free_blocks([block])
    with pytest.raises(AssertionError):
        pool.free_blocks([block])


def test_reset_prefix_cache_only_when_all_free() -> None:
    pool = BlockPool(3, enable_caching=True)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_block(blocks[0], hash_block_tokens(None, [1]))
    assert pool.reset_prefix_cache() is False
    assert pool.num_cached_blocks == 1
    pool.free_blocks(blocks)
    assert pool.reset_prefix_cache() is True
    assert pool.num_cached_blocks == 0
    assert all(block.block_hash is None for block in pool.blocks)
    assert pool.get_num_free_blocks() == 3
