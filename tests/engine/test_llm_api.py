"""The offline `LLM` API end to end on real tiny checkpoints: prefix caching, copy-on-write n > 1,
bad input, stop strings, logprobs, chat, and checkpoints saved by transformers itself."""

from __future__ import annotations

import random

import pytest
import torch
import transformers

from pagedray import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_llama: str) -> LLM:
    return LLM(tiny_llama, dtype="float32", num_kv_blocks=256)


def _ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 500) for _ in range(n)]


def test_second_request_computes_only_its_new_tokens(llm: LLM) -> None:
    shared = _ids(32, seed=1)
    llm.generate({"prompt_token_ids": shared + _ids(8, 2)}, GREEDY, use_tqdm=False)
    before = llm.stats()
    llm.generate({"prompt_token_ids": shared + _ids(5, 3)}, GREEDY, use_tqdm=False)
    after = llm.stats()
    assert after["prefix_cache_hits"] - before["prefix_cache_hits"] == 32
    # 5 new prompt tokens, then 7 decode steps (the 8th token is sampled, never computed).
    assert after["num_computed_tokens_total"] - before["num_computed_tokens_total"] == 5 + 7


def test_different_cache_salt_gets_no_hit(llm: LLM) -> None:
    prompt = _ids(40, seed=4)
    llm.generate({"prompt_token_ids": prompt, "cache_salt": "tenant-a"}, GREEDY, use_tqdm=False)
    before = llm.stats()["prefix_cache_hits"]
    salted = {"prompt_token_ids": prompt, "cache_salt": "tenant-b"}
    out_b = llm.generate(salted, GREEDY, use_tqdm=False)
    assert llm.stats()["prefix_cache_hits"] == before
    same = {"prompt_token_ids": prompt, "cache_salt": "tenant-a"}
    out_a = llm.generate(same, GREEDY, use_tqdm=False)
    assert llm.stats()["prefix_cache_hits"] == before + 32
    assert out_a[0].outputs[0].token_ids == out_b[0].outputs[0].token_ids


def test_parallel_sampling_prefills_once_and_copies_the_shared_tail(llm: LLM) -> None:
    prompt = {"prompt_token_ids": _ids(20, seed=5)}
    params = SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=6, ignore_eos=True)
    before = llm.stats()
    first = llm.generate(prompt, params, use_tqdm=False)[0]
    after = llm.stats()
    # One prefill of 20 tokens, then 4 sequences x 5 decode steps; not 4 prefills.
    assert after["num_computed_tokens_total"] - before["num_computed_tokens_total"] == 20 + 4 * 5
    # The 20-token prompt ends mid-block: three children copy it, the last writes in place.
    assert after["num_cow_copies"] - before["num_cow_copies"] == 3
    assert len(first.outputs) == 4
    assert len({tuple(o.token_ids) for o in first.outputs}) > 1
    again = llm.generate(prompt, params, use_tqdm=False)[0]
    assert [o.token_ids for o in again.outputs] == [o.token_ids for o in first.outputs]
    assert llm.stats()["num_free_blocks"] == llm.stats()["num_kv_blocks"]


@pytest.mark.parametrize(
    "prompt, params, field",
    [
        ({"prompt_token_ids": list(range(10, 10 + 2000))}, None, "prompt"),
        ({"prompt_token_ids": []}, None, "prompt"),
        ("", None, "prompt"),
        ({"prompt_token_ids": [1, 10**6]}, None, "prompt_token_ids"),
        (42, None, "prompt"),
        (
            {"prompt_token_ids": [1, 2]},
            SamplingParams(logit_bias={10**6: 5.0}, max_tokens=4),
            "logit_bias",
        ),
    ],
)
def test_bad_prompt_raises_and_allocates_nothing(llm: LLM, prompt, params, field) -> None:
    with pytest.raises(ValueError, match=f"^{field}:"):
        llm.generate([{"prompt_token_ids": _ids(5, 9)}, prompt], params or GREEDY, use_tqdm=False)
    stats = llm.stats()
    assert stats["num_free_blocks"] == stats["num_kv_blocks"]
    assert stats["num_waiting"] == stats["num_running"] == 0
    assert llm.generate({"prompt_token_ids": _ids(5, 9)}, GREEDY, use_tqdm=False)[0].finished


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"n": 0}, "n"),
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"stop": 5}, "stop"),
        ({"logprobs": -1}, "logprobs"),
        ({"logit_bias": {3: 100.5}}, "logit_bias"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias"),
        ({"logit_bias": {"3": 1.0}}, "logit_bias"),
        # What crashed the engine step before they were refused here (issue P5).
        ({"repetition_penalty": 1e-300}, "repetition_penalty"),
        ({"temperature": float("inf"), "min_tokens": 2}, "temperature"),
        ({"top_k": 200000000000000000000, "top_p": 0.5}, "top_k"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": "1"}, "temperature"),
        ({"max_tokens": 1.5}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"n": 2**40}, "n"),
        ({"seed": 2**80}, "seed"),
        ({"stop": ["ok", "\ud800"]}, "stop"),
        ({"stop_token_ids": [2**40]}, "stop_token_ids"),
        ({"logit_bias": {3: float("nan")}}, "logit_bias"),
        ({"presence_penalty": float("-inf")}, "presence_penalty"),
    ],
)
def test_bad_sampling_params_name_field_and_limit(kwargs, field) -> None:
    with pytest.raises(ValueError, match=f"^{field}: "):
        SamplingParams(**kwargs)


def test_logprobs_past_max_logprobs_are_refused(llm: LLM, tiny_llama: str) -> None:
    """vLLM's `max_logprobs` (20 by default, -1 the whole vocabulary) caps every token's."""
    prompt = {"prompt_token_ids": _ids(4, seed=3)}
    for name in ("logprobs", "prompt_logprobs"):
        with pytest.raises(ValueError, match=f"^{name}: 21 exceeds this server's max_logprobs"):
            llm.generate(prompt, SamplingParams(max_tokens=1, **{name: 21}), use_tqdm=False)
    assert llm.generate(prompt, SamplingParams(max_tokens=1, logprobs=20), use_tqdm=False)
    wide = LLM(tiny_llama, num_kv_blocks=16, max_logprobs=-1)
    try:
        out = wide.generate(prompt, SamplingParams(max_tokens=1, logprobs=100), use_tqdm=False)
        assert len(out[0].outputs[0].logprobs[0]) >= 100  # the sampled token and the top 100
    finally:
        wide.shutdown()


def test_stop_string_is_found_across_tokens_and_not_returned(llm: LLM) -> None:
    prompt = {"prompt_token_ids": _ids(12, seed=11)}
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    full = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    text = full.text
    assert len(text) > 8
    stop = text[3:7]  # likely spans a token boundary; it must be cut either way
    cut = llm.generate(prompt, params.clone(stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert cut.text == text[: text.index(stop)]
    assert llm.stats()["num_free_blocks"] == llm.stats()["num_kv_blocks"]


def test_stop_token_ids_and_logprobs(llm: LLM) -> None:
    prompt = {"prompt_token_ids": _ids(9, seed=12)}
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=3)
    out = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    assert len(out.logprobs) == len(out.token_ids)
    for token, entry in zip(out.token_ids, out.logprobs):
        assert token in entry and len(entry) <= 4
        assert entry[token] == max(entry.values())  # greedy picks the most likely
    stop_at = out.token_ids[4]
    first = out.token_ids.index(stop_at)
    cut = llm.generate(prompt, params.clone(stop_token_ids=[stop_at]), use_tqdm=False)[0]
    assert cut.outputs[0].token_ids == out.token_ids[: first + 1]
    assert cut.outputs[0].finish_reason == "stop" and cut.outputs[0].stop_reason == stop_at


def test_chat_and_text_prompts(llm: LLM) -> None:
    outputs = llm.chat([{"role": "user", "content": "hello there"}], GREEDY, use_tqdm=False)
    assert len(outputs[0].outputs[0].token_ids) == 8
    text_out = llm.generate(["the quick brown fox", "a"], GREEDY, use_tqdm=False)
    assert [o.prompt for o in text_out] == ["the quick brown fox", "a"]
    assert all(o.outputs[0].finish_reason == "length" for o in text_out)


def test_32_requests_of_32_tokens_run_together_in_64_blocks(tiny_llama: str) -> None:
    llm = LLM(tiny_llama, dtype="float32", num_kv_blocks=64, block_size=16)
    prompts = [{"prompt_token_ids": _ids(17, seed=100 + i)} for i in range(32)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    stats = llm.stats()
    assert stats["num_preemptions"] == 0
    assert stats["peak_num_running"] == 32
    assert all(len(o.outputs[0].token_ids) == 16 for o in outputs)
    assert stats["num_free_blocks"] == 64


ARCH_CONFIGS = {
    "llama": transformers.LlamaConfig,
    "mistral": transformers.MistralConfig,
    "qwen2": transformers.Qwen2Config,
    "qwen3": transformers.Qwen3Config,
}
ARCH_MODELS = {
    "llama": transformers.LlamaForCausalLM,
    "mistral": transformers.MistralForCausalLM,
    "qwen2": transformers.Qwen2ForCausalLM,
    "qwen3": transformers.Qwen3ForCausalLM,
}


@pytest.mark.parametrize("arch", list(ARCH_CONFIGS))
def test_checkpoint_saved_by_transformers(arch: str, tiny_llama: str, tmp_path) -> None:
    config = ARCH_CONFIGS[arch](
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        initializer_range=0.1,
        eos_token_id=2,
        bos_token_id=1,
        pad_token_id=0,
    )
    torch.manual_seed(3)
    model = ARCH_MODELS[arch](config).eval()
    model.save_pretrained(tmp_path, max_shard_size="100KB")  # sharded, with an index file
    llm = LLM(str(tmp_path), tokenizer=tiny_llama, dtype="float32")
    prompt = _ids(21, seed=13)
    ours = llm.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False)[0]
    model.generation_config.eos_token_id = None
    with torch.inference_mode():
        ids = torch.tensor([prompt])
        ref = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=8,
            do_sample=False,
            pad_token_id=0,
        )
    assert ours.outputs[0].token_ids == ref[0, 21:].tolist()


def test_more_samples_than_max_num_seqs_is_refused(tiny_llama: str) -> None:
    llm = LLM(tiny_llama, dtype="float32", max_num_seqs=2, num_kv_blocks=32)
    with pytest.raises(ValueError, match="^n: must be at most max_num_seqs=2"):
        llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(n=3), use_tqdm=False)
    assert llm.stats()["num_free_blocks"] == 32


def test_seeded_sampling_is_the_same_under_preemption(llm: LLM, tiny_llama: str) -> None:
    """A seeded request draws the same tokens whether or not it was preempted and recomputed,
    n > 1 included: each draw is keyed by (seed, output position), not by a generator's history."""
    prompts = [{"prompt_token_ids": _ids(24, seed=200 + i)} for i in range(6)]
    params = [
        SamplingParams(n=1 + i % 2, temperature=1.0, top_p=0.95, seed=40 + i, max_tokens=24)
        for i in range(6)
    ]
    roomy = llm.generate(prompts, params, use_tqdm=False)
    assert llm.stats()["num_preemptions"] == 0
    tight = LLM(tiny_llama, dtype="float32", num_kv_blocks=8, block_size=16)
    squeezed = tight.generate(prompts, params, use_tqdm=False)
    assert tight.stats()["num_preemptions"] > 0
    for a, b in zip(roomy, squeezed):
        assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
    assert tight.stats()["num_free_blocks"] == 8


def test_logit_bias_forces_and_bans_tokens(llm: LLM) -> None:
    prompt = {"prompt_token_ids": _ids(12, seed=31)}
    plain = llm.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    forced = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logit_bias={42: 100})
    assert llm.generate(prompt, forced, use_tqdm=False)[0].outputs[0].token_ids == [42] * 8
    banned = GREEDY.clone(logit_bias={plain[0]: -100})
    first = llm.generate(prompt, banned, use_tqdm=False)[0].outputs[0].token_ids
    assert plain[0] not in first
    sampled = SamplingParams(temperature=1.0, seed=3, max_tokens=8, logit_bias={42: 100})
    assert llm.generate(prompt, sampled, use_tqdm=False)[0].outputs[0].token_ids == [42] * 8


def test_a_request_that_fails_in_the_step_ends_alone(llm: LLM) -> None:
    """A request whose sampling cannot succeed (its probabilities are NaN: here a penalty past
    what validation allows, set after it) ends with "error"; the batch beside it is unchanged."""
    broken = SamplingParams(temperature=1.0, seed=1, max_tokens=8, repetition_penalty=1.5)
    broken.repetition_penalty = 1e-300
    prompts = [{"prompt_token_ids": _ids(12, seed)} for seed in range(3)]
    alone = llm.generate([prompts[0], prompts[2]], GREEDY, use_tqdm=False)
    outputs = llm.generate(prompts, [GREEDY, broken, GREEDY], use_tqdm=False)
    assert [o.outputs[0].finish_reason for o in outputs] == ["length", "error", "length"]
    assert outputs[1].error is not None and "NaN" in outputs[1].error
    assert [outputs[0].outputs[0].token_ids, outputs[2].outputs[0].token_ids] == [
        o.outputs[0].token_ids for o in alone
    ]
    stats = llm.stats()
    assert stats["num_free_blocks"] == stats["num_kv_blocks"]
    assert stats["num_waiting"] == stats["num_running"] == 0
