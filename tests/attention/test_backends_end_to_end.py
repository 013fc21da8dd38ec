"""The tiny model gives the same greedy tokens with each kernel backend as with the torch reference.

On CPU the Triton kernels run in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1).
"""

from __future__ import annotations

import random

import pytest

from pagedray import LLM, SamplingParams
from pagedray.attention import cpu_kernels
from pagedray.attention.backend import ENV_VAR


def _generate(model: str, backend: str, monkeypatch: pytest.MonkeyPatch) -> list[list[int]]:
    monkeypatch.setenv(ENV_VAR, backend)
    llm = LLM(model, dtype="float32", num_kv_blocks=64, max_num_batched_tokens=32)
    rng = random.Random(5)
    shared = [rng.randrange(10, 500) for _ in range(16)]
    prompts = [
        shared + [rng.randrange(10, 500) for _ in range(5)],
        [rng.randrange(10, 500) for _ in range(40)],  # chunked: 32 tokens, then 8 + decodes
        shared + [rng.randrange(10, 500) for _ in range(3)],  # prefix hit on the shared block
    ]
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    outputs = []
    for prompt in prompts:  # one at a time, so the third request reuses the cached block
        out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
        outputs.append(out[0].outputs[0].token_ids)
    assert llm.engine.executor.worker.attention.name == backend
    assert llm.stats()["prefix_cache_hits"] >= 16
    return outputs


@pytest.mark.parametrize(
    "backend",
    [
        "triton",
        pytest.param(
            "cpu",
            marks=pytest.mark.skipif(
                not cpu_kernels.available(), reason="no working C compiler for the CPU kernels"
            ),
        ),
    ],
)
def test_backend_matches_torch_reference(tiny_llama: str, backend: str, monkeypatch) -> None:
    assert _generate(tiny_llama, backend, monkeypatch) == _generate(
        tiny_llama, "torch", monkeypatch
    )
