"""Prompt logprobs (vLLM's `prompt_logprobs`, OpenAI's echo with logprobs) against transformers'
own forward pass on the same checkpoint: with chunked prefill, n > 1, a prompt whose prefix is
cached (no hit may be taken), preemption, and tensor parallelism."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from pagedray import LLM, SamplingParams

TOP = 3


def _prompts(seed: int = 8) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(10, 500) for _ in range(20)]
    return [
        [rng.randrange(10, 500) for _ in range(37)],
        shared + [rng.randrange(10, 500) for _ in range(7)],
        shared + [rng.randrange(10, 500) for _ in range(11)],  # its prefix is cached by then
        [rng.randrange(10, 500) for _ in range(2)],
    ]


def _hf_prompt_logprobs(path: str, prompt: list[int]) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0].float().log_softmax(dim=-1)


def _check(path: str, prompt: list[int], prompt_logprobs: list) -> None:
    expected = _hf_prompt_logprobs(path, prompt)  # [len, vocab]: row j predicts token j + 1
    assert len(prompt_logprobs) == len(prompt) and prompt_logprobs[0] is None
    for j in range(1, len(prompt)):
        entry = prompt_logprobs[j]
        row = expected[j - 1]
        assert entry[prompt[j]] == pytest.approx(row[prompt[j]].item(), abs=1e-4)
        top = row.topk(TOP)
        assert set(top.indices.tolist()) <= set(entry)
        for token_id, value in zip(top.indices.tolist(), top.values.tolist()):
            assert entry[token_id] == pytest.approx(value, abs=1e-4)


@pytest.mark.parametrize("config", [{}, {"max_num_batched_tokens": 8}], ids=["whole", "chunked"])
def test_prompt_logprobs_match_transformers(tiny_llama: str, config: dict) -> None:
    llm = LLM(tiny_llama, dtype="float32", **config)
    params = SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=TOP, ignore_eos=True)
    prompts = _prompts()
    # One at a time, so the third prompt finds the shared prefix cached (and must not use it).
    outputs = [llm.generate({"prompt_token_ids": p}, params, use_tqdm=False)[0] for p in prompts]
    for prompt, output in zip(prompts, outputs):
        _check(tiny_llama, prompt, output.prompt_logprobs)
    assert llm.stats()["prefix_cache_hits"] == 0
    # Without prompt logprobs the same prompt does take the hit, with the same tokens.
    plain = params.clone(prompt_logprobs=None)
    again = llm.generate({"prompt_token_ids": prompts[2]}, plain, use_tqdm=False)[0]
    assert llm.stats()["prefix_cache_hits"] > 0 and again.prompt_logprobs is None
    assert again.outputs[0].token_ids == outputs[2].outputs[0].token_ids


def test_prompt_logprobs_with_n_and_under_preemption(tiny_llama: str) -> None:
    prompts = _prompts(seed=9)
    params = SamplingParams(
        n=2, temperature=1.0, seed=5, max_tokens=20, prompt_logprobs=1, ignore_eos=True
    )
    roomy = LLM(tiny_llama, dtype="float32").generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False
    )
    tight = LLM(tiny_llama, dtype="float32", num_kv_blocks=8, max_num_batched_tokens=16)
    squeezed = tight.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert tight.stats()["num_preemptions"] > 0
    for a, b in zip(roomy, squeezed):
        assert len(a.outputs) == 2
        assert a.prompt_logprobs[0] is None and b.prompt_logprobs[0] is None
        for x, y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
            assert x.keys() == y.keys()
            assert all(x[t] == pytest.approx(y[t], abs=1e-4) for t in x)
        assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
    assert tight.stats()["num_free_blocks"] == 8


def test_prompt_logprobs_at_tp2(ray_cluster, tiny_llama: str) -> None:
    prompts = _prompts(seed=10)[:2]
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=TOP, ignore_eos=True)
    llm = LLM(tiny_llama, dtype="float32", tensor_parallel_size=2, max_num_batched_tokens=16)
    try:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    finally:
        llm.shutdown()
    for prompt, output in zip(prompts, outputs):
        _check(tiny_llama, prompt, output.prompt_logprobs)


def test_bad_prompt_logprobs_is_refused() -> None:
    with pytest.raises(ValueError, match="^prompt_logprobs: "):
        SamplingParams(prompt_logprobs=-1)
