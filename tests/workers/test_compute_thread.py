"""The compute thread: calls run there in order; the engine is built and stepped there only."""

from __future__ import annotations

import _thread
import asyncio
import signal
import sys
import threading

import pytest

from pagedray.engine.async_engine import AsyncEngine
from pagedray.engine.config import EngineConfig
from pagedray.engine.engine_factory import build_engine
from pagedray.engine.output_processor import OutputProcessor
from pagedray.llm import LLM
from pagedray.scheduler.sampling_params import SamplingParams
from pagedray.workers import worker as worker_module
from pagedray.workers.compute_thread import ComputeThread, compute_thread

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


def _ids(*token_ids: int) -> dict[str, list[int]]:
    return {"prompt_token_ids": list(token_ids)}


def test_calls_run_in_order_on_one_thread() -> None:
    thread = ComputeThread(name="test-compute")
    seen: list[tuple[int, str]] = []
    futures = [
        thread.submit(lambda i=i: seen.append((i, threading.current_thread().name)))
        for i in range(20)
    ]
    for future in futures:
        future.result(timeout=10)
    assert seen == [(i, "test-compute") for i in range(20)]


def test_an_exception_reaches_the_caller_and_the_thread_goes_on() -> None:
    thread = ComputeThread()

    def fail() -> None:
        raise KeyError("boom")

    with pytest.raises(KeyError, match="boom"):
        thread.run(fail)
    assert thread.run(lambda x: x + 1, 41) == 42


def test_a_call_from_the_thread_itself_runs_at_once() -> None:
    # Queued behind itself, a nested call would never run.
    thread = ComputeThread()
    assert thread.run(lambda: thread.run(lambda: thread.is_current())) is True
    assert not thread.is_current()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc: Linux only")
def test_the_thread_carries_its_name_in_the_os() -> None:
    """So that /proc, `top -H` and the benchmarks tell the model's CPU apart."""

    def os_name() -> str:
        with open(f"/proc/self/task/{threading.get_native_id()}/comm") as comm:
            return comm.read().strip()

    assert ComputeThread(name="test-compute-os").run(os_name) == "test-compute-os"


def test_one_compute_thread_per_process() -> None:
    assert compute_thread() is compute_thread()


@pytest.fixture
def model_threads(monkeypatch: pytest.MonkeyPatch) -> set[str]:
    """Names of the threads that built a `Worker` or ran its steps."""
    names: set[str] = set()
    real_init, real_execute = worker_module.Worker.__init__, worker_module.Worker.execute_model

    def init(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        names.add(threading.current_thread().name)
        real_init(self, *args, **kwargs)

    def execute(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        names.add(threading.current_thread().name)
        return real_execute(self, *args, **kwargs)

    monkeypatch.setattr(worker_module.Worker, "__init__", init)
    monkeypatch.setattr(worker_module.Worker, "execute_model", execute)
    return names


def test_llm_builds_and_steps_on_the_compute_thread(
    tiny_llama: str, model_threads: set[str]
) -> None:
    llm = LLM(tiny_llama, num_kv_blocks=32, num_threads=1)
    outputs = llm.generate([_ids(1, 2, 3), _ids(4, 5)], GREEDY, use_tqdm=False)
    assert [len(out.outputs[0].token_ids) for out in outputs] == [4, 4]
    assert model_threads == {"pagedray-compute"}


def test_serving_engine_steps_on_the_compute_thread(
    tiny_llama: str, model_threads: set[str]
) -> None:
    # As the engine deployment does: built on the compute thread, stepped from an event loop.
    config = EngineConfig(model=tiny_llama, num_kv_blocks=32, num_threads=1)
    engine, _executor, tokenizer, _validator = compute_thread().run(build_engine, config)

    async def run() -> int:
        async_engine = AsyncEngine(engine, OutputProcessor(tokenizer))
        stream = async_engine.add_request("r0", [1, 2, 3], GREEDY)
        outputs = [output async for output in stream]
        await async_engine.shutdown()
        return sum(len(d.token_ids) for o in outputs for d in o.deltas)

    assert asyncio.run(run()) == 4
    assert model_threads == {"pagedray-compute"}


def test_an_interrupted_generate_leaves_the_engine_usable(tiny_llama: str) -> None:
    """Ctrl-C in the caller stops the loop between two steps, then aborts the requests."""
    # Python's own Ctrl-C handler, whatever an earlier test in this process left installed.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    llm = LLM(tiny_llama, num_kv_blocks=32, num_threads=1)
    block_pool = llm.engine.scheduler.kv_cache_manager.block_pool
    free_before = block_pool.get_num_free_blocks()
    real_step = llm.engine.step
    calls = 0

    def step_then_interrupt():  # type: ignore[no-untyped-def]
        nonlocal calls
        calls += 1
        # A Ctrl-C, raised in the caller, who waits for the loop. Sent again each step until
        # it lands: in a long test session the interpreter can run the handler inside a
        # finalizer of some other object, which swallows the KeyboardInterrupt.
        if calls >= 2 and not llm._interrupted.is_set():
            _thread.interrupt_main()
        return real_step()

    llm.engine.step = step_then_interrupt  # type: ignore[method-assign]
    try:
        with pytest.raises(KeyboardInterrupt):
            llm.generate(
                [_ids(1, 2, 3)], SamplingParams(max_tokens=500, ignore_eos=True), use_tqdm=False
            )
    finally:
        signal.signal(signal.SIGINT, previous)
    llm.engine.step = real_step  # type: ignore[method-assign]
    assert calls < 500  # the loop stopped
    assert not llm.engine.has_unfinished_requests()
    assert block_pool.get_num_free_blocks() == free_before
    outputs = llm.generate([_ids(1, 2, 3)], GREEDY, use_tqdm=False)
    assert len(outputs[0].outputs[0].token_ids) == 4
