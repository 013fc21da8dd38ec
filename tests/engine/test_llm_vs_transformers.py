"""Greedy output of `LLM.generate` is token-identical to transformers' `generate`.

Across all four architectures, prompts crossing block boundaries, chunked prefill, prefix
caching on and off, and preemption under a tiny KV pool.
"""

from __future__ import annotations

import random

import pytest

from pagedray import LLM, SamplingParams
from pagedray.tools.default_model import ARCHS

MAX_NEW = 12
# Lengths around the 16-token block boundary, and one spanning several blocks.
PROMPT_LENS = (5, 15, 16, 17, 33, 47)


def _prompts(vocab: int, seed: int = 1) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(10, vocab) for _ in range(20)]
    prompts = [[rng.randrange(10, vocab) for _ in range(n)] for n in PROMPT_LENS]
    prompts.append(shared + [rng.randrange(10, vocab) for _ in range(9)])  # shares a block
    prompts.append(shared + [rng.randrange(10, vocab) for _ in range(14)])
    return prompts


def _ours(path: str, prompts: list[list[int]], **engine_kwargs) -> tuple[list[list[int]], dict]:
    llm = LLM(path, dtype="float32", **engine_kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs], llm.stats()


CONFIGS = {
    "default": {},
    "chunked_prefill": {"max_num_batched_tokens": 8},
    "no_prefix_caching": {"enable_prefix_caching": False},
    "preemption": {"num_kv_blocks": 6, "max_num_batched_tokens": 64},
}


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("config", list(CONFIGS))
def test_greedy_tokens_identical_to_transformers(tiny_models, arch, config, hf_greedy):
    path = tiny_models[arch]
    prompts = _prompts(vocab=500)
    expected = hf_greedy(path, prompts, MAX_NEW)
    ours, stats = _ours(path, prompts, **CONFIGS[config])
    assert ours == expected
    if config == "preemption":
        assert stats["num_preemptions"] > 0


def test_prompts_sent_together_share_a_prefix_computed_in_the_same_step(tiny_llama, hf_greedy):
    """All prompts fit the first step: the last one reads the shared block the one before it
    computes in that very step (stored before any attention reads it), with the same tokens."""
    prompts = _prompts(vocab=500)
    ours, stats = _ours(tiny_llama, prompts)
    assert ours == hf_greedy(tiny_llama, prompts, MAX_NEW)
    assert stats["num_steps"] == MAX_NEW  # one prefill step for all: no hit came from a later one
    assert stats["prefix_cache_hits"] == 16


def test_prefix_cache_rerun_gives_same_tokens(tiny_llama, hf_greedy):
    prompts = _prompts(vocab=500)
    llm = LLM(tiny_llama, dtype="float32")
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    requests = [{"prompt_token_ids": p} for p in prompts]
    first = [o.outputs[0].token_ids for o in llm.generate(requests, params, use_tqdm=False)]
    hits_before = llm.stats()["prefix_cache_hits"]
    second = [o.outputs[0].token_ids for o in llm.generate(requests, params, use_tqdm=False)]
    assert second == first == hf_greedy(tiny_llama, prompts, MAX_NEW)
    assert llm.stats()["prefix_cache_hits"] > hits_before
