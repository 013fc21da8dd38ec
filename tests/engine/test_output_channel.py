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
from pagedray.engine.request_errors import RequestAbortedError
from pagedray.engine.wire import RequestStepOutput
from pagedray.scheduler.sampling_params import SamplingParams


def _output(request_id: str, finished: bool = False) -> RequestStepOutput:
    return RequestStepOutput(request_id, finished=finished)


async def _next_batch(batches: Any) -> list[str]:
    batch = await asyncio.wait_for(batches.__anext__(), 5.0)
    return [output.request_id for output in batch]


def test_one_batch_per_wake_up_and_outputs_held_until_subscribed() -> None:
    async def run() -> None:
        channels = OutputChannels(abort=lambda request_id: None)
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
        channels = OutputChannels(abort=lambda request_id: None)
        channel = channels.open("c")
        channel.request_ids.update({"aborted", "finished"})
        channel.put(_output("aborted"))
        channel.put(_output("finished", finished=True))
        channels.end_request("c", "aborted", discard_outputs=True)
        channels.end_request("c", "finished", discard_outputs=False)
        batches = channels.subscribe("c")
        assert await _next_batch(batches) == ["finished"]
        await batches.aclose()

    asyncio.run(run())


def test_a_subscription_that_ends_aborts_what_is_on_its_channel() -> None:
    """The ingress went away or the stream broke: its requests are aborted, not left running
    with nobody to read them (they fail through their own calls)."""

    async def run() -> list[str]:
        aborted: list[str] = []
        channels = OutputChannels(abort=aborted.append)
        channels.open("c").request_ids.update({"a", "b"})
        batches = channels.subscribe("c")
        reading = asyncio.ensure_future(batches.__anext__())
        await asyncio.sleep(0.01)
        reading.cancel()
        await asyncio.gather(reading, return_exceptions=True)
        await batches.aclose()
        assert len(channels) == 0
        return sorted(aborted)

    assert asyncio.run(run()) == ["a", "b"]


def test_a_new_subscription_takes_over_a_stale_one() -> None:
    async def run() -> None:
        aborted: list[str] = []
        channels = OutputChannels(abort=aborted.append)
        channel = channels.open("c")
        channel.request_ids.add("a")
        stale = channels.subscribe("c")
        reading = asyncio.ensure_future(stale.__anext__())
        await asyncio.sleep(0.01)
        fresh = channels.subscribe("c")
        taking_over = asyncio.ensure_future(_next_batch(fresh))
        await asyncio.sleep(0.01)  # the take-over happens on the new subscriber's first read
        channel.put(_output("a"))
        assert await taking_over == ["a"]
        with pytest.raises(StopAsyncIteration):  # the stale one ended, closing nothing
            await asyncio.wait_for(reading, 5.0)
        assert aborted == [] and len(channels) == 1  # it had sent nothing: nothing lost
        # Another take-over, after batches went out: they may not have arrived.
        channel.put(_output("a"))
        newest = channels.subscribe("c")
        reading = asyncio.ensure_future(newest.__anext__())
        await asyncio.sleep(0.01)
        assert aborted == ["a"]
        reading.cancel()
        await asyncio.gather(reading, return_exceptions=True)
        await newest.aclose()
        await fresh.aclose()

    asyncio.run(run())


def test_an_idle_subscription_ends_itself_and_an_unread_channel_expires() -> None:
    async def run() -> list[str]:
        aborted: list[str] = []
        channels = OutputChannels(aborted.append, idle_s=0.05, unsubscribed_ttl_s=0.1)
        channels.open("idle")
        batches = [batch async for batch in channels.subscribe("idle")]  # no request: ends
        assert batches == [] and len(channels) == 0
        channels.open("busy").request_ids.add("r")
        reading = asyncio.ensure_future(channels.subscribe("busy").__anext__())
        await asyncio.sleep(0.01)  # waiting for outputs, with no idle timer while "r" runs
        channels.end_request("busy", "r", discard_outputs=False)
        with pytest.raises(StopAsyncIteration):  # its last request ended: idle, then gone
            await asyncio.wait_for(reading, 5.0)
        assert len(channels) == 0
        channels.open("forgotten").request_ids.add("x")  # nobody ever subscribes
        await asyncio.sleep(0.3)
        assert len(channels) == 0
        return aborted

    assert asyncio.run(run()) == ["x"]


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
        channels = OutputChannels(async_engine.abort)
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


def test_a_closed_channel_aborts_its_running_request_in_the_engine(tiny_llama: str) -> None:
    config = EngineConfig(model=tiny_llama, num_kv_blocks=32, num_threads=1)
    engine, _executor, tokenizer, _validator = build_engine(config)
    params = SamplingParams(temperature=0.0, max_tokens=500, ignore_eos=True)

    async def run() -> list[Any]:
        async_engine = AsyncEngine(engine, OutputProcessor(tokenizer))
        channels = OutputChannels(async_engine.abort)
        channel = channels.open("c")
        failures: list[Any] = []

        def sink(item: Any) -> None:
            if isinstance(item, BaseException):
                failures.append(item)
            else:
                channel.put(item)

        channel.request_ids.add("long")
        async_engine.add_request("long", [1, 2, 3], params, sink=sink)
        batches = channels.subscribe("c")
        assert await _next_batch(batches) == ["long"]
        await batches.aclose()  # the subscriber went away
        for _ in range(100):
            await asyncio.sleep(0.01)
            if not engine.has_unfinished_requests():
                break
        assert not engine.has_unfinished_requests()
        await async_engine.shutdown()
        return failures

    failures = asyncio.run(run())
    assert [type(f) for f in failures] == [RequestAbortedError]
