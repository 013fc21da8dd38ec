"""The host KV tier under real engines: a prompt whose blocks were evicted comes back from the
tier token for token; another engine of the node, or one started later, finds them too; and
preemption through the tier changes no output."""

from __future__ import annotations

import random
from typing import Iterator

import pytest

from pagedray.llm import LLM
from pagedray.scheduler import engine_core
from pagedray.scheduler.sampling_params import SamplingParams
from pagedray.workers.host_kv_buffer import TIER_DIR_ENV

BLOCK = 16
BLOCK_BYTES = 8192  # one KV block of the tiny model in float32
SALT = __name__
POOL_BLOCKS = 24  # a 100-token prompt takes 7: a few others evict it
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=8, temperature=1.0, seed=7, ignore_eos=True)


def prompts(seed: int, count: int, length: int = 100) -> list[dict]:
    """Seeded prompts, salted apart from any other test's: the tier outlives each engine, and
    every engine of the session's tiny model shares it."""
    rng = random.Random(seed)
    return [
        {"prompt_token_ids": [rng.randrange(1, 250) for _ in range(length)], "cache_salt": SALT}
        for _ in range(count)
    ]


def engine(model: str, **overrides) -> LLM:
    args = {"dtype": "float32", "num_kv_blocks": POOL_BLOCKS, "kv_offloading_size": 0.01}
    return LLM(model, **{**args, **overrides})


def tokens(llm: LLM, batch: list[dict], params: SamplingParams) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in llm.generate(batch, params, use_tqdm=False)]


def evict_all(llm: LLM, seed: int) -> None:
    """Run prompts no other test runs (the tier outlives engines) until `llm`'s pool is new."""
    for prompt in prompts(1000 + seed, 6):
        tokens(llm, [prompt], GREEDY)


@pytest.fixture
def first(tiny_llama: str) -> Iterator[LLM]:
    llm = engine(tiny_llama)
    yield llm
    llm.shutdown()


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_an_evicted_prompt_comes_back_from_the_tier_token_for_token(
    first: LLM, params: SamplingParams
) -> None:
    seed = 1 if params is GREEDY else 11
    (prompt,) = prompts(seed, 1)
    expected = tokens(first, [prompt], params)
    evict_all(first, seed)
    before = first.stats()
    assert before["host_tier_saved_blocks"] > 0
    assert before["host_tier_save_seconds"] > 0
    assert tokens(first, [prompt], params) == expected
    after = first.stats()
    assert after["host_tier_load_seconds"] > before["host_tier_load_seconds"]
    loaded = after["external_prefix_cache_hits"] - before["external_prefix_cache_hits"]
    assert loaded == 6 * BLOCK, "every full block of the prompt but the last token's is loaded"
    assert after["prefix_cache_hits"] == before["prefix_cache_hits"], "not from the pool"
    by_source = {
        source: after[f"prompt_tokens_{source}"] - before[f"prompt_tokens_{source}"]
        for source in ("local_compute", "local_cache_hit", "external_kv_transfer")
    }
    assert by_source == {
        "local_compute": 100 - 6 * BLOCK,
        "local_cache_hit": 0,
        "external_kv_transfer": 6 * BLOCK,
    }
    assert after["num_computed_tokens_total"] - before["num_computed_tokens_total"] == (
        100 - 6 * BLOCK + len(expected[0]) - 1
    )


def test_engines_of_a_node_share_the_tier_and_a_new_one_starts_warm(
    first: LLM, tiny_llama: str
) -> None:
    batch = prompts(2, 2)
    expected = tokens(first, batch, GREEDY)
    evict_all(first, 2)
    beside = engine(tiny_llama)  # a second replica on the node, while the first runs
    try:
        assert tokens(beside, batch[:1], GREEDY) == expected[:1]
        assert beside.stats()["external_prefix_cache_hits"] == 6 * BLOCK
    finally:
        beside.shutdown()
    first.shutdown()
    restarted = engine(tiny_llama)  # started after every engine that filled the tier exited
    try:
        assert tokens(restarted, batch[1:], GREEDY) == expected[1:]
        assert restarted.stats()["external_prefix_cache_hits"] == 6 * BLOCK
    finally:
        restarted.shutdown()


def test_preemption_through_the_tier_changes_no_output(tiny_llama: str) -> None:
    batch = prompts(3, 6, length=70)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    roomy = engine(tiny_llama, num_kv_blocks=256, kv_offloading_size=0)
    try:
        expected = tokens(roomy, batch, params)
        assert "host_tier_num_blocks" not in roomy.stats(), "size 0: no tier"
    finally:
        roomy.shutdown()
    tight = engine(tiny_llama, num_kv_blocks=16, max_num_seqs=6)
    try:
        assert tokens(tight, batch, params) == expected
        stats = tight.stats()
        assert stats["num_preemptions"] > 0 and stats["host_tier_saved_blocks"] > 0
    finally:
        tight.shutdown()


def test_each_rank_saves_and_loads_its_shard(ray_cluster, tiny_llama: str) -> None:
    """At TP = 2 (worker actors), a block's slot holds both ranks' shards of it."""
    (prompt,) = prompts(4, 1)
    tp2 = engine(tiny_llama, tensor_parallel_size=2)
    try:
        expected = tokens(tp2, [prompt], SEEDED)
        evict_all(tp2, 4)
        assert tokens(tp2, [prompt], SEEDED) == expected
        assert tp2.stats()["external_prefix_cache_hits"] == 6 * BLOCK
    finally:
        tp2.shutdown()


def test_written_through_a_prompt_is_in_the_tier_before_any_eviction(tiny_llama: str) -> None:
    """With write-through, the engine beside finds the blocks its neighbour still holds in its
    pool (as a replica a request migrates to, or a restarted one, would)."""
    (prompt,) = prompts(5, 1)
    writer = engine(tiny_llama, num_kv_blocks=256, kv_offloading_write_through=True)
    reader = engine(tiny_llama, num_kv_blocks=256)
    try:
        expected = tokens(writer, [prompt], SEEDED)
        assert writer.stats()["host_tier_saved_blocks"] >= 6
        assert tokens(reader, [prompt], SEEDED) == expected
        assert reader.stats()["external_prefix_cache_hits"] == 6 * BLOCK
    finally:
        writer.shutdown()
        reader.shutdown()


@pytest.mark.parametrize("chunk", [1024, 2], ids=["one-step", "in-steps-of-2"])
def test_an_engine_shut_down_leaves_its_pool_in_the_tier(
    tiny_llama: str, chunk: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without write-through, nothing evicted: the blocks reach the tier when the engine shuts
    down (a drain, a redeploy, `LLM.shutdown`), and the engine after it starts warm."""
    monkeypatch.setattr(engine_core, "SAVE_CHUNK_BLOCKS", chunk)
    (prompt,) = prompts(7 + chunk, 1)
    llm = engine(tiny_llama, num_kv_blocks=256)
    try:
        expected = tokens(llm, [prompt], GREEDY)
        assert llm.stats()["host_tier_saved_blocks"] == 0
    finally:
        llm.shutdown()
    assert llm.stats()["host_tier_saved_blocks"] >= 6
    llm.shutdown()  # a second call does nothing
    after = engine(tiny_llama, num_kv_blocks=256)
    try:
        assert tokens(after, [prompt], GREEDY) == expected
        assert after.stats()["external_prefix_cache_hits"] == 6 * BLOCK
    finally:
        after.shutdown()


def test_blocks_the_host_tier_drops_come_back_from_disk_and_outlive_it(
    tiny_llama: str, tmp_path, monkeypatch
) -> None:
    """A host tier of ten blocks over a disk tier: a prompt both the pool and the host tier
    dropped loads from disk, token for token; and after the host tier's file is gone (a
    reboot clears /dev/shm), a new engine still finds it there."""
    monkeypatch.setenv(TIER_DIR_ENV, str(tmp_path / "shm"))  # a host tier of this test's own
    ten_blocks_gib = 10 * BLOCK_BYTES / 2**30
    disk = {"kv_offloading_size": ten_blocks_gib, "kv_disk_dir": str(tmp_path / "disk")}
    (prompt,) = prompts(6, 1)
    llm = engine(tiny_llama, **disk)
    try:
        assert llm.stats()["host_tier_capacity_blocks"] == 10
        expected = tokens(llm, [prompt], GREEDY)
        evict_all(llm, 6)
        before = llm.stats()
        assert before["disk_tier_saved_blocks"] > 0
        assert tokens(llm, [prompt], GREEDY) == expected
        after = llm.stats()
        assert after["disk_tier_loaded_blocks"] - before["disk_tier_loaded_blocks"] == 6
        assert after["disk_tier_load_seconds"] > before["disk_tier_load_seconds"]
    finally:
        llm.shutdown()
    for path in (tmp_path / "shm").iterdir():
        path.unlink()
    rebooted = engine(tiny_llama, **disk)
    try:
        assert tokens(rebooted, [prompt], GREEDY) == expected
        assert rebooted.stats()["disk_tier_loaded_blocks"] == 6
    finally:
        rebooted.shutdown()


def test_a_serving_engine_saves_its_pool_once_and_never_beside_a_run(tiny_llama: str) -> None:
    """`AsyncEngine.save_cache_to_tier` (Serve's exit hook): not while a run of steps is in
    flight (its requests' steps are the loop's), and once: a second call saves nothing."""
    import asyncio
    import time

    from pagedray.engine.async_engine import AsyncEngine
    from pagedray.engine.config import EngineConfig
    from pagedray.engine.engine_factory import build_engine
    from pagedray.engine.output_processor import OutputProcessor

    config = EngineConfig(
        model=tiny_llama, num_kv_blocks=256, num_threads=1, kv_offloading_size=0.01
    )
    core, _executor, tokenizer, _validator = build_engine(config)
    engine = AsyncEngine(core, OutputProcessor(tokenizer))
    (prompt,) = prompts(9, 1)

    async def serve_one() -> None:
        async for _ in engine.add_request("r", prompt["prompt_token_ids"], GREEDY):
            pass

    asyncio.run(serve_one())
    engine._runner.started = time.monotonic()  # as while a run is in flight
    assert engine.save_cache_to_tier(10.0) == 0
    engine._runner.started = None
    assert engine.save_cache_to_tier(10.0) >= 6
    assert engine.save_cache_to_tier(10.0) == 0
