"""Tensor parallelism over Ray worker actors: TP=2 (gloo) greedy tokens equal TP=1 and
transformers, the three dispatch paths agree, and shutdown leaves no actor, placement group or
FIFO behind. The pipe path's failure handling runs against the real model and against scripted
fake ranks (any message size, a rank that fails while another is stuck, a rank that dies).

Shapes that stress the sharding: 2 KV heads, 1 KV head (replicated across ranks) and a
vocabulary (517) that does not split evenly over the ranks.
"""

from __future__ import annotations

import os
import random
import threading
import time
from typing import Any

import pytest

from pagedray import LLM, LoRARequest, SamplingParams
from pagedray.cluster.pipe_dispatch import PipeDispatcher, PipeWorkerLoop, WorkerStepError
from pagedray.cluster.placement import reserve_placement
from pagedray.cluster.ray_executor import DISPATCHES, ActorCallDispatcher, RayExecutor
from pagedray.scheduler.messages import CachedRequestData, ModelRunnerOutput, SchedulerOutput
from pagedray.tools.default_model import make_model
from pagedray.workers.worker_config import WorkerConfig

MAX_NEW = 8
# Around the 16-token block boundary, and one spanning three blocks.
PROMPT_LENS = (5, 16, 17, 33)
TOKEN_RANGE = (10, 500)  # inside every test vocabulary, clear of the special tokens


@pytest.fixture(scope="module")
def tp_models(tiny_llama: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tp_models")
    return {
        "llama": tiny_llama,
        "qwen3_one_kv_head": str(make_model(root / "q", "qwen3", "tiny", num_key_value_heads=1)),
        "llama_vocab_517": str(make_model(root / "v", "llama", "tiny", vocab_size=517)),
    }


def _prompts() -> list[list[int]]:
    rng = random.Random(3)
    return [[rng.randrange(*TOKEN_RANGE) for _ in range(n)] for n in PROMPT_LENS]


def _generate(llm: LLM, prompts: list[list[int]], lora: Any = None) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    requests = [{"prompt_token_ids": p} for p in prompts]
    outputs = llm.generate(requests, params, use_tqdm=False, lora_request=lora)
    return [o.outputs[0].token_ids for o in outputs]


def _alive_actor_ids() -> set[str]:
    """Ids of this session's live actors: the state API when this Ray serves it, else the GCS."""
    import ray
    from ray._private.services import get_webui_url_from_internal_kv
    from ray.util.state import list_actors

    # NOTE: the state API is served by the dashboard, which the session's Ray runs without;
    # left to find one itself it would query another Ray's on this machine, if any.
    dashboard_url = get_webui_url_from_internal_kv()
    if dashboard_url:
        alive = list_actors(address=f"http://{dashboard_url}", filters=[("state", "=", "ALIVE")])
        return {actor.actor_id for actor in alive}
    actors = ray._private.state.actors()
    return {actor_id for actor_id, info in actors.items() if info["State"] == "ALIVE"}


def _assert_shut_down(executor: RayExecutor, actor_ids: list[str]) -> None:
    import ray

    deadline = time.monotonic() + 10
    while set(actor_ids) & _alive_actor_ids() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not set(actor_ids) & _alive_actor_ids()
    group = executor.placement.placement_group
    assert ray.util.placement_group_table(group)["state"] == "REMOVED"


@pytest.mark.parametrize("model", ["llama", "qwen3_one_kv_head", "llama_vocab_517"])
def test_tp2_greedy_matches_tp1_and_transformers(ray_cluster, tp_models, model, hf_greedy):
    path = tp_models[model]
    prompts = _prompts()
    tp1 = LLM(path, dtype="float32")
    tp1_tokens = _generate(tp1, prompts)
    tp1.shutdown()
    tp2 = LLM(path, tensor_parallel_size=2, dtype="float32")
    try:
        assert isinstance(tp2.executor, RayExecutor)
        tp2_tokens = _generate(tp2, prompts)
    finally:
        tp2.shutdown()
    assert tp2_tokens == tp1_tokens == hf_greedy(path, prompts, MAX_NEW)


def test_dispatch_paths_agree_and_shut_down_cleanly(ray_cluster, tiny_llama, tiny_lora):
    """Every path, with a LoRA adapter on half the prompts (its load reaches both actors
    through the plan): the tokens of TP=1 in this process."""
    prompts = _prompts()
    lora = [LoRARequest("a", 1, tiny_lora) if i % 2 else None for i in range(len(prompts))]
    tp1 = LLM(tiny_llama, dtype="float32", enable_lora=True)
    expected = _generate(tp1, prompts, lora)
    tp1.shutdown()
    tokens = {}
    for dispatch in DISPATCHES:
        llm = LLM(
            tiny_llama, tensor_parallel_size=2, dtype="float32", dispatch=dispatch, enable_lora=True
        )
        executor = llm.executor
        assert executor.dispatch == dispatch  # pipes did not fall back: one node
        actor_ids = list(executor.actor_ids)
        assert len(actor_ids) == 2 and set(actor_ids) <= _alive_actor_ids()
        pipe_dir = getattr(executor._dispatcher, "pipe_dir", None)
        try:
            tokens[dispatch] = _generate(llm, prompts, lora)
        finally:
            llm.shutdown()
        _assert_shut_down(executor, actor_ids)
        llm.shutdown()  # idempotent
        if dispatch == "pipe":
            assert pipe_dir is not None and not os.path.exists(pipe_dir)
    assert tokens["actor"] == tokens["compiled"] == tokens["pipe"] == expected


def _plan(step_id: int, scheduled: dict[str, int], finished: list[str]) -> SchedulerOutput:
    return SchedulerOutput(
        step_id=step_id,
        scheduled_new_reqs=[],
        scheduled_cached_reqs=CachedRequestData(),
        num_scheduled_tokens=scheduled,
        total_num_scheduled_tokens=sum(scheduled.values()),
        blocks_to_copy=[],
        finished_req_ids=finished,
    )


def test_pipe_dispatch_carries_big_plans_and_raises_a_rank_error(ray_cluster, tiny_llama):
    config = WorkerConfig(tiny_llama, dtype="float32", tensor_parallel_size=2, num_kv_blocks=8)
    executor = RayExecutor(config, dispatch="pipe")
    actor_ids = list(executor.actor_ids)
    try:
        # Far beyond a 64 KiB pipe buffer; unknown finished req_ids are ignored by the runner.
        unknown = [f"gone-{i}" for i in range(40_000)]
        assert executor.execute_model(_plan(0, {}, unknown)).step_id == 0
        # A req_id the workers never saw: the runner raises KeyError on every rank.
        with pytest.raises(WorkerStepError, match="in step 1: KeyError") as failure:
            executor.execute_model(_plan(1, {"never-added": 1}, []))
        assert isinstance(failure.value.__cause__, KeyError)
        with pytest.raises(RuntimeError, match="an earlier step failed"):
            executor.execute_model(_plan(2, {}, []))
    finally:
        executor.shutdown()
    _assert_shut_down(executor, actor_ids)


def _fake_ranks(num_ranks: int) -> list:
    """Actors that run the real pipe loop over a scripted step: commands in finished_req_ids."""
    import ray

    @ray.remote(num_cpus=0)
    class FakeRank:
        def __init__(self, rank: int) -> None:
            self.rank = rank
            self.loop: PipeWorkerLoop | None = None

        def open_pipe_channel(self, plan_path: str, reply_path: str) -> None:
            self.loop = PipeWorkerLoop(self.rank, plan_path, reply_path, self.execute)

        def start_pipe_loop(self) -> None:
            self.loop.start()

        def ping(self) -> None:
            return None

        def execute_model(self, plan: SchedulerOutput) -> ModelRunnerOutput:  # actor dispatch
            return self.execute(plan)

        def execute(self, plan: SchedulerOutput) -> ModelRunnerOutput:
            if f"fail-{self.rank}" in plan.finished_req_ids:
                raise ValueError(f"rank {self.rank} told to fail")
            if f"hang-{self.rank}" in plan.finished_req_ids:
                time.sleep(3600)  # as if waiting in a collective for a rank that failed
            # Echo the plan's ids back: a reply as big as the plan.
            return ModelRunnerOutput(plan.step_id, plan.finished_req_ids, [], [])

    ranks = [FakeRank.remote(rank) for rank in range(num_ranks)]
    ray.get([rank.ping.remote() for rank in ranks])
    return ranks


def _kill(ranks: list) -> None:
    import ray

    for rank in ranks:
        ray.kill(rank, no_restart=True)


def test_pipe_dispatch_big_replies_and_a_failing_rank_while_rank0_is_stuck(ray_cluster):
    ranks = _fake_ranks(2)
    dispatcher = PipeDispatcher(ranks)
    try:
        assert not os.path.exists(dispatcher.pipe_dir)  # FIFOs unlinked once opened
        ids = [f"req-{i}" for i in range(50_000)]  # ~0.5 MB each way
        assert dispatcher.execute_model(_plan(7, {}, ids)).req_ids == ids
        start = time.monotonic()
        with pytest.raises(WorkerStepError, match="rank 1 failed in step 8: ValueError"):
            dispatcher.execute_model(_plan(8, {}, ["hang-0", "fail-1"]))
        assert time.monotonic() - start < 30  # not a hang
    finally:
        dispatcher.shutdown()
        dispatcher.shutdown()  # idempotent
        _kill(ranks)


def test_actor_dispatch_raises_a_failing_rank_while_rank0_is_stuck(ray_cluster):
    ranks = _fake_ranks(2)
    errors: list[BaseException] = []

    def step() -> None:
        try:
            ActorCallDispatcher(ranks).execute_model(_plan(0, {}, ["hang-0", "fail-1"]))
        except BaseException as error:
            errors.append(error)

    try:
        thread = threading.Thread(target=step, daemon=True)  # a hang fails the test, not CI
        thread.start()
        thread.join(timeout=30)  # not rank 0's hour: ray.get raises the first error
        assert not thread.is_alive()
        assert isinstance(errors[0], ValueError) and "rank 1 told to fail" in str(errors[0])
    finally:
        _kill(ranks)


def test_a_rank_failing_at_start_fails_its_executor_at_once(ray_cluster, tiny_llama, monkeypatch):
    """Rank 1 raises while allocating its pool; rank 0 goes on into the collective where the
    ranks agree on their thread reserve, where it would wait for gloo's 30 minutes. `ray.get`
    of the ranks' results raises the first error without waiting for the others, so the
    executor fails at once, and it leaves no rank, placement group or CPU behind."""
    import ray

    from pagedray.cluster import ray_executor
    from pagedray.cluster.worker_actor import WorkerActor

    class PoolFailsOnRank1(WorkerActor.__ray_actor_class__):  # type: ignore[name-defined]
        def init_kv_cache(self, num_blocks: int) -> dict[str, str]:
            if self._worker.rank == 1:
                raise MemoryError("rank 1 could not allocate its KV pool")
            return super().init_kv_cache(num_blocks)

    monkeypatch.setattr(ray_executor, "WorkerActor", ray.remote(PoolFailsOnRank1))
    before = _alive_actor_ids()
    free_cpus = ray.available_resources().get("CPU", 0)
    config = WorkerConfig(tiny_llama, dtype="float32", tensor_parallel_size=2, num_kv_blocks=8)
    start = time.monotonic()
    with pytest.raises(MemoryError, match="rank 1 could not allocate"):
        RayExecutor(config, dispatch="actor")
    assert time.monotonic() - start < 120
    deadline = time.monotonic() + 10
    while (_alive_actor_ids() - before or ray.available_resources().get("CPU", 0) < free_cpus) and (
        time.monotonic() < deadline
    ):
        time.sleep(0.1)
    assert not _alive_actor_ids() - before
    assert ray.available_resources().get("CPU", 0) >= free_cpus  # its placement group is gone


def test_pipe_dispatch_reports_a_dead_rank_and_a_shutdown_mid_step(ray_cluster):
    import ray

    ranks = _fake_ranks(2)
    dispatcher = PipeDispatcher(ranks)
    try:
        # Shut down from another thread while rank 0 is stuck: the step returns an error.
        errors: list[BaseException] = []

        def step() -> None:
            try:
                dispatcher.execute_model(_plan(0, {}, ["hang-0"]))
            except BaseException as error:
                errors.append(error)

        thread = threading.Thread(target=step)
        thread.start()
        time.sleep(0.5)
        dispatcher.shutdown()
        thread.join(timeout=30)
        assert not thread.is_alive()
        assert "shut down during a step" in str(errors[0])
        with pytest.raises(RuntimeError, match="shut down"):
            dispatcher.execute_model(_plan(1, {}, []))
    finally:
        dispatcher.shutdown()
        _kill(ranks)
    ranks = _fake_ranks(2)
    dispatcher = PipeDispatcher(ranks)
    try:
        ray.kill(ranks[1], no_restart=True)
        with pytest.raises(RuntimeError, match="rank 1 closed its (plan|reply) pipe"):
            for step_id in range(100):  # the kill lands within a few steps
                dispatcher.execute_model(_plan(step_id, {}, []))
                time.sleep(0.05)
    finally:
        dispatcher.shutdown()
        _kill(ranks)


def test_single_rank_as_ray_actor_matches_in_process(ray_cluster, tiny_llama):
    """The serving path runs even TP=1 as a Ray actor (`use_ray_workers`)."""
    import ray

    prompts = _prompts()
    in_process = LLM(tiny_llama, dtype="float32")
    expected = _generate(in_process, prompts)
    in_process.shutdown()
    llm = LLM(tiny_llama, dtype="float32", use_ray_workers=True)
    try:
        assert isinstance(llm.executor, RayExecutor) and len(llm.executor.workers) == 1
        assert _generate(llm, prompts) == expected
        # Named for the dashboard's Actors page: which engine, which rank.
        (name,) = llm.executor.actor_names
        assert name.startswith("pagedray-llm-") and name.endswith("-rank0")
        assert ray.get_actor(name)._actor_id.hex() == llm.executor.actor_ids[0]
    finally:
        llm.shutdown()


def test_workers_join_a_given_placement_group_and_leave_it(ray_cluster, tiny_llama):
    import ray

    group = ray.util.placement_group([{"CPU": 1}] * 3, strategy="STRICT_PACK")
    ray.get(group.ready())
    try:
        config = WorkerConfig(tiny_llama, dtype="float32", tensor_parallel_size=2, num_kv_blocks=8)
        executor = RayExecutor(config, dispatch="actor", placement_group=group)
        try:
            assert executor.num_kv_blocks == 8
            assert executor.placement.worker_bundle_indices == [1, 2]
            assert not executor.placement.owned
        finally:
            executor.shutdown()
        assert ray.util.placement_group_table(group)["state"] == "CREATED"  # not ours to remove
    finally:
        ray.util.remove_placement_group(group)


def test_reserve_placement_uses_the_callers_group(ray_cluster):
    """Inside a task or actor placed in a group (a Serve replica's), that group is reused."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    group = ray.util.placement_group([{"CPU": 1}] * 3, strategy="STRICT_PACK")
    ray.get(group.ready())

    @ray.remote(num_cpus=1)
    def probe() -> tuple[str, bool, list[int]]:
        placement = reserve_placement(2, device="cpu")
        return placement.placement_group.id.hex(), placement.owned, placement.worker_bundle_indices

    try:
        strategy = PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=0)
        group_id, owned, indices = ray.get(probe.options(scheduling_strategy=strategy).remote())
        assert (group_id, owned, indices) == (group.id.hex(), False, [1, 2])
        with pytest.raises(ValueError, match="needs 4"):
            reserve_placement(3, device="cpu", placement_group=group)
    finally:
        ray.util.remove_placement_group(group)
