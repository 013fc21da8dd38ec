"""Tensor parallelism over Ray worker actors: TP=2 (gloo) greedy tokens equal TP=1 and
transformers, both dispatch paths agree, and shutdown leaves no actor or placement group behind.

Shapes that stress the sharding: 2 KV heads, 1 KV head (replicated across ranks) and a
vocabulary (517) that does not split evenly over the ranks.
"""

from __future__ import annotations

import random
import time

import pytest
import torch
from transformers import AutoModelForCausalLM

from pagedray import LLM, SamplingParams
from pagedray.cluster.default_model import make_model
from pagedray.cluster.placement import reserve_placement
from pagedray.cluster.ray_executor import RayExecutor
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


def _hf_greedy(path: str, prompts: list[list[int]]) -> list[list[int]]:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # compare fixed-length outputs
    outputs = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=MAX_NEW,
                do_sample=False,
                pad_token_id=0,
            )
            outputs.append(out[0, len(prompt) :].tolist())
    return outputs


def _generate(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
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
def test_tp2_greedy_matches_tp1_and_transformers(ray_cluster, tp_models, model):
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
    assert tp2_tokens == tp1_tokens == _hf_greedy(path, prompts)


def test_dispatch_paths_agree_and_shut_down_cleanly(ray_cluster, tiny_llama):
    prompts = _prompts()
    tokens = {}
    for dispatch in ("actor", "compiled"):
        llm = LLM(tiny_llama, tensor_parallel_size=2, dtype="float32", dispatch=dispatch)
        executor = llm.executor
        actor_ids = list(executor.actor_ids)
        assert len(actor_ids) == 2 and set(actor_ids) <= _alive_actor_ids()
        try:
            tokens[dispatch] = _generate(llm, prompts)
        finally:
            llm.shutdown()
        _assert_shut_down(executor, actor_ids)
        llm.shutdown()  # idempotent
    assert tokens["actor"] == tokens["compiled"]


def test_single_rank_as_ray_actor_matches_in_process(ray_cluster, tiny_llama):
    """The serving path runs even TP=1 as a Ray actor (`use_ray_workers`)."""
    prompts = _prompts()
    in_process = LLM(tiny_llama, dtype="float32")
    expected = _generate(in_process, prompts)
    in_process.shutdown()
    llm = LLM(tiny_llama, dtype="float32", use_ray_workers=True)
    try:
        assert isinstance(llm.executor, RayExecutor) and len(llm.executor.workers) == 1
        assert _generate(llm, prompts) == expected
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
