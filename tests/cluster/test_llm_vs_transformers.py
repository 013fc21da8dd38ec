"""Greedy output of `LLM.generate` is token-identical to transformers' `generate`.

Across all four architectures, prompts crossing block boundaries, chunked prefill, prefix
caching on and off, and preemption under a tiny KV pool.
"""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from pagedray import LLM, SamplingParams
from pagedray.cluster.default_model import ARCHS

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


_HF_CACHE: dict[str, list[list[int]]] = {}


def _hf_greedy(path: str, prompts: list[list[int]]) -> list[list[int]]:
    if path not in _HF_CACHE:
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
        _HF_CACHE[path] = outputs
    return _HF_CACHE[path]


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
def test_greedy_tokens_identical_to_transformers(tiny_models, arch, config):
    path = tiny_models[arch]
    prompts = _prompts(vocab=500)
    expected = _hf_greedy(path, prompts)
    ours, stats = _ours(path, prompts, **CONFIGS[config])
    assert ours == expected
    if config == "preemption":
        assert stats["num_preemptions"] > 0


def test_prefix_cache_rerun_gives_same_tokens(tiny_llama):
    prompts = _prompts(vocab=500)
    llm = LLM(tiny_llama, dtype="float32")
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    requests = [{"prompt_token_ids": p} for p in prompts]
    first = [o.outputs[0].token_ids for o in llm.generate(requests, params, use_tqdm=False)]
    hits_before = llm.stats()["prefix_cache_hits"]
    second = [o.outputs[0].token_ids for o in llm.generate(requests, params, use_tqdm=False)]
    assert second == first == _hf_greedy(tiny_llama, prompts)
    assert llm.stats()["prefix_cache_hits"] > hits_before
