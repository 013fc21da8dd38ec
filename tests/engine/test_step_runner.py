"""Runs of steps on the compute thread (`StepRunner`), alone and under `AsyncEngine` as a serving
engine drives them (no tokenizer: token ids only): a run goes on while nothing waits for the
engine, and ends after the step in which something came (a request, an abort, a deadline, a
failure), without changing a token."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from pagedray.engine.async_engine import AsyncEngine
from pagedray.engine.config import EngineConfig
from pagedray.engine.engine_factory import build_engine
from pagedray.engine.output_processor import OutputProcessor
from pagedray.engine.request_errors import EngineDeadError, RequestTimeoutError
from pagedray.engine.step_runner import FinishedStep, StepRunner
from pagedray.engine.wire import RequestStepOutput
from pagedray.scheduler.engine_core import EngineCore
from pagedray.scheduler.request import EngineRequest
from pagedray.scheduler.sampling_params import SamplingParams
from pagedray.workers.compute_thread import compute_thread

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
LONG = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
PROMPTS = ([5, 9, 13], [7, 7, 21, 30, 2], [11])


def _core(model: str, **overrides: Any) -> EngineCore:
    config = EngineConfig(model=model, num_kv_blocks=64, num_threads=1, **overrides)
    return build_engine(config)[0]


def _served(model: str, **overrides: Any) -> AsyncEngine:
    """As the engine deployment builds it: token ids only, so runs go on across steps."""
    config = EngineConfig(model=model, num_kv_blocks=64, num_threads=1, **overrides)
    core = build_engine(config)[0]
    timeout_s = config.request_timeout_s or None
    return AsyncEngine(core, OutputProcessor(None), request_timeout_s=timeout_s)


def _counting_runs(engine: AsyncEngine) -> list[int]:
    """Wraps the engine's runner: each run's number of steps, appended as the run ends."""
    runner, steps_by_run = engine._runner, []
    run = runner.run

    def counted(loop: Any, hand_over: Any, may_go_on: Any) -> FinishedStep:
        first = engine.core.num_steps
        try:
            return run(loop, hand_over, may_go_on)
        finally:
            steps_by_run.append(engine.core.num_steps - first)

    runner.run = counted  # type: ignore[method-assign]
    return steps_by_run


async def _drain(stream: Any) -> list[RequestStepOutput]:
    return [output async for output in stream]


def _tokens(outputs: list[RequestStepOutput]) -> list[int]:
    return [t for o in outputs for d in o.deltas for t in d.token_ids]


def _tokens_by_request(steps: list[FinishedStep]) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    for step in steps:
        for output in step.outputs:
            tokens.setdefault(output.req_id, []).extend(output.new_token_ids)
    return tokens


def _core_with_requests(model: str) -> EngineCore:
    core = _core(model)
    for i, prompt in enumerate(PROMPTS):
        core.add_request(EngineRequest(f"r{i}", list(prompt), GREEDY))
    return core


def test_a_run_hands_over_every_step_but_its_last_token_exact(tiny_llama: str) -> None:
    """One run serves three requests to their end, each step handed to the loop as it ends;
    the tokens are those of the same engine given one step a run."""

    async def in_one_run() -> tuple[list[FinishedStep], int]:
        core = _core_with_requests(tiny_llama)
        runner, handed = StepRunner(core), []
        loop = asyncio.get_running_loop()
        last = await loop.run_in_executor(
            compute_thread(), runner.run, loop, handed.append, lambda: True
        )
        return [*handed, last], core.num_steps

    async def one_step_a_run() -> list[FinishedStep]:
        core = _core_with_requests(tiny_llama)
        runner, loop, steps = StepRunner(core), asyncio.get_running_loop(), []
        while core.has_unfinished_requests():
            steps.append(
                await loop.run_in_executor(
                    compute_thread(), runner.run, loop, _unexpected, lambda: False
                )
            )
        return steps

    together, num_steps = asyncio.run(in_one_run())
    apart = asyncio.run(one_step_a_run())
    assert len(together) == num_steps == len(apart) >= 8  # every step, in order, none lost
    tokens = _tokens_by_request(together)
    assert tokens == _tokens_by_request(apart)
    assert sorted(map(len, tokens.values())) == [8, 8, 8]


def _unexpected(step: FinishedStep) -> None:
    raise AssertionError("a run of one step hands nothing over")


def test_a_run_ends_after_the_step_in_which_something_came(tiny_llama: str) -> None:
    answers = iter([True, True, False])

    async def run() -> tuple[int, int, dict[str, Any]]:
        core = _core(tiny_llama)
        core.add_request(EngineRequest("long", [5, 9, 13], LONG))
        runner, handed = StepRunner(core), []
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(
            compute_thread(), runner.run, loop, handed.append, lambda: next(answers)
        )
        return core.num_steps, len(handed), core.stats()

    num_steps, num_handed, stats = asyncio.run(run())
    assert (num_steps, num_handed) == (3, 2)
    assert stats["num_running"] == 1  # unfinished: the loop gets its turn


def test_served_requests_run_in_runs_and_match_one_at_a_time(tiny_llama: str) -> None:
    async def run() -> tuple[list[list[int]], list[list[int]], list[int]]:
        engine = _served(tiny_llama)
        alone = [
            _tokens(await _drain(engine.add_request(f"a{i}", list(p), GREEDY)))
            for i, p in enumerate(PROMPTS)
        ]
        steps_by_run = _counting_runs(engine)
        together = await asyncio.gather(
            *(_drain(engine.add_request(f"b{i}", list(p), GREEDY)) for i, p in enumerate(PROMPTS))
        )
        assert engine.stats()["num_free_blocks"] == 64
        await engine.shutdown()
        return alone, [_tokens(outputs) for outputs in together], steps_by_run

    alone, together, steps_by_run = asyncio.run(run())
    assert together == alone and all(len(ids) == 8 for ids in alone)
    assert max(steps_by_run) > 1  # steps ran back to back, not one hand-off each


def test_a_request_arriving_mid_run_joins_at_the_next_step(tiny_llama: str) -> None:
    async def run() -> tuple[list[int], list[int], bool]:
        engine = _served(tiny_llama)
        alone = _tokens(await _drain(engine.add_request("alone", [7, 7, 21], GREEDY)))
        long_stream = engine.add_request("long", [5, 9, 13], LONG)
        await long_stream.__anext__()
        joined = await _drain(engine.add_request("joined", [7, 7, 21], GREEDY))
        long_running = engine.stats()["num_running"] == 1  # joined well before long ended
        await long_stream.aclose()
        await engine.shutdown()
        return alone, _tokens(joined), long_running

    alone, joined, long_running = asyncio.run(run())
    assert joined == alone and long_running


def test_an_abort_mid_run_frees_the_blocks_after_the_running_step(tiny_llama: str) -> None:
    async def run() -> tuple[dict[str, Any], int]:
        engine = _served(tiny_llama)
        stream = engine.add_request("long", [5, 9, 13], LONG, stream_interval=1)
        for _ in range(3):
            await stream.__anext__()
        await stream.aclose()
        await asyncio.sleep(0.1)
        stats = engine.stats()
        await engine.shutdown()
        return stats, engine.core.num_steps

    stats, num_steps = asyncio.run(run())
    assert (stats["num_free_blocks"], stats["num_running"], stats["num_requests"]) == (64, 0, 0)
    assert num_steps < 100  # the run ended at the abort, not at max_tokens


def test_a_deadline_mid_run_aborts_and_frees(tiny_llama: str) -> None:
    async def run() -> dict[str, Any]:
        engine = _served(tiny_llama, request_timeout_s=0.3)
        endless = SamplingParams(max_tokens=None, ignore_eos=True)
        with pytest.raises(RequestTimeoutError):
            await _drain(engine.add_request("slow", [5, 9, 13], endless))
        await asyncio.sleep(0.1)
        stats = engine.stats()
        await engine.shutdown()
        return stats

    stats = asyncio.run(run())
    assert (stats["num_free_blocks"], stats["num_running"], stats["num_requests"]) == (64, 0, 0)


def test_a_step_failing_mid_run_fails_the_requests_and_health(tiny_llama: str) -> None:
    async def run() -> tuple[dict[str, Any], list[int]]:
        engine = _served(tiny_llama)
        real_step, steps = engine.core.step, []

        def failing_on_the_fifth(streaming: bool = True) -> list[Any]:
            steps.append(len(steps))
            if len(steps) == 5:
                raise RuntimeError("boom")
            return real_step(streaming)

        engine.core.step = failing_on_the_fifth  # type: ignore[method-assign]
        stream = engine.add_request("r", [5, 9, 13], LONG, stream_interval=1)
        received = []
        with pytest.raises(EngineDeadError, match="boom"):
            async for output in stream:
                received.extend(output.deltas[0].token_ids if output.deltas else [])
        return engine.health(), received

    health, received = asyncio.run(run())
    assert not health["healthy"] and "boom" in health["error"]
    assert len(received) == 4  # the four steps before the failure reached the stream


def test_with_stop_strings_to_find_each_run_is_one_step(tiny_llama: str) -> None:
    """Given a tokenizer, the engine finds stop strings, which must stop a sequence before the
    next plan: the loop gets a turn after every step."""

    async def run() -> list[int]:
        config = EngineConfig(model=tiny_llama, num_kv_blocks=64, num_threads=1)
        core, _executor, tokenizer, _validator = build_engine(config)
        engine = AsyncEngine(core, OutputProcessor(tokenizer))
        steps_by_run = _counting_runs(engine)
        await _drain(engine.add_request("r", [5, 9, 13], GREEDY))
        await engine.shutdown()
        return steps_by_run

    steps_by_run = asyncio.run(run())
    assert len(steps_by_run) >= 8 and set(steps_by_run) == {1}


def test_a_hand_over_failing_on_the_loop_kills_the_engine_loudly(tiny_llama: str) -> None:
    """A step handed over mid-run whose outputs cannot be made: the requests fail and health
    says why, as when a step fails, rather than the loop logging it and serving on with
    outputs lost."""

    async def run() -> dict[str, Any]:
        engine = _served(tiny_llama)
        process, calls = engine.output_processor.process, []

        def failing_on_the_third(outputs: list[Any]) -> Any:
            calls.append(len(outputs))
            if len(calls) == 3:
                raise RuntimeError("bad output")
            return process(outputs)

        engine.output_processor.process = failing_on_the_third  # type: ignore[method-assign]
        with pytest.raises(EngineDeadError, match="bad output"):
            await _drain(engine.add_request("r", [5, 9, 13], LONG, stream_interval=1))
        with pytest.raises(EngineDeadError):
            engine.add_request("next", [5, 9, 13], GREEDY)
        return engine.health()

    health = asyncio.run(run())
    assert not health["healthy"] and "bad output" in health["error"]


def test_shutdown_mid_run_stops_the_compute_thread_stepping(tiny_llama: str) -> None:
    async def run() -> tuple[int, int]:
        engine = _served(tiny_llama)
        stream = engine.add_request("long", [5, 9, 13], LONG, stream_interval=1)
        for _ in range(3):
            await stream.__anext__()
        await engine.shutdown()
        at_shutdown = engine.core.num_steps
        await asyncio.sleep(0.3)  # tens of steps, had the run gone on
        return at_shutdown, engine.core.num_steps

    at_shutdown, later = asyncio.run(run())
    assert later - at_shutdown <= 1  # at most the step that was running


def test_health_stays_healthy_through_a_run_longer_than_the_stuck_limit(tiny_llama: str) -> None:
    """Stuck detection times each step, not the run: a long run of quick steps is healthy."""

    async def run() -> tuple[list[bool], int]:
        config = EngineConfig(model=tiny_llama, num_kv_blocks=64, num_threads=1)
        engine = AsyncEngine(build_engine(config)[0], OutputProcessor(None), stuck_after_s=0.2)
        steps_by_run = _counting_runs(engine)
        task = asyncio.create_task(_drain(engine.add_request("long", [5, 9, 13], LONG)))
        seen = []
        while not task.done():
            seen.append(engine.health()["healthy"])
            await asyncio.sleep(0.05)
        await task
        await engine.shutdown()
        return seen, max(steps_by_run)

    seen, longest_run = asyncio.run(run())
    assert len(seen) > 4 and all(seen)  # the run lasted well past stuck_after_s
    assert longest_run > 100
