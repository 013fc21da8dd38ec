"""Pulls between real engines (scheduler/kv_transfer.py, engine/kv_handoffs.py): a prompt prefix
one engine caches in its pool goes to another engine through the tier, token for token; an
engine on another node's tier gets the bytes and writes them into its own; a loaded holder
answers within a step of the run in flight."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest

from pagedray.engine.async_engine import AsyncEngine
from pagedray.engine.config import EngineConfig
from pagedray.engine.engine_factory import build_engine
from pagedray.engine.output_processor import OutputProcessor
from pagedray.scheduler.prefix_hash import compute_block_hashes
from pagedray.scheduler.sampling_params import SamplingParams
from pagedray.workers.host_kv_buffer import TIER_DIR_ENV

BLOCK = 16
SALT = __name__
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def serving_engine(model: str, tier_dir: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncEngine:
    """An engine as a replica runs it, its host tier in `tier_dir` (the node it stands for)."""
    monkeypatch.setenv(TIER_DIR_ENV, str(tier_dir))
    config = EngineConfig(model=model, num_kv_blocks=256, num_threads=1, kv_offloading_size=0.01)
    core, _executor, tokenizer, _validator = build_engine(config)
    return AsyncEngine(core, OutputProcessor(tokenizer))


def prompt_of(seed: int, length: int = 100) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 250) for _ in range(length)]


async def generate(
    engine: AsyncEngine, request_id: str, prompt: list[int], params: SamplingParams = GREEDY
) -> tuple[list[int], int]:
    """The request's tokens and cached prompt tokens."""
    token_ids: list[int] = []
    cached = 0
    async for output in engine.add_request(request_id, prompt, params, cache_salt=SALT):
        cached = max(cached, output.num_cached_tokens)
        for delta in output.deltas:
            token_ids += delta.token_ids
    return token_ids, cached


def hashes_of(prompt: list[int]) -> list[bytes]:
    return compute_block_hashes(prompt, BLOCK, SALT, [])


@pytest.mark.parametrize("other_node", [False, True], ids=["same-node", "other-node"])
def test_a_prefix_pulled_from_the_engine_caching_it_comes_back_token_for_token(
    tiny_llama: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, other_node: bool
) -> None:
    """The holder computed the prompt (its blocks are in its pool only: nothing was evicted
    and nothing written through); the puller, given what the holder exports, computes only
    the last partial block's tokens and answers as the holder did."""
    holder = serving_engine(tiny_llama, tmp_path / "node-a", monkeypatch)
    puller_dir = tmp_path / ("node-b" if other_node else "node-a")
    puller = serving_engine(tiny_llama, puller_dir, monkeypatch)
    prompt = prompt_of(1 + other_node)

    async def scenario() -> None:
        expected, _ = await generate(holder, "first", prompt)
        export = await holder.export_kv(hashes_of(prompt), with_bytes=other_node)
        assert export.block_hashes == hashes_of(prompt)[:6]
        assert (export.payloads is not None) == other_node
        puller.give_kv(export)
        tokens, cached = await generate(puller, "pulled", prompt)
        assert tokens == expected
        assert cached == 6 * BLOCK

    asyncio.run(scenario())
    assert holder.stats()["num_kv_exported_blocks"] == 6
    stats = puller.stats()
    assert stats["num_kv_imported_blocks"] == (6 if other_node else 0)
    assert stats["external_prefix_cache_hits"] == 6 * BLOCK
    assert stats["prompt_tokens_external_kv_transfer"] == 6 * BLOCK


def test_a_loaded_holder_answers_within_its_run_and_only_what_it_caches(
    tiny_llama: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pull asked while the holder runs a long request is answered before that request ends
    (the run stops at the next step); blocks the holder never had are not in the answer."""
    holder = serving_engine(tiny_llama, tmp_path / "node-a", monkeypatch)
    prompt = prompt_of(3)
    long = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
    unknown = hashes_of(prompt_of(4))

    async def scenario() -> None:
        await generate(holder, "first", prompt)
        running = asyncio.ensure_future(generate(holder, "long", prompt + [7] * 40, long))
        while holder.core.num_steps < 5:  # the long request runs
            await asyncio.sleep(0.005)
        export = await holder.export_kv(hashes_of(prompt) + unknown, with_bytes=True)
        assert not running.done()
        assert export.block_hashes == hashes_of(prompt)[:6]
        assert export.payloads is not None and len(export.payloads) == 6
        none = await holder.export_kv(unknown, with_bytes=False)
        assert none.block_hashes == []
        tokens, _ = await running
        assert len(tokens) == 400

    asyncio.run(scenario())


def test_a_failed_hand_off_costs_the_puller_a_prefill_and_never_the_engine(
    tiny_llama: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A block of the wrong size given to an engine is not written (the request computes its
    prompt); an export whose read fails answers with the error; both engines serve on."""
    from pagedray.engine import kv_handoffs
    from pagedray.scheduler.kv_transfer import KVExport

    holder = serving_engine(tiny_llama, tmp_path / "node-a", monkeypatch)
    puller = serving_engine(tiny_llama, tmp_path / "node-b", monkeypatch)
    prompt = prompt_of(5)

    def unreadable(*_: object) -> KVExport:
        raise OSError("the tier file went away")

    async def scenario() -> None:
        expected, _ = await generate(holder, "first", prompt)
        puller.give_kv(KVExport(hashes_of(prompt)[:6], [b"short"] * 6))
        tokens, cached = await generate(puller, "computed", prompt)
        assert (tokens, cached) == (expected, 0)
        monkeypatch.setattr(kv_handoffs, "export_from_tier", unreadable)
        with pytest.raises(OSError, match="went away"):
            await holder.export_kv(hashes_of(prompt), with_bytes=True)
        assert (await generate(holder, "after", prompt))[0] == expected
        assert holder.health()["healthy"] and puller.health()["healthy"]

    asyncio.run(scenario())
    assert puller.stats()["num_kv_imported_blocks"] == 0
