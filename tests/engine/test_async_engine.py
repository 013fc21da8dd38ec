"""`AsyncEngine` without Ray: a real tiny engine in-process, driven from asyncio."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest
import torch

from pagedray.engine import async_engine as async_engine_module
from pagedray.engine.admission import default_max_num_waiting
from pagedray.engine.async_engine import AsyncEngine
from pagedray.engine.config import EngineConfig
from pagedray.engine.engine_factory import build_engine
from pagedray.engine.output_processor import OutputProcessor
from pagedray.engine.request_errors import (
    EngineDeadError,
    EngineOverloadedError,
    RequestFailedError,
    RequestTimeoutError,
)
from pagedray.engine.step_outputs import merge_step_outputs
from pagedray.engine.wire import RequestStepOutput
from pagedray.scheduler.request_failure import FailureKind
from pagedray.scheduler.sampling_params import SamplingParams
from pagedray.workers.cpu_threads import PROMPT_HEAVY_TOKENS_PER_SEQUENCE

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def _engine(model: str, **overrides: Any) -> tuple[AsyncEngine, Any]:
    config = EngineConfig(model=model, num_kv_blocks=32, num_threads=1, **overrides)
    engine, _executor, tokenizer, _validator = build_engine(config)
    async_engine = AsyncEngine(
        engine,
        OutputProcessor(tokenizer),
        stuck_after_s=0.2,
        request_timeout_s=config.request_timeout_s or None,
    )
    return async_engine, tokenizer


async def _drain(stream: Any) -> list[RequestStepOutput]:
    return [output async for output in stream]


def _text(outputs: list[RequestStepOutput], index: int = 0) -> str:
    return "".join(d.text for o in outputs for d in o.deltas if d.index == index)


def test_concurrent_requests_match_sequential(tiny_llama: str) -> None:
    async def run() -> None:
        engine, tokenizer = _engine(tiny_llama)
        prompts = [tokenizer.encode(p) for p in ("one", "two three", "four five six")]
        alone = [
            await _drain(engine.add_request(f"a{i}", p, GREEDY)) for i, p in enumerate(prompts)
        ]
        together = await asyncio.gather(
            *(_drain(engine.add_request(f"b{i}", p, GREEDY)) for i, p in enumerate(prompts))
        )
        assert [_text(o) for o in together] == [_text(o) for o in alone]
        last = together[2][-1]
        # Tokens out only: the usage a client sees is counted where the text is made.
        assert last.finished and last.usage is None
        assert sum(len(d.token_ids) for o in together[2] for d in o.deltas) == 6
        assert engine.stats()["num_free_blocks"] == 32
        await engine.shutdown()

    asyncio.run(run())


def test_closing_a_stream_aborts_and_frees_blocks(tiny_llama: str) -> None:
    async def run() -> None:
        engine, tokenizer = _engine(tiny_llama)
        params = SamplingParams(max_tokens=500, ignore_eos=True)
        stream = engine.add_request("long", tokenizer.encode("hello"), params)
        await stream.__anext__()
        await stream.aclose()
        await asyncio.sleep(0.05)
        stats = engine.stats()
        assert (stats["num_free_blocks"], stats["num_requests"], stats["num_running"]) == (32, 0, 0)
        await engine.shutdown()

    asyncio.run(run())


def test_full_waiting_queue_refuses(tiny_llama: str) -> None:
    async def run() -> None:
        engine, tokenizer = _engine(tiny_llama, max_num_seqs=1, max_num_waiting=1)
        ids = tokenizer.encode("hi")
        first = engine.add_request("first", ids, SamplingParams(max_tokens=50, ignore_eos=True))
        await first.__anext__()  # running
        second = engine.add_request("second", ids, GREEDY)  # waiting
        with pytest.raises(EngineOverloadedError):
            engine.add_request("third", ids, GREEDY)
        await first.aclose()
        assert (await _drain(second))[-1].finished
        await engine.shutdown()

    asyncio.run(run())


def test_failing_step_fails_requests_and_kills_health(tiny_llama: str) -> None:
    async def run() -> None:
        engine, tokenizer = _engine(tiny_llama)

        def step(streaming: bool = True) -> list[Any]:
            raise RuntimeError("boom")

        engine.core.step = step  # type: ignore[method-assign]
        with pytest.raises(EngineDeadError, match="boom"):
            await _drain(engine.add_request("r", tokenizer.encode("hi"), GREEDY))
        health = engine.health()
        assert not health["healthy"] and "boom" in health["error"]
        with pytest.raises(EngineDeadError):
            engine.add_request("next", tokenizer.encode("hi"), GREEDY)

    asyncio.run(run())


def test_stuck_step_is_unhealthy(tiny_llama: str) -> None:
    async def run() -> None:
        engine, tokenizer = _engine(tiny_llama)
        release = threading.Event()
        real_step = engine.core.step

        def slow_step(streaming: bool = True) -> list[Any]:
            release.wait(5)
            return real_step(streaming)

        engine.core.step = slow_step  # type: ignore[method-assign]
        stream = engine.add_request("r", tokenizer.encode("hi"), GREEDY)
        task = asyncio.create_task(_drain(stream))
        await asyncio.sleep(0.4)  # past stuck_after_s=0.2
        health = engine.health()
        assert not health["healthy"] and "stuck" in health["error"]
        release.set()
        assert (await task)[-1].finished
        assert engine.health()["healthy"]
        await engine.shutdown()

    asyncio.run(run())


def test_a_step_far_slower_than_the_recent_ones_is_a_stall(
    tiny_llama: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`stalled` judges the running step against the slowest recent one (a hung collective
    shows long before `stuck_after_s`), and clears once the engine steps again."""
    monkeypatch.setattr(async_engine_module, "STALL_FLOOR_S", 0.3)
    monkeypatch.setattr(async_engine_module, "STALL_MIN_STEPS", 2)

    async def run() -> None:
        engine, tokenizer = _engine(tiny_llama)
        engine.stuck_after_s = 60.0
        assert await _drain(engine.add_request("warm", tokenizer.encode("hi"), GREEDY))
        assert engine._runner.slowest_s > 0 and engine.stalled() is None
        hang, real_step = threading.Event(), engine.core.step

        def hung_step(streaming: bool = True) -> list[Any]:
            hang.wait(10)
            return real_step(streaming)

        engine.core.step = hung_step  # type: ignore[method-assign]
        task = asyncio.create_task(_drain(engine.add_request("r", tokenizer.encode("hi"), GREEDY)))
        await asyncio.sleep(0.1)
        assert engine.stalled() is None  # not yet: within the floor
        await asyncio.sleep(0.4)
        assert "running for" in (engine.stalled() or "")
        assert engine.health()["healthy"]  # not stuck: Serve keeps the replica
        engine.core.step = real_step  # type: ignore[method-assign]
        hang.set()
        assert (await task)[-1].finished
        assert engine.stalled() is None
        await engine.shutdown()

    asyncio.run(run())


def test_merged_outputs_fold_each_choice(tiny_llama: str) -> None:
    """Merging a request's step outputs (coalescing, stream interval) gives one delta a choice,
    the same text, tokens and logprobs in order, and the last step's finish."""
    params = SamplingParams(temperature=1.0, seed=3, n=2, max_tokens=5, logprobs=1, ignore_eos=True)

    async def run() -> list[RequestStepOutput]:
        engine, tokenizer = _engine(tiny_llama)
        try:
            return await _drain(engine.add_request("m", tokenizer.encode("merge me"), params))
        finally:
            await engine.shutdown()

    outputs = asyncio.run(run())
    assert len(outputs) > 2  # several steps to merge
    merged = merge_step_outputs(outputs)
    assert merged.finished and merged.num_cached_tokens == outputs[-1].num_cached_tokens
    assert sorted(d.index for d in merged.deltas) == [0, 1]
    for delta in merged.deltas:
        steps = [d for o in outputs for d in o.deltas if d.index == delta.index]
        assert delta.text == _text(outputs, delta.index)
        assert delta.token_ids == [t for d in steps for t in d.token_ids]
        assert len(delta.token_ids) == 5
        assert delta.logprobs == [entry for d in steps for entry in d.logprobs]
        assert delta.finish_reason == steps[-1].finish_reason == "length"


def test_a_request_read_at_the_end_gets_each_choice_whole(tiny_llama: str) -> None:
    """Without a stream interval the engine makes no per-step output: the one it sends at the
    end holds each choice whole, the same text, tokens, logprobs and prompt logprobs as the same
    seeded request streamed."""
    params = SamplingParams(
        temperature=1.0, seed=5, n=2, max_tokens=7, logprobs=2, prompt_logprobs=1, ignore_eos=True
    )

    async def run() -> tuple[list[RequestStepOutput], list[RequestStepOutput]]:
        engine, tokenizer = _engine(tiny_llama)
        prompt = tokenizer.encode("all at once")
        try:
            streamed = await _drain(engine.add_request("s", prompt, params))
            whole = await _drain(engine.add_request("w", prompt, params, stream_interval=None))
            return streamed, whole
        finally:
            await engine.shutdown()

    streamed, whole = asyncio.run(run())
    assert len(streamed) > 2 and len(whole) == 1
    (output,) = whole
    expected = merge_step_outputs(streamed)
    assert output.finished and expected.finished
    by_index = {delta.index: delta for delta in expected.deltas}
    assert sorted(d.index for d in output.deltas) == [0, 1]
    for delta in output.deltas:
        want = by_index[delta.index]
        assert len(delta.token_ids) == 7
        assert (delta.text, delta.token_ids) == (want.text, want.token_ids)
        assert delta.logprobs == want.logprobs and delta.prompt_logprobs == want.prompt_logprobs
        assert (delta.finish_reason, delta.stop_reason) == (want.finish_reason, want.stop_reason)


def test_failed_request_ends_alone_and_the_engine_serves_on(tiny_llama: str) -> None:
    async def run() -> None:
        engine, tokenizer = _engine(tiny_llama)
        broken = SamplingParams(temperature=1.0, max_tokens=6, repetition_penalty=1.5)
        broken.repetition_penalty = 1e-300  # past validation: NaN probabilities in the step
        ids = tokenizer.encode("hello hello hello world")
        neighbour = asyncio.create_task(_drain(engine.add_request("ok", ids, GREEDY)))
        with pytest.raises(RequestFailedError, match="NaN") as failure:
            await _drain(engine.add_request("bad", ids, broken))
        assert failure.value.failure.kind is FailureKind.INVALID
        assert (await neighbour)[-1].finished
        assert engine.health()["healthy"]
        assert (await _drain(engine.add_request("after", ids, GREEDY)))[-1].finished
        stats = engine.stats()
        assert (stats["num_free_blocks"], stats["num_requests"]) == (32, 0)
        await engine.shutdown()

    asyncio.run(run())


def test_prompt_longer_than_the_pool_is_refused_before_acceptance(tiny_llama: str) -> None:
    async def run() -> None:
        engine, _ = _engine(tiny_llama)  # 32 blocks of 16: 512 tokens, below the model's limit
        assert engine.stats()["max_model_len"] == 512
        with pytest.raises(ValueError, match="^prompt: 600 tokens exceed max_model_len=512"):
            engine.add_request("long", [5] * 600, GREEDY)
        assert engine.stats()["num_requests"] == 0
        await engine.shutdown()

    asyncio.run(run())


def test_request_past_its_deadline_is_aborted_and_freed(tiny_llama: str) -> None:
    async def run() -> None:
        engine, tokenizer = _engine(tiny_llama, request_timeout_s=0.3)
        # Up to max_model_len (511 tokens, one step each): far longer than the deadline.
        endless = SamplingParams(max_tokens=None, ignore_eos=True)
        stream = engine.add_request("slow", tokenizer.encode("hi"), endless)
        with pytest.raises(RequestTimeoutError, match="0.3 s"):
            await _drain(stream)
        await asyncio.sleep(0.05)  # the abort lands before the next step
        stats = engine.stats()
        assert (stats["num_free_blocks"], stats["num_running"], stats["num_requests"]) == (32, 0, 0)
        assert (await _drain(engine.add_request("quick", tokenizer.encode("hi"), GREEDY)))[
            -1
        ].finished
        await engine.shutdown()

    asyncio.run(run())


def test_default_waiting_bound_refuses_and_reports_degraded(tiny_llama: str) -> None:
    assert default_max_num_waiting(max_num_seqs=256, num_kv_blocks=10_000) == 512
    assert default_max_num_waiting(max_num_seqs=256, num_kv_blocks=32) == 32

    async def run() -> None:
        engine, tokenizer = _engine(tiny_llama, max_num_seqs=1)
        assert engine.admission.max_num_waiting == 2  # two batches of one
        ids = tokenizer.encode("hi")
        long = SamplingParams(max_tokens=200, ignore_eos=True)
        running = engine.add_request("running", ids, long)
        await running.__anext__()
        waiting = [engine.add_request(f"w{i}", ids, GREEDY) for i in range(2)]
        health = engine.health()
        assert health["healthy"] and health["degraded"]
        with pytest.raises(EngineOverloadedError, match="waiting queue is full"):
            engine.add_request("refused", ids, GREEDY)
        await running.aclose()
        for stream in waiting:
            assert (await _drain(stream))[-1].finished
        assert engine.health()["degraded"]  # a refusal moments ago
        await engine.shutdown()

    asyncio.run(run())


def test_urgent_request_overtakes_a_full_batch_token_exact(tiny_llama: str) -> None:
    """Priority policy on the real tiny model: an urgent arrival preempts a long request of a
    full batch and finishes first; the preempted one's greedy tokens are unchanged."""
    long = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)

    async def run() -> None:
        engine, tokenizer = _engine(tiny_llama, max_num_seqs=2, scheduling_policy="priority")
        prompts = [tokenizer.encode(p) for p in ("first long one", "second long one")]
        alone = [
            await _drain(engine.add_request(f"solo{i}", p, long)) for i, p in enumerate(prompts)
        ]
        streams = [engine.add_request(f"long{i}", p, long) for i, p in enumerate(prompts)]
        firsts = [await stream.__anext__() for stream in streams]  # every seat taken
        finished: list[str] = []

        async def drain(name: str, stream: Any, first: Any = None) -> list[RequestStepOutput]:
            outputs = [first] if first is not None else []
            outputs += await _drain(stream)
            finished.append(name)
            return outputs

        tasks = [
            asyncio.create_task(drain(f"long{i}", s, first))
            for i, (s, first) in enumerate(zip(streams, firsts))
        ]
        urgent = engine.add_request("urgent", tokenizer.encode("hi"), GREEDY, priority=-1)
        await drain("urgent", urgent)
        together = await asyncio.gather(*tasks)
        assert finished[0] == "urgent"
        assert engine.stats()["num_preemptions"] >= 1
        assert [_tokens(o) for o in together] == [_tokens(o) for o in alone]
        await engine.shutdown()

    asyncio.run(run())


def _tokens(outputs: list[RequestStepOutput]) -> list[int]:
    return [t for o in outputs for d in o.deltas for t in d.token_ids]


def test_full_queue_gives_way_to_better_priority(tiny_llama: str) -> None:
    """Priority policy, queue full: a better-priority arrival displaces the worst request that
    has not started (503 for it); an equal one is refused; a running one is never touched."""

    async def run() -> None:
        engine, tokenizer = _engine(
            tiny_llama, max_num_seqs=1, max_num_waiting=1, scheduling_policy="priority"
        )
        ids = tokenizer.encode("hi")
        running = engine.add_request("running", ids, SamplingParams(max_tokens=30, ignore_eos=True))
        first = await running.__anext__()
        waiting = engine.add_request("waiting", ids, GREEDY, priority=0)
        with pytest.raises(EngineOverloadedError, match="waiting queue is full"):
            engine.add_request("equal", ids, GREEDY, priority=0)
        urgent = engine.add_request("urgent", ids, GREEDY, priority=-1)
        with pytest.raises(EngineOverloadedError, match="gave way"):
            await _drain(waiting)
        assert (await _drain(urgent))[-1].finished
        rest = await _drain(running)
        assert sum(len(d.token_ids) for o in [first, *rest] for d in o.deltas) == 30
        stats = engine.stats()
        assert (stats["num_free_blocks"], stats["num_requests"]) == (32, 0)
        await engine.shutdown()

    asyncio.run(run())


def test_fcfs_full_queue_refuses_whatever_the_priority(tiny_llama: str) -> None:
    async def run() -> None:
        engine, tokenizer = _engine(tiny_llama, max_num_seqs=1, max_num_waiting=1)
        ids = tokenizer.encode("hi")
        running = engine.add_request("running", ids, SamplingParams(max_tokens=30, ignore_eos=True))
        await running.__anext__()
        waiting = engine.add_request("waiting", ids, GREEDY)
        with pytest.raises(EngineOverloadedError, match="waiting queue is full"):
            engine.add_request("urgent", ids, GREEDY, priority=-1)
        await running.aclose()
        assert (await _drain(waiting))[-1].finished
        await engine.shutdown()

    asyncio.run(run())


@pytest.mark.parametrize(("serving", "every_core"), [(1, 2), (2, 3)])
def test_a_model_that_outweighs_the_serving_path_steps_on_every_core_while_streaming(
    tiny_llama: str, monkeypatch: pytest.MonkeyPatch, serving: int, every_core: int
) -> None:
    """The rank judges the reserve as it starts: the tiny model keeps it; one judged heavy
    (its projections on every core save more than the serving path costs) runs every step on
    every core, streamed or not, to the same tokens."""
    from pagedray.workers import worker as worker_module

    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    judged: list[tuple[float, int, int, int]] = []

    def heavy(work_s: float, rows: int, serving_threads: int, all_threads: int) -> bool:
        judged.append((work_s, rows, serving_threads, all_threads))
        return False

    async def streamed_steps(engine: AsyncEngine, prompt: list[int]) -> tuple[set[int], Any]:
        runner = engine.core.executor.worker.runner
        execute, threads_by_step = runner.execute_model, []

        def counting_threads(plan: Any) -> Any:
            threads_by_step.append(torch.get_num_threads())
            return execute(plan)

        runner.execute_model = counting_threads
        tokens = _tokens(await _drain(engine.add_request("streamed", prompt, params)))
        await engine.shutdown()
        return set(threads_by_step), tokens

    def build() -> tuple[AsyncEngine, Any]:
        config = EngineConfig(
            model=tiny_llama, num_kv_blocks=32, num_threads=serving, quiet_num_threads=every_core
        )
        engine, _executor, tokenizer, _validator = build_engine(config)
        # The probe ran on one thread and left the serving count on the thread that steps.
        assert torch.get_num_threads() == serving
        return AsyncEngine(engine, OutputProcessor(tokenizer), stuck_after_s=0.2), tokenizer

    async def run() -> None:
        light, tokenizer = build()
        assert light.core.executor.worker.keeps_reserve
        prompt = tokenizer.encode("loud")
        light_threads, light_tokens = await streamed_steps(light, prompt)
        monkeypatch.setattr(worker_module, "reserved_core_pays", heavy)
        heavy_engine, _ = build()
        assert not heavy_engine.core.executor.worker.keeps_reserve
        assert len(judged) == 1 and judged[0][0] > 0
        assert judged[0][1:] == (16, serving, every_core)
        heavy_threads, heavy_tokens = await streamed_steps(heavy_engine, prompt)
        assert light_threads == {serving} and heavy_threads == {every_core}
        assert heavy_tokens == light_tokens

    asyncio.run(run())


def test_a_step_runs_on_every_core_while_no_request_streams_or_mostly_prompt(
    tiny_llama: str,
) -> None:
    """The plan tells the worker whether a request in flight streams: `quiet_num_threads` while
    none does, `num_threads` while one does, unless the step is mostly prompt; a request's greedy
    tokens are the same either way."""
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)

    async def run() -> None:
        engine, tokenizer = _engine(tiny_llama, quiet_num_threads=2)
        runner = engine.core.executor.worker.runner
        execute, threads_by_step = runner.execute_model, []

        def counting_threads(plan: Any) -> Any:  # on the compute thread, as the step runs
            threads_by_step.append(torch.get_num_threads())
            return execute(plan)

        runner.execute_model = counting_threads
        prompt = tokenizer.encode("a quiet one")
        alone = await _drain(engine.add_request("alone", prompt, params, stream_interval=None))
        assert set(threads_by_step) == {2}
        threads_by_step.clear()
        beside = engine.add_request("beside", prompt, params, stream_interval=None)
        streamed = engine.add_request("streamed", tokenizer.encode("loud"), params)
        together = await asyncio.gather(_drain(beside), _drain(streamed))
        assert set(threads_by_step) == {1}
        assert _tokens(together[0]) == _tokens(alone)
        # A step that is mostly prompt runs on every core while one streams too.
        threads_by_step.clear()
        long_prompt = tokenizer.encode("a prompt of many more words than one step decodes " * 3)
        assert len(long_prompt) >= 2 * PROMPT_HEAVY_TOKENS_PER_SEQUENCE
        streamed = engine.add_request("streamed-2", tokenizer.encode("loud"), params)
        first = await streamed.__anext__()  # its prefill ran: it decodes in the next steps
        assert first.deltas
        long = engine.add_request("long", long_prompt, params)
        await asyncio.gather(_drain(streamed), _drain(long))
        assert threads_by_step[0] == 1 and 2 in threads_by_step and threads_by_step[-1] == 1
        await engine.shutdown()

    asyncio.run(run())
