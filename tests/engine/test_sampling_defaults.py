"""The model's generation_config.json gives the defaults of the sampling fields a request leaves
unset (pagedray/engine/sampling_defaults.py), as vLLM's `--generation-config auto` does: read
as transformers' diff of it, off with "vllm", from another folder when named, with
`--override-generation-config` over it; a request's own values win. Its `max_new_tokens` is the
default `max_tokens`, and a cap where vLLM makes it one. Offline through `LLM` and served
through the OpenAI server over HTTP (the official SDK), token-exact with the offline API."""

from __future__ import annotations

import contextlib
import json
import shutil
from pathlib import Path
from typing import Any, Iterator

import openai
import pytest
from fastapi.testclient import TestClient

from pagedray import LLM, SamplingParams
from pagedray.engine.config import EngineConfig
from pagedray.engine.sampling_defaults import max_tokens_cap, sampling_defaults
from pagedray.openai.local_app import local_openai_app

PROMPT = [5, 17, 33, 2, 9, 41, 7]
# top_k 1 makes an unset temperature's draw greedy; do_sample is no field vLLM takes.
TUNED = {"temperature": 0.8, "top_k": 1, "top_p": None, "do_sample": True}


def _with_generation_config(source: str, folder: Path, written: dict[str, Any]) -> str:
    shutil.copytree(source, folder)
    (folder / "generation_config.json").write_text(json.dumps(written))
    return str(folder)


@pytest.fixture(scope="module")
def tuned(tiny_llama: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    return _with_generation_config(tiny_llama, tmp_path_factory.mktemp("tuned") / "m", TUNED)


def test_the_file_and_the_settings(tuned: str, tmp_path: Path) -> None:
    assert sampling_defaults(EngineConfig(model=tuned)) == {"temperature": 0.8, "top_k": 1}
    assert sampling_defaults(EngineConfig(model=tuned, generation_config="vllm")) == {}
    written = {"top_p": 0.9, "min_p": 0.05, "top_k": 50, "repetition_penalty": 1.0}
    other = _with_generation_config(tuned, tmp_path / "other", written)
    assert sampling_defaults(EngineConfig(model=tuned, generation_config=other)) == written
    missing = EngineConfig(model=tuned, generation_config=str(tmp_path / "nowhere"))
    assert sampling_defaults(missing) == {}


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("{not json", {}),
        ("[0.7]", {}),
        # A value no request could carry is left out, not made every request's 400.
        ('{"top_p": 0, "temperature": "0.7", "min_p": 0.1}', {"min_p": 0.1}),
        ('{"top_k": 20.0, "repetition_penalty": 0}', {"top_k": 20}),
    ],
)
def test_a_broken_file_gives_no_broken_defaults(
    tuned: str, tmp_path: Path, text: str, expected: dict
) -> None:
    folder = _with_generation_config(tuned, tmp_path / "broken", {})
    (Path(folder) / "generation_config.json").write_text(text)
    assert sampling_defaults(EngineConfig(model=folder)) == expected


def test_offline_generate_samples_with_the_models_defaults(tuned: str) -> None:
    llm = LLM(tuned, num_kv_blocks=64, max_num_seqs=4)
    try:
        assert llm.get_default_sampling_params() == SamplingParams(temperature=0.8, top_k=1)
        prompts = [{"prompt_token_ids": PROMPT}]
        greedy = llm.generate(prompts, SamplingParams(temperature=0.0), use_tqdm=False)
        default = llm.generate(prompts, use_tqdm=False)  # no parameters: the model's
        # top_k 1: whatever the temperature, the top token
        assert default[0].outputs[0].token_ids == greedy[0].outputs[0].token_ids
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
    assert completion(seed=5) == greedy  # the model's top_k 1
    # The request's top_k (all tokens) wins; its temperature is the model's 0.8.
    own = completion(top_k=0, seed=7)
    llm = LLM(tuned, num_kv_blocks=64, max_num_seqs=4)
    try:
        params = SamplingParams(temperature=0.8, top_k=0, seed=7, max_tokens=8, ignore_eos=True)
        offline = llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)
    finally:
        llm.shutdown()
    assert own == offline[0].outputs[0].text


def test_a_response_echoes_the_sampling_it_got(served: openai.OpenAI) -> None:
    response = served.responses.create(model="x", input="Hello", max_output_tokens=4, store=False)
    assert response.temperature == 0.8  # the model's
    assert response.top_p == 1.0  # neither the request's nor the model's: the neutral one
    own = served.responses.create(
        model="x", input="Hello", max_output_tokens=4, store=False, temperature=0.3
    )
    assert own.temperature == 0.3


# ---- --override-generation-config and max_new_tokens ----------------------------------------


def _defaults_and_cap(**settings: Any) -> tuple[dict[str, Any], int | None]:
    config = EngineConfig(**settings)
    defaults = sampling_defaults(config)
    return defaults, max_tokens_cap(config, defaults)


def test_the_override_and_the_output_limit(tuned: str, tmp_path: Path) -> None:
    override = '{"temperature": 0.5, "max_new_tokens": 6}'  # as the flag gives it
    assert _defaults_and_cap(model=tuned, override_generation_config=override) == (
        {"temperature": 0.5, "top_k": 1, "max_tokens": 6},
        6,  # the override's max_new_tokens caps every request (vLLM's override_max_tokens)
    )
    # "vllm": the override alone.
    assert _defaults_and_cap(
        model=tuned, generation_config="vllm", override_generation_config={"top_p": 0.9}
    ) == ({"top_p": 0.9}, None)
    limited = _with_generation_config(tuned, tmp_path / "limited", {"max_new_tokens": 5.0})
    # The model's own file: a default, not a cap; a folder named by the setting: both.
    assert _defaults_and_cap(model=limited) == ({"max_tokens": 5}, None)
    assert _defaults_and_cap(model=tuned, generation_config=limited) == ({"max_tokens": 5}, 5)
    # A limit no request could carry is left out, and caps nothing.
    broken = {"max_new_tokens": 0}
    assert _defaults_and_cap(model=limited, override_generation_config=broken) == ({}, None)
    with pytest.raises(ValueError, match="override_generation_config"):
        EngineConfig(model=tuned, override_generation_config="{temperature: 0.5}")


@pytest.fixture(scope="module")
def limited(tiny_llama: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    folder = tmp_path_factory.mktemp("limited") / "m"
    return _with_generation_config(tiny_llama, folder, {"max_new_tokens": 5})


@contextlib.contextmanager
def _served(config: EngineConfig) -> Iterator[openai.OpenAI]:
    with TestClient(local_openai_app(config)) as http:  # its lifespan stops the engine
        yield openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=http)


@pytest.fixture(scope="module")
def served_limited(limited: str) -> Iterator[openai.OpenAI]:
    config = EngineConfig(
        model=limited, num_kv_blocks=64, max_num_seqs=8, max_model_len=40, served_model_name=["x"]
    )
    with _served(config) as client:
        yield client


def test_offline_default_max_tokens(limited: str) -> None:
    llm = LLM(limited, num_kv_blocks=64, max_num_seqs=4)
    try:
        assert llm.get_default_sampling_params() == SamplingParams(max_tokens=5)
    finally:
        llm.shutdown()


def _chat_tokens(client: openai.OpenAI, **fields: Any) -> tuple[int, str]:
    answer = client.chat.completions.create(
        model="x",
        messages=[{"role": "user", "content": "Hello"}],
        extra_body={"ignore_eos": True},
        **fields,
    )
    assert answer.usage is not None
    return answer.usage.completion_tokens, answer.choices[0].finish_reason


def test_served_max_new_tokens_is_the_default_max_tokens(served_limited: openai.OpenAI) -> None:
    assert _chat_tokens(served_limited) == (5, "length")  # the model's default
    assert _chat_tokens(served_limited, max_tokens=8) == (8, "length")  # the request's
    # A default past the room left in the context is that room, as vLLM clamps it; the
    # same number of tokens asked for by the client is refused (vLLM's 400).
    long = [5] * 37  # 37 of max_model_len 40: room for 3
    answer = served_limited.completions.create(
        model="x", prompt=long, max_tokens=None, extra_body={"ignore_eos": True}
    )
    assert answer.usage is not None and answer.usage.completion_tokens == 3
    with pytest.raises(openai.BadRequestError, match="too large: 5"):
        served_limited.completions.create(model="x", prompt=long, max_tokens=5)


def test_served_override_caps_every_request(limited: str) -> None:
    config = EngineConfig(
        model=limited,
        num_kv_blocks=64,
        max_num_seqs=8,
        served_model_name=["x"],
        override_generation_config='{"max_new_tokens": 3}',
    )
    with _served(config) as client:
        assert _chat_tokens(client) == (3, "length")
        assert _chat_tokens(client, max_tokens=8) == (3, "length")  # capped
        assert _chat_tokens(client, max_tokens=2) == (2, "length")
        answer = client.completions.create(
            model="x", prompt=["a", "b"], max_tokens=8, extra_body={"ignore_eos": True}
        )
        assert answer.usage is not None and answer.usage.completion_tokens == 2 * 3
        # A Response echoes the limit it ran with, as vLLM's: the cap, or the default.
        for asked in (8, None):
            response = client.responses.create(
                model="x", input="Hello", max_output_tokens=asked, store=False
            )
            assert response.max_output_tokens == 3


def test_a_response_without_a_limit_echoes_the_room_left(served_limited: openai.OpenAI) -> None:
    response = served_limited.responses.create(model="x", input="Hello", store=False)
    assert response.max_output_tokens == 5  # the model's default
    assert response.usage is not None and response.usage.output_tokens <= 5
