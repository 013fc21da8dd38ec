"""Output channels: a step's outputs for many requests as one batch, held until read."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from pagedray.engine.async_engine import AsyncEngine
from pagedray.engine.config import EngineConfig
from pagedray.engine.engine_factory import build_engine
from pagedray.engine.output_channel import OutputChannels
from pagedray.engine.output_processor import OutputProcessor
from pagedray.engine.step_outputs import RequestStepOutput
from pagedray.scheduler.sampling_params import SamplingParams


def _output(request_id: str, finished: bool = False) -> RequestStepOutput:
    return RequestStepOutput(request_id, finished=finished)


async def _next_batch(batches: Any) -> list[str]:
    batch = await asyncio.wait_for(batches.__anext__(), 5.0)
    return [output.request_id for output in batch]


def test_one_batch_per_wake_up_and_outputs_held_until_subscribed() -> None:
    async def run() -> None:
        channels = OutputChannels()
        channel = channels.open("c")
        channel.request_ids.update({"a", "b"})
        channel.put(_output("a"))  # before anyone subscribed: held
        channel.put(_output("b"))
        batches = channels.subscribe("c")
        assert await _next_batch(batches) == ["a", "b"]
        channel.put(_output("b"))
        channel.put(_output("a", finished=True))
        assert await _next_batch(batches) == ["b", "a"]
        await batches.aclose()

    asyncio.run(run())


def test_an_aborted_requests_unread_outputs_are_dropped_a_finished_ones_kept() -> None:
    async def run() -> None:
        channels = OutputChannels()
        channel = channels.open("c")
        channel.request_ids.update({"aborted", "finished"})
        channel.put(_output("aborted"))
        channel.put(_output("finished", finished=True))
        channels.end_request("c", "aborted", discard_outputs=True)
        channels.end_request("c", "finished", discard_outputs=False)
        assert len(channels) == 1  # unread outputs keep it for its subscriber
        batches = channels.subscribe("c")
        assert await _next_batch(batches) == ["finished"]
        await batches.aclose()
        assert len(channels) == 0  # no subscriber, no request, nothing unread: gone

    asyncio.run(run())


def test_one_subscriber_at_a_time_and_a_channel_outlives_a_reconnect() -> None:
    async def run() -> None:
        channels = OutputChannels()
        channels.open("c").request_ids.add("a")
        first = channels.subscribe("c")
        reading = asyncio.ensure_future(first.__anext__())
        await asyncio.sleep(0)
        with pytest.raises(RuntimeError, match="already has a subscriber"):
            await channels.subscribe("c").__anext__()
        reading.cancel()
        await asyncio.gather(reading, return_exceptions=True)
        await first.aclose()
        channels.open("c").put(_output("a"))  # while nobody reads: held, channel kept
        second = channels.subscribe("c")
        assert await _next_batch(second) == ["a"]
        await second.aclose()

    asyncio.run(run())


def test_the_engine_sends_each_steps_outputs_as_one_batch(tiny_llama: str) -> None:
    """Three requests into one channel: one batch per step, the tokens of the plain streams."""
    config = EngineConfig(model=tiny_llama, num_kv_blocks=32, num_threads=1)
    engine, _executor, tokenizer, _validator = build_engine(config)
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]

    async def run() -> tuple[list[list[int]], list[list[RequestStepOutput]]]:
        async_engine = AsyncEngine(engine, OutputProcessor(tokenizer))
        alone = []
        for i, prompt in enumerate(prompts):
            stream = async_engine.add_request(f"alone{i}", prompt, params)
            alone.append([t async for o in stream for d in o.deltas for t in d.token_ids])
        channels = OutputChannels()
        channel = channels.open("c")
        for i, prompt in enumerate(prompts):
            channel.request_ids.add(f"c{i}")
            async_engine.add_request(f"c{i}", prompt, params, sink=channel.put)
        batches, finished = [], 0
        async for batch in channels.subscribe("c"):
            batches.append(batch)
            finished += sum(output.finished for output in batch)
            if finished == len(prompts):
                break
        await async_engine.shutdown()
        return alone, batches

    alone, batches = asyncio.run(run())
    # Admitted together, the three advance together: each batch holds one output of each.
    assert len(batches) == params.max_tokens
    assert all(sorted(o.request_id for o in batch) == ["c0", "c1", "c2"] for batch in batches)
    for i, tokens in enumerate(alone):
        got = [
            t
            for b in batches
            for o in b
            if o.request_id == f"c{i}"
            for d in o.deltas
            for t in d.token_ids
        ]
        assert got == tokens
