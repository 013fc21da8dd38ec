"""LoRA adapters in the engine (workers/lora.py, scheduler/lora_slots.py): greedy tokens equal
transformers' over the checkpoint with each adapter merged into its weights, for every
architecture, beside base-model rows in the same batch, through preemption and chunked
prefill, with more adapters than slots; an adapter's prefix-cache blocks are its own; adapters
that do not fit the model are refused with their reason before anything runs.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch
from exact_gemm import gemm_rows_do_not_depend_on_the_batch
from safetensors.torch import load_file, save_file

from pagedray import LLM, LoRARequest, SamplingParams
from pagedray.attention import cpu_kernels
from pagedray.tools.default_model import ARCHS
from pagedray.workers.lora_checkpoint import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    make_lora_adapter,
    read_adapter,
)
from pagedray.workers.model_config import ModelConfig

MAX_NEW = 10


def merged_checkpoint(model_dir: str, adapter_dir: str, out_dir: Path) -> str:
    """The checkpoint with the adapter folded in, W + scaling * B A: transformers' reference."""
    config = json.loads((Path(adapter_dir) / ADAPTER_CONFIG).read_text())
    scaling = config["lora_alpha"] / config["r"]
    shutil.copytree(model_dir, out_dir)
    weights = load_file(str(out_dir / "model.safetensors"))
    adapter = load_file(str(Path(adapter_dir) / ADAPTER_WEIGHTS))
    for name, a in adapter.items():
        if ".lora_A." not in name:
            continue
        b = adapter[name.replace(".lora_A.", ".lora_B.")]
        target = name.removeprefix("base_model.model.").replace(".lora_A.weight", ".weight")
        merged = weights[target].float() + scaling * (b.float() @ a.float())
        weights[target] = merged.to(weights[target].dtype)
    save_file(weights, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    return str(out_dir)


def _prompts(num: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(10, 500) for _ in range(18)]
    lengths = [5, 17, 33, 12, 40, 9]
    return [shared[: n // 2] + [rng.randrange(10, 500) for _ in range(n)] for n in lengths[:num]]


def _tokens(llm: LLM, prompts: list[list[int]], lora=None) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    requests = [{"prompt_token_ids": p} for p in prompts]
    outputs = llm.generate(requests, params, use_tqdm=False, lora_request=lora)
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("arch", ARCHS)
def test_adapter_tokens_equal_transformers_with_the_adapter_merged(
    tiny_models, arch, hf_greedy, tmp_path
):
    """Adapter and base rows in one batch: each equals its own reference (base, merged)."""
    model = tiny_models[arch]
    adapter = str(make_lora_adapter(model, tmp_path / "adapter", rank=8, seed=3))
    merged = merged_checkpoint(model, adapter, tmp_path / "merged")
    prompts = _prompts(6, seed=2)
    want_base = hf_greedy(model, prompts, MAX_NEW)
    want_lora = hf_greedy(merged, prompts, MAX_NEW)
    assert want_lora != want_base  # the adapter changes the outputs: the test can fail
    llm = LLM(model, dtype="float32", enable_lora=True, max_loras=2)
    request = LoRARequest("a", 1, adapter)
    mixed = [request if i % 2 else None for i in range(len(prompts))]
    got = _tokens(llm, prompts, mixed)
    want = [want_lora[i] if i % 2 else want_base[i] for i in range(len(prompts))]
    assert got == want


def test_more_adapters_than_slots_preemption_and_chunks_change_no_token(
    tiny_llama, hf_greedy, tmp_path
):
    """Two adapters and the base model through one slot, a pool so small that sequences are
    preempted and 16-token chunks: every row equals its reference; the one slot took each
    adapter in turn; and a prompt the base model cached is no hit for an adapter."""
    adapters = [
        str(make_lora_adapter(tiny_llama, tmp_path / f"a{i}", rank=r, seed=10 + i, targets=t))
        for i, (r, t) in enumerate([(8, ("q_proj", "v_proj")), (4, ("gate_proj", "o_proj"))])
    ]
    merged = [merged_checkpoint(tiny_llama, a, tmp_path / f"m{i}") for i, a in enumerate(adapters)]
    prompts = _prompts(6, seed=4)
    references = [hf_greedy(tiny_llama, prompts, MAX_NEW)]
    references += [hf_greedy(path, prompts, MAX_NEW) for path in merged]
    llm = LLM(
        tiny_llama,
        dtype="float32",
        enable_lora=True,
        max_loras=1,
        num_kv_blocks=6,
        max_num_batched_tokens=16,
    )
    requests = [None, LoRARequest("a0", 1, adapters[0]), LoRARequest("a1", 2, adapters[1])]
    choice = [i % 3 for i in range(len(prompts))]
    got = _tokens(llm, prompts, [requests[c] for c in choice])
    assert got == [references[c][i] for i, c in enumerate(choice)]
    stats, slots = llm.stats(), llm.engine.scheduler.lora_slots
    # Both adapters went through the one slot, and sequences were preempted on the way.
    assert stats["num_preemptions"] > 0 and slots is not None and slots.num_loads >= 2

    fresh = LLM(tiny_llama, dtype="float32", enable_lora=True, enable_prefix_caching=True)
    long = prompts[2:3]  # 49 tokens: three full blocks
    assert _tokens(fresh, long) == references[0][2:3]
    hits = fresh.stats()["prefix_cache_hits"]
    assert _tokens(fresh, long, requests[1]) == references[1][2:3]
    assert fresh.stats()["prefix_cache_hits"] == hits  # the base model's blocks are not its
    assert _tokens(fresh, long, requests[1]) == references[1][2:3]
    assert fresh.stats()["prefix_cache_hits"] > hits  # its own are


def _broken(adapter: str, tmp_path: Path, config: dict | None = None, tensors=None) -> str:
    out = tmp_path / "broken"
    shutil.copytree(adapter, out)
    if config is not None:
        original = json.loads((out / ADAPTER_CONFIG).read_text())
        (out / ADAPTER_CONFIG).write_text(json.dumps({**original, **config}))
    if tensors is not None:
        save_file(tensors(load_file(str(out / ADAPTER_WEIGHTS))), str(out / ADAPTER_WEIGHTS))
    return str(out)


def _first_only(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    name = next(iter(sorted(weights)))
    return {name: weights[name]}


def _transposed(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: t.t().contiguous() if ".lora_B." in name else t for name, t in weights.items()}


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"config": {"r": 32}}, "exceeds --max-lora-rank 16"),
        ({"config": {"use_dora": True}}, "DoRA adapters are not supported"),
        ({"config": {"bias": "all"}}, "train biases"),
        ({"tensors": _first_only}, "has lora_A or lora_B alone"),
        ({"tensors": _transposed}, "the model needs"),
    ],
)
def test_an_adapter_that_does_not_fit_is_refused_with_its_reason(
    tiny_llama, tiny_lora, tmp_path, change, reason
):
    path = _broken(tiny_lora, tmp_path, **change)
    with pytest.raises(ValueError, match="lora_path: .*" + reason):
        read_adapter("x", path, ModelConfig.from_pretrained(tiny_llama), 16)


def test_refusals_before_anything_runs(tiny_llama, tiny_lora, tmp_path):
    with pytest.raises(ValueError, match="lora_modules: requires enable_lora"):
        LLM(tiny_llama, lora_modules=[f"a={tiny_lora}"])
    with pytest.raises(ValueError, match="no adapter_config.json"):
        LLM(tiny_llama, enable_lora=True, lora_modules=[f"a={tmp_path}"])
    llm = LLM(tiny_llama, num_kv_blocks=16)
    with pytest.raises(ValueError, match="without enable_lora"):
        _tokens(llm, [[5, 6, 7]], LoRARequest("a", 1, tiny_lora))


def test_an_adapter_gone_from_disk_fails_its_requests_not_the_engine(tiny_llama, tmp_path):
    """Checked when named, then moved away: a request naming it is refused (nothing of it runs),
    the engine serves the base model and other adapters on, and the adapter put back serves as
    before."""
    adapters = [
        str(make_lora_adapter(tiny_llama, tmp_path / n, seed=i)) for i, n in enumerate("ab")
    ]
    requests = [LoRARequest(name, i, path) for i, (name, path) in enumerate(zip("ab", adapters))]
    llm = LLM(tiny_llama, dtype="float32", enable_lora=True, max_loras=1, num_kv_blocks=32)
    prompt = _prompts(3, seed=5)[2:]  # 49 tokens: three full blocks
    before = [_tokens(llm, prompt, request) for request in requests]  # a, then b in its slot
    shutil.move(adapters[0], tmp_path / "away")
    with pytest.raises(ValueError, match="the LoRA adapter 'a' cannot be read"):
        _tokens(llm, prompt, requests[0])
    assert [_tokens(llm, prompt, request) for request in requests[1:]] == before[1:]
    assert _tokens(llm, prompt) != before[1]
    stats = llm.stats()
    assert stats["num_free_blocks"] == stats["num_kv_blocks"] and stats["num_running"] == 0
    shutil.move(tmp_path / "away", adapters[0])
    assert _tokens(llm, prompt, requests[0]) == before[0]


def test_an_adapter_trained_again_in_its_folder_reads_none_of_the_old_blocks(
    tiny_llama, hf_greedy, tmp_path
):
    """The node's KV tier outlives an engine: a later engine serving an adapter of the same name
    from the same folder reads the blocks an earlier one left (the adapter unchanged), and none
    once the folder is rewritten, as a retrain does (same rank: same file size): its key holds
    the weights file's identity, so its tokens are the new adapter's. A running engine whose
    slot loads the adapter again refuses the changed folder once (the requests waiting for it
    end), then serves the new weights under the new key."""
    folder = tmp_path / "adapter"
    prompts = _prompts(3, seed=6)[2:]
    request = LoRARequest("a", 1, str(make_lora_adapter(tiny_llama, folder)))
    first = LLM(tiny_llama, dtype="float32", enable_lora=True, num_kv_blocks=32)
    old = _tokens(first, prompts, request)
    first.shutdown()  # its pool's blocks go to the node's host tier
    again = LLM(tiny_llama, dtype="float32", enable_lora=True, num_kv_blocks=32, max_loras=1)
    assert _tokens(again, prompts, request) == old
    assert again.stats()["external_prefix_cache_hits"] > 0  # the unchanged adapter's blocks
    other = LoRARequest("b", 2, str(make_lora_adapter(tiny_llama, tmp_path / "b", seed=3)))
    _tokens(again, prompts, other)  # "a" leaves the one slot
    make_lora_adapter(tiny_llama, folder, seed=9)  # trained again, in place, the same size
    merged = merged_checkpoint(tiny_llama, str(folder), tmp_path / "merged")
    want = hf_greedy(merged, prompts, MAX_NEW)
    assert want != old
    assert _tokens(again, prompts, request) == want  # a new adapter to the slot table
    again.shutdown()
    fresh = LLM(tiny_llama, dtype="float32", enable_lora=True, num_kv_blocks=32)
    assert _tokens(fresh, prompts, request) == want
    fresh.shutdown()


def test_a_weight_that_is_not_finite_fails_its_adapter_not_its_neighbours(tiny_llama, tmp_path):
    """Every token is computed against every slot: an adapter with an inf would reach them
    all, so its load fails (its requests end) and the base model's tokens stay as they were."""
    adapter = make_lora_adapter(tiny_llama, tmp_path / "inf")
    weights = load_file(str(adapter / ADAPTER_WEIGHTS))
    name = next(n for n in sorted(weights) if ".lora_B." in n)
    weights[name][0, 0] = float("inf")
    save_file(weights, str(adapter / ADAPTER_WEIGHTS))
    llm = LLM(tiny_llama, dtype="float32", enable_lora=True, max_loras=2)
    prompt = _prompts(2, seed=7)
    base = _tokens(llm, prompt)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    requests = [{"prompt_token_ids": p} for p in prompt]
    outputs = llm.generate(
        requests, params, use_tqdm=False, lora_request=[LoRARequest("inf", 1, str(adapter)), None]
    )
    assert outputs[0].error == "the LoRA adapter 'inf' could not be loaded"
    assert outputs[1].outputs[0].token_ids == base[1]


@pytest.mark.usefixtures("exact_attention")
def test_an_adapter_token_s_logprob_is_the_same_bits_by_every_path(tiny_llama, tmp_path):
    """As a base-model token's (tests/engine/test_exact_rows.py): alone, beside base-model rows
    and another adapter's in the same steps, or its prompt in chunks, an adapter's token has the
    same logprob bits (every slot is computed for every token, only the GEMMs' rows vary)."""
    hidden = ModelConfig.from_pretrained(tiny_llama).hidden_size
    if not cpu_kernels.available() or not gemm_rows_do_not_depend_on_the_batch(hidden):
        pytest.skip("this CPU's GEMM rounds a row by the batch's size: outputs cannot be exact")
    adapters = [
        LoRARequest(name, i, str(make_lora_adapter(tiny_llama, tmp_path / name, seed=i)))
        for i, name in enumerate("ab")
    ]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=1)
    prompts = _prompts(6, seed=8)

    def logprobs(llm: LLM, lora: list) -> list[list[float]]:
        requests = [{"prompt_token_ids": p} for p in prompts[: len(lora)]]
        outputs = llm.generate(requests, params, use_tqdm=False, lora_request=lora)
        return [
            [step[t] for t, step in zip(o.outputs[0].token_ids, o.outputs[0].logprobs or [])]
            for o in outputs
        ]

    settings = {"dtype": "float32", "enable_lora": True, "max_loras": 2}
    llm = LLM(tiny_llama, enable_prefix_caching=False, **settings)
    alone = logprobs(llm, [adapters[0]])[0]
    together = logprobs(llm, [adapters[0], None, adapters[1], None])
    assert together[0] == alone
    chunked = LLM(tiny_llama, enable_prefix_caching=False, max_num_batched_tokens=8, **settings)
    assert logprobs(chunked, [adapters[0]])[0] == alone
