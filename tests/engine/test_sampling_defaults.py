"""The model's generation_config.json gives the defaults of the sampling fields a request leaves
unset (pagedray/engine/sampling_defaults.py), as vLLM's `--generation-config auto` does: read
as transformers' diff of it, off with "vllm", from another folder when named; a request's own
values win. Offline through `LLM` and served through the OpenAI server over HTTP (the official
SDK), token-exact with the offline API."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Iterator

import openai
import pytest
from fastapi.testclient import TestClient

from pagedray import LLM, SamplingParams
from pagedray.engine.config import EngineConfig
from pagedray.engine.sampling_defaults import sampling_defaults
from pagedray.openai.local_app import local_openai_app

PROMPT = [5, 17, 33, 2, 9, 41, 7]
# top_k 1 makes an unset temperature's draw greedy; top_k 50 and temperature 1.0 are at
# transformers' defaults, so they are no defaults (vLLM reads the file's diff).
TUNED = {"temperature": 0.8, "top_k": 1, "top_p": 1.0, "repetition_penalty": 1.0, "do_sample": True}


def _with_generation_config(source: str, folder: Path, written: dict[str, Any]) -> str:
    shutil.copytree(source, folder)
    (folder / "generation_config.json").write_text(json.dumps(written))
    return str(folder)


@pytest.fixture(scope="module")
def tuned(tiny_llama: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    return _with_generation_config(tiny_llama, tmp_path_factory.mktemp("tuned") / "m", TUNED)


def test_the_file_read_as_transformers_diff_and_the_settings(tuned: str, tmp_path: Path) -> None:
    assert sampling_defaults(EngineConfig(model=tuned)) == {"temperature": 0.8, "top_k": 1}
    assert sampling_defaults(EngineConfig(model=tuned, generation_config="vllm")) == {}
    other = _with_generation_config(tuned, tmp_path / "other", {"top_p": 0.9, "min_p": 0.05})
    named = EngineConfig(model=tuned, generation_config=other)
    assert sampling_defaults(named) == {"top_p": 0.9, "min_p": 0.05}
    bare = tmp_path / "bare"
    shutil.copytree(tuned, bare)
    (bare / "generation_config.json").unlink()
    assert sampling_defaults(EngineConfig(model=str(bare))) == {}


def test_offline_generate_samples_with_the_models_defaults(tuned: str) -> None:
    llm = LLM(tuned, num_kv_blocks=64, max_num_seqs=4)
    try:
        assert llm.get_default_sampling_params() == SamplingParams(temperature=0.8, top_k=1)
        prompts = [{"prompt_token_ids": PROMPT}]
        greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        default = llm.get_default_sampling_params()
        default.max_tokens, default.ignore_eos = 8, True
        tokens = [llm.generate(prompts, p, use_tqdm=False)[0].outputs[0].token_ids
                  for p in (greedy, default)]  # fmt: skip
        assert tokens[0] == tokens[1]  # top_k 1: whatever the temperature, the top token
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def served(tuned: str) -> Iterator[openai.OpenAI]:
    config = EngineConfig(model=tuned, num_kv_blocks=64, max_num_seqs=8, served_model_name=["x"])
    with TestClient(local_openai_app(config)) as http:  # its lifespan stops the engine
        yield openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=http)


def test_served_requests_take_the_defaults_and_their_own_values_win(
    served: openai.OpenAI, tuned: str
) -> None:
    def completion(**fields: Any) -> str:
        answer = served.completions.create(
            model="x", prompt=PROMPT, max_tokens=8, extra_body={"ignore_eos": True, **fields}
        )
        return answer.choices[0].text

    greedy = completion(temperature=0)
    assert completion() == greedy  # the model's top_k 1
    # The request's top_k (all tokens) wins; its temperature is the model's 0.8.
    own = completion(top_k=0, seed=7)
    llm = LLM(tuned, num_kv_blocks=64, max_num_seqs=4)
    try:
        params = SamplingParams(temperature=0.8, top_k=0, seed=7, max_tokens=8, ignore_eos=True)
        offline = llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)
    finally:
        llm.shutdown()
    assert own == offline[0].outputs[0].text
