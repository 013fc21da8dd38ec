"""Routers' copies of an engine's prefix-cache index, kept from a snapshot and each step's KV
deltas (pagedray/engine/kv_index_publisher.py), equal the engine's own index: for a subscriber
from the start, one that joins midway, and one that fell behind and got a snapshot instead."""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator

import pytest

from pagedray.engine import kv_index_publisher
from pagedray.engine.async_engine import AsyncEngine
from pagedray.engine.config import EngineConfig
from pagedray.engine.engine_factory import build_engine
from pagedray.engine.kv_index_publisher import (
    KVIndexPublisher,
    pack_delta,
    routing_hash,
    unpack_delta,
)
from pagedray.engine.output_processor import OutputProcessor
from pagedray.scheduler.kv_events import KVCacheDelta
from pagedray.scheduler.sampling_params import SamplingParams

NUM_KV_BLOCKS = 16  # of 16 tokens: the prompts below evict each other's blocks
PARAMS = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


class Follower:
    """A router's view of the index, kept from one subscription."""

    def __init__(self, deltas: AsyncIterator[KVCacheDelta]) -> None:
        self.deltas = deltas
        self.view: set[bytes] = set()
        self.tier_view: set[bytes] = set()
        self.ever_stored: set[bytes] = set()
        self.num_snapshots = 0

    async def follow(self) -> None:
        async for delta in self.deltas:
            self.take(delta)

    def take(self, delta: KVCacheDelta) -> None:
        delta.apply(self.view)
        if delta.tier is not None:
            delta.tier.apply(self.tier_view)
        self.ever_stored.update(delta.stored)
        self.num_snapshots += delta.cleared


def test_subscribers_views_equal_the_engine_index(
    tiny_llama: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(kv_index_publisher, "MAX_QUEUED_DELTAS", 3)  # so the unread one lags

    async def run() -> None:
        config = EngineConfig(
            model=tiny_llama,
            num_kv_blocks=NUM_KV_BLOCKS,
            num_threads=1,
            enable_kv_cache_events=True,
        )
        core, _executor, tokenizer, _validator = build_engine(config)
        engine = AsyncEngine(core, OutputProcessor(tokenizer))
        publisher = KVIndexPublisher()
        core.kv_delta_listener = publisher.listener(asyncio.get_running_loop())
        index: Any = core.scheduler.kv_cache_manager.block_pool.cached_block_hash_to_block

        early = Follower(publisher.subscribe(idle_end_s=60))
        behind = Follower(publisher.subscribe(idle_end_s=60))
        behind.take(await anext(behind.deltas))  # subscribed, then left unread a while
        tasks = [asyncio.create_task(early.follow())]

        async def generate(request_id: str, prompt: list[int]) -> None:
            async for _ in engine.add_request(request_id, prompt, PARAMS):
                pass

        prompts = [[(7 * i + j) % 50 + 1 for j in range(40 + 8 * i)] for i in range(12)]
        await asyncio.gather(*(generate(f"a{i}", p) for i, p in enumerate(prompts[:6])))
        late = Follower(publisher.subscribe(idle_end_s=60))
        tasks.append(asyncio.create_task(late.follow()))
        for i, prompt in enumerate(prompts[6:]):
            await generate(f"b{i}", prompt)
        await generate("c", prompts[0])  # a prefix hit, after evictions
        tasks.append(asyncio.create_task(behind.follow()))
        for _ in range(5):
            await asyncio.sleep(0.05)  # the last hand-overs from the compute thread

        expected = {routing_hash(block_hash) for block_hash in index}
        assert expected and early.view == expected
        assert late.view == expected and behind.view == expected
        # The node's host tier too (on by default): the evicted blocks, as the engine saw them.
        tier = core.scheduler.kv_cache_manager.host_tier
        assert tier is not None
        in_tier = {routing_hash(tier._slot_hash[slot]) for slot in tier._valid}
        assert in_tier and early.tier_view == late.tier_view == behind.tier_view == in_tier
        assert len(early.ever_stored) > NUM_KV_BLOCKS  # blocks were evicted on the way
        assert early.num_snapshots == late.num_snapshots == 1
        assert behind.num_snapshots == 2  # it fell behind: a snapshot replaced its backlog
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        idle = Follower(publisher.subscribe(idle_end_s=0.1))
        await asyncio.wait_for(idle.follow(), 10)  # nothing changes: it ends by itself
        assert idle.view == expected and idle.num_snapshots == 1
        await engine.shutdown()
        assert publisher.num_subscribers == 0

    asyncio.run(run())


def test_a_packed_delta_unpacks_to_itself() -> None:
    delta = KVCacheDelta([b"a" * 8, b"b" * 8], [b"c" * 8], cleared=True)
    assert unpack_delta(pack_delta(delta)) == delta
    assert unpack_delta(pack_delta(KVCacheDelta())) == KVCacheDelta()
    with_tier = KVCacheDelta([b"a" * 8], tier=KVCacheDelta([b"d" * 8], [b"e" * 8], True))
    assert unpack_delta(pack_delta(with_tier)) == with_tier
    disk = KVCacheDelta([b"f" * 8], cleared=True)
    with_disk = KVCacheDelta(tier=KVCacheDelta([b"d" * 8], tier=disk))
    assert unpack_delta(pack_delta(with_disk)) == with_disk


def test_an_idle_engine_publishes_what_its_node_tier_gained(tiny_llama: str) -> None:
    """The node's other engines change the tier while this one idles: its routers hear of it
    without a step (the replica's idle loop publishes), starting with the tier's snapshot."""
    from pagedray.scheduler.host_kv_tier import HostKVTier

    config = EngineConfig(
        model=tiny_llama, num_kv_blocks=NUM_KV_BLOCKS, num_threads=1, enable_kv_cache_events=True
    )
    core = build_engine(config)[0]
    tier = core.scheduler.kv_cache_manager.host_tier
    assert tier is not None
    deltas: list[KVCacheDelta] = []
    core.kv_delta_listener = deltas.append
    core.publish_kv_delta()
    assert deltas and deltas[0].tier is not None and deltas[0].tier.cleared  # the snapshot
    other = HostKVTier(tier.path)  # another engine of the node
    block = bytes(range(32))
    reserved = other.reserve([block])
    other.publish([slot for _, slot in reserved])
    core.publish_kv_delta()
    assert deltas[-1].tier is not None and deltas[-1].tier.stored == [block]
    assert core.num_steps == 0
    core.publish_kv_delta()
    assert len(deltas) == 2, "nothing changed: nothing published"


def test_an_engine_with_a_disk_tier_publishes_it_below_its_host_tiers(
    tiny_llama: str, tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With `--kv-disk-dir`, the disk tier's blocks reach the routers nested in the host
    tier's delta, and the publisher's snapshot for a new subscriber carries them."""
    from pagedray.scheduler.host_kv_tier import HostKVTier
    from pagedray.workers.host_kv_buffer import TIER_DIR_ENV

    monkeypatch.setenv(TIER_DIR_ENV, str(tmp_path / "shm"))
    config = EngineConfig(
        model=tiny_llama,
        num_kv_blocks=NUM_KV_BLOCKS,
        num_threads=1,
        enable_kv_cache_events=True,
        kv_disk_dir=str(tmp_path / "disk"),
    )
    core = build_engine(config)[0]
    tier = core.scheduler.kv_cache_manager.host_tier
    assert tier is not None and tier.lower is not None
    publisher = kv_index_publisher.KVIndexPublisher()
    core.kv_delta_listener = publisher.publish
    core.publish_kv_delta()
    other = HostKVTier(tier.lower.path, name="disk")  # a block another engine left on disk
    block = bytes(range(32))
    other.publish([slot for _, slot in other.reserve([block])])
    core.publish_kv_delta()
    assert publisher.disk_hashes == {kv_index_publisher.routing_hash(block)}
    snapshot = publisher.snapshot()
    assert snapshot.tier is not None and snapshot.tier.tier is not None
    assert snapshot.tier.tier.stored == [kv_index_publisher.routing_hash(block)]
