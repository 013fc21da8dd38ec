"""The OpenAI server end to end: real Ray, real Serve over HTTP, the official `openai` client.

Small apps share one Serve instance, each under its own route prefix: "main" (two engine replicas,
each with its worker as a Ray actor in the replica's placement group) for the whole module, then
one at a time "limited" (an API key; one running and one waiting request at most), "broken" (an
engine whose step raises) and "tp2" (tensor_parallel_size=2).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import itertools
import json
import pickle
import time
from typing import Any, Callable, Iterator

import httpx
import openai
import pytest
from _serve_apps import deploy_app
from prometheus_client.parser import text_string_to_metric_families

from pagedray import LLM, SamplingParams
from pagedray.engine.wire import GenerateRequest
from pagedray.scheduler.request_failure import FailureKind

MODEL = "tiny"
ALIAS = "tiny-alias"  # the main app's second served name (vLLM's --served-model-name a b)
API_KEY = "sk-test-secret"
ENGINE_ARGS: dict[str, Any] = {
    "served_model_name": MODEL,
    "num_kv_blocks": 64,
    "num_threads": 1,
    "ingress_num_cpus": 0.1,
}
# The in-process worker: one process fewer for apps that do not test the worker path.
IN_PROCESS = {**ENGINE_ARGS, "use_ray_workers": False}
# Ray's metrics agent exports every metrics_report_interval_ms (10 s by default).
EXPORT_TIMEOUT_S = 30.0


@pytest.fixture(scope="module")
def main_url(serve_url: str, tiny_llama: str) -> Iterator[str]:
    from pagedray.cluster.openai_app import build_app

    args = {**ENGINE_ARGS, "model": tiny_llama, "num_replicas": 2}  # routed cache-aware
    args["served_model_name"] = [MODEL, ALIAS]
    yield from deploy_app(serve_url, "main", build_app(args))


@pytest.fixture(scope="module")
def client(main_url: str) -> openai.OpenAI:
    # max_retries=0: the SDK would otherwise retry 503s and hide them.
    return openai.OpenAI(base_url=f"{main_url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def offline(tiny_llama: str) -> LLM:
    return LLM(tiny_llama, num_kv_blocks=64, num_threads=1)


def _stats(url: str) -> list[dict[str, Any]]:
    response = httpx.get(f"{url}/stats", headers={"Authorization": f"Bearer {API_KEY}"})
    assert response.status_code == 200, response.text
    return response.json()["replicas"]


def _error(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


# ---- generation ----------------------------------------------------------------------------


def test_greedy_completion_matches_offline_llm(client: openai.OpenAI, offline: LLM) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    expected = offline.generate("The quick brown fox", params, use_tqdm=False)[0]
    response = client.completions.create(
        model=MODEL,
        prompt="The quick brown fox",
        max_tokens=12,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert response.choices[0].text == expected.outputs[0].text
    assert response.choices[0].finish_reason == "length"
    usage = response.usage
    assert usage.prompt_tokens == len(expected.prompt_token_ids)
    assert usage.completion_tokens == 12
    assert usage.total_tokens == usage.prompt_tokens + 12
    assert usage.prompt_tokens_details.cached_tokens >= 0


def test_streamed_completion_equals_whole(client: openai.OpenAI) -> None:
    kwargs = dict(model=MODEL, prompt=[5, 17, 42, 99], max_tokens=10, temperature=0)
    whole = client.completions.create(**kwargs)
    chunks = list(
        client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_chat_whole_and_streamed(client: openai.OpenAI, main_url: str) -> None:
    messages = [{"role": "user", "content": "Say something."}]
    whole = client.chat.completions.create(
        model=MODEL, messages=messages, max_completion_tokens=8, temperature=0
    )
    assert whole.choices[0].message.role == "assistant"
    tokenized = httpx.post(f"{main_url}/tokenize", json={"messages": messages}).json()
    assert whole.usage.prompt_tokens == tokenized["count"]
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=8, temperature=0, stream=True
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == whole.choices[0].message.content


def test_n2_with_logprobs(client: openai.OpenAI) -> None:
    response = client.completions.create(
        model=MODEL, prompt="hello world", n=2, max_tokens=6, logprobs=2, seed=7
    )
    assert [c.index for c in response.choices] == [0, 1]
    assert response.usage.completion_tokens == 12
    for choice in response.choices:
        logprobs = choice.logprobs
        assert len(logprobs.tokens) == len(logprobs.token_logprobs) == 6
        assert all(lp <= 0 for lp in logprobs.token_logprobs)
        assert all(2 <= len(top) <= 3 for top in logprobs.top_logprobs)
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        n=2,
        max_tokens=4,
        logprobs=True,
        top_logprobs=3,
    )
    assert len(chat.choices) == 2
    for choice in chat.choices:
        assert len(choice.logprobs.content) == 4
        assert all(len(t.top_logprobs) == 3 for t in choice.logprobs.content)


STOP_KWARGS: dict[str, Any] = dict(
    model=MODEL,
    prompt="Once upon a time",
    max_tokens=16,
    temperature=0,
    extra_body={"ignore_eos": True},
)


def _stop_across_tokens(client: openai.OpenAI) -> tuple[str, str, int]:
    """A stop string made of the end of one token and the start of the next, read from the
    greedy text; returns it, the text before it and the index of the token it ends in."""
    full = client.completions.create(**STOP_KWARGS, logprobs=0).choices[0]
    tokens, text, offsets = full.logprobs.tokens, full.text, full.logprobs.text_offset
    # NOTE: token names of partial characters are `bytes:` names, not text: read the text.
    for i in range(2, len(tokens) - 1):
        candidate = text[offsets[i + 1] - 1 : offsets[i + 1] + 1]
        if len(candidate) == 2 and text.find(candidate) == offsets[i + 1] - 1:
            return candidate, text[: text.index(candidate)], i + 1
    raise AssertionError(f"no stop string spans two tokens of {tokens}")


def test_stop_string_across_token_boundary(client: openai.OpenAI) -> None:
    kwargs = STOP_KWARGS
    stop, expected, _ = _stop_across_tokens(client)
    stopped = client.completions.create(**kwargs, stop=[stop]).choices[0]
    assert (stopped.text, stopped.finish_reason) == (expected, "stop")
    streamed = client.completions.create(**kwargs, stop=stop, stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == expected


def test_a_stop_string_found_by_the_ingress_stops_the_engine(
    client: openai.OpenAI, main_url: str
) -> None:
    """The engine streams token ids; the ingress finds the stop string, ends the request there
    (usage counts tokens up to it) and aborts the rest in the engine."""
    stop, expected, last_index = _stop_across_tokens(client)
    steps_before = _total_steps(main_url)
    kwargs = {**STOP_KWARGS, "max_tokens": 1000, "stop": [stop]}
    for stream in (False, True):
        if stream:
            chunks = list(
                client.completions.create(
                    **kwargs, stream=True, stream_options={"include_usage": True}
                )
            )
            text = "".join(c.choices[0].text for c in chunks if c.choices)
            usage = chunks[-1].usage
            reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
            finish_reason = reasons[-1]
        else:
            response = client.completions.create(**kwargs)
            text, usage = response.choices[0].text, response.usage
            finish_reason = response.choices[0].finish_reason
        assert (text, finish_reason) == (expected, "stop")
        assert usage.completion_tokens == last_index + 1  # up to the token that completed it
    _wait_all_blocks_free(main_url, timeout_s=2.0)
    # Not aborted, each would have run ~1000 steps.
    assert _total_steps(main_url) - steps_before < 500


def test_seed_reproduces(client: openai.OpenAI) -> None:
    def sample(seed: int) -> str:
        return (
            client.completions.create(
                model=MODEL,
                prompt="hello",
                max_tokens=16,
                temperature=1.0,
                seed=seed,
                extra_body={"ignore_eos": True},
            )
            .choices[0]
            .text
        )

    assert sample(123) == sample(123)
    assert sample(123) != sample(124)


def test_batch_of_prompts_and_echo(client: openai.OpenAI) -> None:
    response = client.completions.create(
        model=MODEL, prompt=["one two", "three four"], max_tokens=3, n=2, echo=True, temperature=0
    )
    assert [c.index for c in response.choices] == [0, 1, 2, 3]
    assert response.choices[0].text.startswith("one two")
    assert response.choices[3].text.startswith("three four")


# ---- errors -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/v1/completions", {"prompt": "hi", "temperature": -1}, 400, "temperature"),
        ("/v1/completions", {"prompt": "hi", "n": 0}, 400, "n"),
        ("/v1/completions", {"prompt": "hi", "top_p": 1.5}, 400, "top_p"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": "many"}, 400, "max_tokens"),
        ("/v1/completions", {"prompt": "x " * 2000}, 400, "prompt"),
        ("/v1/completions", {"prompt": [99999]}, 400, "prompt_token_ids"),
        ("/v1/completions", {"prompt": "hi", "logit_bias": {"x": 1}}, 400, "logit_bias"),
        ("/v1/completions", {"prompt": "hi", "logit_bias": {"3": 101}}, 400, "logit_bias"),
        ("/v1/completions", {"prompt": "hi", "logit_bias": {"99999": 1}}, 400, "logit_bias"),
        ("/v1/completions", {"prompt": 5}, 400, "prompt"),
        ("/v1/completions", {"prompt": "hi", "stream_options": {"include_usage": True}}, 400, None),
        ("/v1/completions", {"prompt": "hi", "model": "gpt-4"}, 404, "model"),
        ("/v1/chat/completions", {"messages": []}, 400, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "user"}], "top_logprobs": 2}, 400, None),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 50},
            400,
            "top_logprobs",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0},
            400,
            "max_completion_tokens",
        ),
        ("/v1/chat/completions", {"messages": [{"role": "ctx", "content": "x"}]}, 400, "messages"),
    ],
)
def test_bad_requests_are_refused(
    main_url: str, path: str, body: dict[str, Any], status: int, param: str | None
) -> None:
    error = _error(httpx.post(f"{main_url}{path}", json=body), status)
    if param is not None:
        assert error["param"] == param
    assert error["code"] == status


def test_echo_with_logprobs_scores_the_prompt(client: openai.OpenAI, offline: LLM) -> None:
    """What lm-eval's loglikelihood asks of a completions server: echo, logprobs, 1 token."""
    prompt_ids = [17, 250, 3, 99, 481, 20, 5, 77, 300, 12]
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=2, logprobs=2)
    expected = offline.generate({"prompt_token_ids": prompt_ids}, params, use_tqdm=False)[0]
    kwargs: dict[str, Any] = dict(
        model=MODEL, prompt=prompt_ids, max_tokens=1, temperature=0, logprobs=2, echo=True
    )
    choice = client.completions.create(**kwargs).choices[0]
    logprobs = choice.logprobs
    assert len(logprobs.tokens) == len(prompt_ids) + 1
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    for j in range(1, len(prompt_ids)):
        want = expected.prompt_logprobs[j][prompt_ids[j]]
        assert logprobs.token_logprobs[j] == pytest.approx(want, abs=1e-5)
        assert 2 <= len(logprobs.top_logprobs[j]) <= 3
    generated = expected.outputs[0]
    assert logprobs.token_logprobs[-1] == pytest.approx(
        generated.logprobs[0][generated.token_ids[0]], abs=1e-5
    )
    assert logprobs.text_offset == sorted(logprobs.text_offset)
    assert choice.text.endswith(generated.text) and len(choice.text) > len(generated.text)
    # Streamed: the echo chunk carries the prompt's logprobs, then the generated token's.
    chunks = [c.choices[0] for c in client.completions.create(**kwargs, stream=True)]
    assert "".join(c.text for c in chunks) == choice.text
    streamed = [lp for c in chunks if c.logprobs for lp in c.logprobs.token_logprobs]
    assert streamed[0] is None
    assert streamed[1:] == pytest.approx(logprobs.token_logprobs[1:], abs=1e-6)


def test_logit_bias_through_the_sdk(client: openai.OpenAI, offline: LLM) -> None:
    forced = SamplingParams(temperature=0.0, max_tokens=6, logit_bias={42: 100})
    expected = offline.generate("bias", forced, use_tqdm=False)[0].outputs[0]
    assert expected.token_ids == [42] * 6
    kwargs: dict[str, Any] = dict(model=MODEL, max_tokens=6, temperature=0, logit_bias={"42": 100})
    completion = client.completions.create(**kwargs, prompt="bias")
    assert completion.choices[0].text == expected.text
    chat = client.chat.completions.create(
        **kwargs, messages=[{"role": "user", "content": "hi"}], logprobs=True
    )
    tokens = [t.token for t in chat.choices[0].logprobs.content]
    assert len(tokens) == 6 and len(set(tokens)) == 1
    assert "".join(tokens) == expected.text


def test_engine_serves_after_errors(client: openai.OpenAI, main_url: str) -> None:
    _error(httpx.post(f"{main_url}/v1/completions", content=b"{not json"), 400)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="hi", max_tokens=4, temperature=-1)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="unknown", prompt="hi", max_tokens=4)
    response = client.completions.create(model=MODEL, prompt="hi", max_tokens=4)
    assert response.usage.completion_tokens == 4


def test_max_tokens_that_cannot_fit_is_400_in_vllms_words(
    client: openai.OpenAI, main_url: str
) -> None:
    max_model_len = httpx.get(f"{main_url}/v1/models").json()["data"][0]["max_model_len"]
    num_prompt = httpx.post(f"{main_url}/tokenize", json={"prompt": "Hello"}).json()["count"]
    too_many = max_model_len - num_prompt + 1
    message = (
        f"'max_tokens' or 'max_completion_tokens' is too large: {too_many}. This model's maximum "
        f"context length is {max_model_len} tokens and your request has {num_prompt} input "
        f"tokens ({too_many} > {max_model_len} - {num_prompt})."
    )
    url = f"{main_url}/v1/completions"
    for stream in (False, True):  # refused before any 200, streamed or not
        body = {"model": MODEL, "prompt": "Hello", "max_tokens": too_many, "stream": stream}
        error = _error(httpx.post(url, json=body), 400)
        assert error == {
            "message": message,
            "type": "BadRequestError",
            "param": "max_tokens",
            "code": 400,
        }
    with pytest.raises(openai.BadRequestError, match="is too large"):
        client.completions.create(model=MODEL, prompt="Hello", max_tokens=too_many)
    # Chat names the field the client set.
    chat_prompt = {"model": MODEL, "messages": [{"role": "user", "content": "Hello"}]}
    for field in ("max_tokens", "max_completion_tokens"):
        body = {**chat_prompt, field: 100_000}
        error = _error(httpx.post(f"{main_url}/v1/chat/completions", json=body), 400)
        assert error["param"] == field and error["message"].startswith(
            "'max_tokens' or 'max_completion_tokens' is too large: 100000."
        )
    # Exactly what fits is served.
    fits = {"model": MODEL, "prompt": [5] * (max_model_len - 2), "max_tokens": 2}
    assert httpx.post(url, json=fits, timeout=60).json()["usage"]["completion_tokens"] == 2


def test_metrics_on_the_api_port(main_url: str) -> None:
    """vLLM's /metrics: pagedray's series of Ray's export, each family's HELP and TYPE once."""
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    assert httpx.post(f"{main_url}/v1/completions", json=body, timeout=60).status_code == 200
    deadline = time.monotonic() + EXPORT_TIMEOUT_S
    while True:
        response = httpx.get(f"{main_url}/metrics", timeout=30)
        assert response.status_code == 200, response.text
        generated = [
            sample.value
            for family in text_string_to_metric_families(response.text)
            for sample in family.samples
            if sample.name == "ray_pagedray_generation_tokens_total"
        ]
        assert generated, "the series exist from the start, at 0 before Ray's first export"
        if sum(generated) > 0:
            break
        assert time.monotonic() < deadline, response.text[:2000]
        time.sleep(1.0)
    assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
    headers = [line for line in response.text.splitlines() if line.startswith("#")]
    assert len(headers) == len(set(headers))
    families = list(text_string_to_metric_families(response.text))
    assert families and all(f.name.startswith("ray_pagedray_") for f in families)
    assert "/metrics" not in httpx.get(f"{main_url}/openapi.json").json()["paths"]


def _exported_series(key_of: Callable[[str, dict[str, str]], str | None]) -> dict[str, float]:
    """Ray's Prometheus endpoint: MODEL's samples, summed by `key_of(name, labels)` over
    replicas and processes (a sample whose key is None is left out)."""
    import ray

    port = next(node["MetricsExportPort"] for node in ray.nodes() if node["Alive"])
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = key_of(sample.name, sample.labels)
            if sample.labels.get("model_name") == MODEL and key is not None:
                values[key] = values.get(key, 0.0) + sample.value
    return values


def _ingress_series() -> dict[str, float]:
    """The ingress's series, `name{route,status}` → value."""

    def key_of(name: str, labels: dict[str, str]) -> str | None:
        if "route" not in labels or "le" in labels:
            return None
        return f"{name}{{{labels['route']},{labels.get('status', '')}}}"

    return _exported_series(key_of)


def test_ingress_counts_answers_by_status(main_url: str) -> None:
    before = _ingress_series()
    url = f"{main_url}/v1/completions"
    ok = httpx.post(url, json={"model": MODEL, "prompt": "hi", "max_tokens": 2}, timeout=60)
    assert ok.status_code == 200, ok.text
    _error(httpx.post(url, json={"prompt": "hi", "n": 0}), 400)
    counter = "ray_pagedray_http_requests_total"
    # At least: other tests' answers may be exported with ours.
    least = {
        f"{counter}{{/v1/completions,200}}": 1.0,
        f"{counter}{{/v1/completions,400}}": 1.0,
        "ray_pagedray_http_request_latency_seconds_count{/v1/completions,}": 2.0,
    }
    least = {key: before.get(key, 0.0) + increase for key, increase in least.items()}
    deadline = time.monotonic() + EXPORT_TIMEOUT_S
    after = _ingress_series()
    while any(after.get(key, 0.0) < value for key, value in least.items()):
        assert time.monotonic() < deadline, {key: after.get(key) for key in least}
        time.sleep(1.0)
        after = _ingress_series()
    # Exported before any such answer, so an error-rate query has its series from the start.
    assert f"{counter}{{/v1/chat/completions,503}}" in after


# ---- cancellation, health, stats ----------------------------------------------------------


def _wait_all_blocks_free(url: str, timeout_s: float) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout_s
    while True:
        replicas = _stats(url)
        if all(
            r["num_free_blocks"] == r["num_kv_blocks"] and r["num_requests"] == 0 for r in replicas
        ):
            return replicas
        assert time.monotonic() < deadline, replicas
        time.sleep(0.05)


def _total_steps(url: str) -> int:
    return sum(int(r["num_steps"]) for r in _stats(url))


LONG = {"model": MODEL, "prompt": "a long one", "max_tokens": 1000, "ignore_eos": True}


def test_client_disconnect_mid_stream_frees_blocks(client: openai.OpenAI, main_url: str) -> None:
    steps_before = _total_steps(main_url)
    with httpx.stream("POST", f"{main_url}/v1/completions", json={**LONG, "stream": True}) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
    _wait_all_blocks_free(main_url, timeout_s=2.0)
    # Had it not been aborted, the request would have run ~1000 steps.
    assert _total_steps(main_url) - steps_before < 500
    assert client.completions.create(model=MODEL, prompt="hi", max_tokens=3).choices[0].text


def test_client_disconnect_while_waiting_frees_blocks(main_url: str) -> None:
    steps_before = _total_steps(main_url)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{main_url}/v1/completions", json=LONG, timeout=httpx.Timeout(10, read=0.5))
    _wait_all_blocks_free(main_url, timeout_s=2.0)
    # Aborted: it stopped short of its 1000 tokens (one step each), and nothing steps after.
    steps_after = _total_steps(main_url)
    assert steps_after - steps_before < LONG["max_tokens"]
    time.sleep(0.3)
    assert _total_steps(main_url) == steps_after


def test_health_models_and_tokenizer_routes(main_url: str) -> None:
    health = httpx.get(f"{main_url}/health")
    # Nothing but the status: replica ids and step counts are for /stats.
    assert health.status_code == 200 and health.json() == {"status": "ok"}
    models = httpx.get(f"{main_url}/v1/models").json()
    assert [m["id"] for m in models["data"]] == [MODEL, ALIAS]
    text = "Hello, world! Zürich 😀"
    tokens = httpx.post(
        f"{main_url}/tokenize", json={"prompt": text, "add_special_tokens": False}
    ).json()
    assert tokens["count"] == len(tokens["tokens"]) > 0
    back = httpx.post(f"{main_url}/detokenize", json={"tokens": tokens["tokens"]}).json()
    assert back["prompt"] == text
    _error(httpx.post(f"{main_url}/detokenize", json={"tokens": [10**6]}), 400)


def test_every_served_name_is_listed_retrieved_and_served(
    client: openai.OpenAI, main_url: str
) -> None:
    """As vLLM's: a request may name either; answers report the first."""
    assert [model.id for model in client.models.list()] == [MODEL, ALIAS]
    card = client.models.retrieve(ALIAS)
    assert (card.id, card.object) == (ALIAS, "model") and card.model_extra["max_model_len"] > 0
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")
    error = _error(httpx.get(f"{main_url}/v1/models/gpt-4"), 404)
    assert (error["type"], error["param"]) == ("NotFoundError", "model")
    response = client.completions.create(model=ALIAS, prompt="hi", max_tokens=2)
    assert response.model == MODEL and response.usage.completion_tokens == 2


def test_cors_as_vllms_defaults(main_url: str) -> None:
    """A page on another origin may call the API: its preflight is answered, and every answer
    allows it (vLLM's defaults: any origin, method and header)."""
    origin = {"Origin": "https://app.example"}
    preflight = {
        **origin,
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type",
    }
    response = httpx.options(f"{main_url}/v1/chat/completions", headers=preflight)
    assert response.status_code == 200, response.text
    assert response.headers["access-control-allow-origin"] == "*"
    assert "POST" in response.headers["access-control-allow-methods"]
    assert "authorization" in response.headers["access-control-allow-headers"].lower()
    models = httpx.get(f"{main_url}/v1/models", headers=origin)
    assert models.status_code == 200 and models.headers["access-control-allow-origin"] == "*"


def test_both_replicas_serve(client: openai.OpenAI, main_url: str) -> None:
    def one(_: int) -> int:
        return client.completions.create(model=MODEL, prompt="hi", max_tokens=8).usage.total_tokens

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        for _ in range(5):
            list(pool.map(one, range(16)))
            replicas = _stats(main_url)
            if all(r["num_steps"] > 0 for r in replicas):
                break
    assert len({r["replica_id"] for r in replicas}) == 2
    assert all(r["num_steps"] > 0 for r in replicas), replicas


def test_concurrent_streams_on_both_replicas_come_through_their_channels(
    client: openai.OpenAI, main_url: str
) -> None:
    """Each ingress reads one output channel per engine replica; streams stay apart."""
    prompts = [[7, 3 + i, 11, 5 * i] for i in range(12)]

    def streamed(prompt: list[int]) -> str:
        kwargs = dict(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stream=True)
        return "".join(c.choices[0].text for c in client.completions.create(**kwargs) if c.choices)

    batches_before = {r["replica_id"]: r["num_channel_batches"] for r in _stats(main_url)}
    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        texts = list(pool.map(streamed, prompts))
    # Each replica sent its streams' tokens as channel batches (a slow reader gets several steps
    # in one batch, so there may be fewer batches than tokens).
    sent = [
        r["num_channel_batches"] - batches_before.get(r["replica_id"], 0) for r in _stats(main_url)
    ]
    whole = [
        client.completions.create(model=MODEL, prompt=p, max_tokens=12, temperature=0)
        for p in prompts
    ]
    assert texts == [w.choices[0].text for w in whole]
    assert len(sent) == 2 and all(n >= 1 for n in sent), sent


def test_a_request_for_one_output_is_answered_by_its_call(main_url: str, offline: LLM) -> None:
    """Through the engine deployment's own handle: a request that wants one output at the end
    (what a non-streamed completion without stop strings sends) names no output channel, and
    its unary `generate` call answers that output, token-exact with offline, or the engine's
    refusal: two messages, the request and its answer."""
    from ray import serve

    engine = serve.get_deployment_handle("PagedRayEngine", "main")
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    request = GenerateRequest("once-test-0", [2, 7, 1, 8, 2], params, stream_interval=None)
    output = engine.generate.remote(request).result(timeout_s=60)
    assert output.error is None and output.finished
    expected = offline.generate([{"prompt_token_ids": request.prompt_token_ids}], params)
    assert [t for d in output.deltas for t in d.token_ids] == expected[0].outputs[0].token_ids
    assert output.usage is None  # the ingress counts what it sends: text and usage are its own
    max_model_len = httpx.get(f"{main_url}/v1/models").json()["data"][0]["max_model_len"]
    too_long = dataclasses.replace(
        request, request_id="once-test-1", prompt_token_ids=[5] * max_model_len
    )
    refused = engine.generate.remote(too_long).result(timeout_s=60)
    assert refused.error is not None and refused.error.kind is FailureKind.TOO_LONG, refused
    assert refused.error.param == "max_tokens" and not refused.deltas
    # A streamed request without a channel is a caller's bug: refused, nothing runs.
    unrouted = dataclasses.replace(request, request_id="once-test-2", stream_interval=1)
    refused = engine.generate.remote(unrouted).result(timeout_s=60)
    assert refused.error is not None and refused.error.kind is FailureKind.INTERNAL, refused


def test_a_channel_is_read_on_the_replica_the_router_chose(main_url: str, offline: LLM) -> None:
    """Through the engine deployment's own handle: the router names the replica it sends a
    streamed request to (in the sender's process, before the request arrives); a subscription
    addressed to it gets the outputs; the call's answer is the end, naming the same replica; a
    subscription addressed to a gone replica fails."""
    from ray import serve

    engine = serve.get_deployment_handle("PagedRayEngine", "main")
    streaming = engine.options(stream=True)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    request = GenerateRequest(
        "channel-test-0", [3, 1, 4, 1, 5], params, stream_interval=1, channel_id="channel-test"
    )
    routed: list[str] = []
    request.on_routed = routed.append
    call = engine.generate.remote(request)
    deadline = time.monotonic() + 60
    while not routed and time.monotonic() < deadline:
        time.sleep(0.01)
    assert routed, "the router never named a replica"
    outputs = []
    batches = streaming.subscribe.remote("channel-test", replica_id=routed[-1])
    for pickled in batches:
        outputs.extend(pickle.loads(pickled))
        if outputs[-1].finished:
            break
    batches.cancel()
    answer = call.result(timeout_s=60)
    assert answer.error is None and answer.finished and not answer.deltas
    assert answer.replica_id == routed[-1]
    expected = offline.generate([{"prompt_token_ids": request.prompt_token_ids}], params)
    tokens = [t for output in outputs for d in output.deltas for t in d.token_ids]
    assert tokens == expected[0].outputs[0].token_ids and outputs[-1].finished
    start = time.perf_counter()
    with pytest.raises(Exception, match="engine replica no-such-replica is gone"):
        next(streaming.subscribe.remote("channel-test", replica_id="no-such-replica"))
    assert time.perf_counter() - start < 10


def test_kv_subscriptions_follow_each_replicas_prefix_cache(
    main_url: str, client: openai.OpenAI
) -> None:
    """A router's view of each engine replica (pagedray/engine/kv_index_publisher.py), kept
    from its KV subscription, comes to hold a served prompt's full blocks."""
    from ray import serve

    from pagedray.engine.kv_index_publisher import IDLE_END_S, routing_hash, unpack_delta
    from pagedray.scheduler.prefix_hash import compute_block_hashes

    engine = serve.get_deployment_handle("PagedRayEngine", "main").options(stream=True)
    replica_ids = [r["replica_id"] for r in _stats(main_url)]
    views: dict[str, set[bytes]] = {replica_id: set() for replica_id in replica_ids}
    streams = [engine.subscribe_kv.remote(replica_id=replica_id) for replica_id in replica_ids]

    def follow(stream: Any, view: set[bytes]) -> None:
        with contextlib.suppress(Exception):  # ends when cancelled below
            for pickled in stream:
                unpack_delta(pickle.loads(pickled)).apply(view)

    prompt = [(5 * i) % 90 + 7 for i in range(40)]  # two full blocks of 16 tokens
    expected = {routing_hash(h) for h in compute_block_hashes(prompt, 16, None, [])}
    with concurrent.futures.ThreadPoolExecutor(len(streams)) as pool:
        for stream, view in zip(streams, views.values()):
            pool.submit(follow, stream, view)
        deadline = time.monotonic() + 30
        while sum(r["num_kv_subscribers"] for r in _stats(main_url)) < len(streams):
            assert time.monotonic() < deadline
            time.sleep(0.1)
        completion = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
        assert completion.usage is not None and completion.usage.completion_tokens == 2
        while not any(expected <= view for view in views.values()):
            assert time.monotonic() < deadline, (expected, views)
            time.sleep(0.1)
        # Cancelled, ours end at once; the ingress's own (counted too) just had a change and
        # are not idle for IDLE_END_S yet, so the count must drop by ours.
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
        subscribed = sum(r["num_kv_subscribers"] for r in _stats(main_url))
        for stream in streams:
            stream.cancel()
        deadline = time.monotonic() + IDLE_END_S / 2
        while sum(r["num_kv_subscribers"] for r in _stats(main_url)) > subscribed - len(streams):
            assert time.monotonic() < deadline, _stats(main_url)
            time.sleep(0.1)
    assert len(expected) == 2


def test_requests_sharing_a_prefix_go_where_it_is_cached(
    main_url: str, client: openai.OpenAI
) -> None:
    """Cache-aware routing (cluster/engine_router.py): after one request, the others with its
    prefix all land on the replica that cached it (power-of-two would spread ten over both)."""
    prefix = [(11 * i) % 80 + 9 for i in range(64)]  # four full blocks
    before = {r["replica_id"]: r["prefix_cache_hits"] for r in _stats(main_url)}
    routed_before = _routed_series()
    client.completions.create(model=MODEL, prompt=[*prefix, 1], max_tokens=1)
    time.sleep(1.0)  # the ingress follows the engines' KV deltas as they step
    for suffix in range(2, 12):
        client.completions.create(model=MODEL, prompt=[*prefix, suffix, 3], max_tokens=1)
    hits = {
        r["replica_id"]: r["prefix_cache_hits"] - before[r["replica_id"]] for r in _stats(main_url)
    }
    assert sorted(hits.values()) == [0, 10 * len(prefix)], hits
    # The router's metrics say the same: ten prefix matches of 4 blocks, all to that replica.
    (cached_on,) = [replica for replica, hit in hits.items() if hit]
    key = f"ray_pagedray_routed_requests_total{{{cached_on},prefix_match}}"
    deadline = time.monotonic() + EXPORT_TIMEOUT_S
    while (routed := _routed_series()).get(key, 0) - routed_before.get(key, 0) < 10:
        assert time.monotonic() < deadline, routed
        time.sleep(1.0)

    def three_or_four_blocks(series: dict[str, float]) -> float:
        bucket = "ray_pagedray_routing_matched_blocks_bucket{le=%s}"
        return series.get(bucket % 4.0, 0.0) - series.get(bucket % 2.0, 0.0)

    assert three_or_four_blocks(routed) - three_or_four_blocks(routed_before) >= 10


def test_a_prefix_only_the_nodes_tier_holds_is_routed_as_a_tier_match(
    main_url: str, client: openai.OpenAI
) -> None:
    """Evicted from the pools, a prompt's blocks are in the node's host tier, which the engines
    publish beside their pools: the router counts them (a tier match, not "no match") and the
    replica it picks loads them instead of computing them."""
    prompt = [(13 * i) % 90 + 5 for i in range(100)]  # six full blocks
    client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
    # Both pools (64 blocks each) see far more than they hold: concurrent, so that power of
    # two spreads them, and the first prompt's blocks go to the tier.
    others = [[(7 * i + k) % 97 + 3 for i in range(100)] for k in range(1, 49)]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        list(
            pool.map(
                lambda p: client.completions.create(model=MODEL, prompt=p, max_tokens=1), others
            )
        )
    time.sleep(2.0)  # the ingress follows the engines' KV deltas (and the tier's) as they step
    routed_before = _routed_series()
    again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
    details = again.usage.prompt_tokens_details if again.usage else None
    assert details is not None and details.cached_tokens == 6 * 16
    deadline = time.monotonic() + EXPORT_TIMEOUT_S

    def tier_matches(series: dict[str, float]) -> float:
        return sum(n for key, n in series.items() if key.endswith(",tier_match}"))

    while tier_matches(_routed_series()) - tier_matches(routed_before) < 1:
        assert time.monotonic() < deadline, _routed_series()
        time.sleep(1.0)


def _routed_series() -> dict[str, float]:
    """The engine router's series: `name{replica,reason}` for the counter, `name{le=...}` for
    the histogram's buckets."""

    def key_of(name: str, labels: dict[str, str]) -> str | None:
        if not name.startswith(("ray_pagedray_routed_", "ray_pagedray_routing_")):
            return None
        if "reason" in labels:
            return f"{name}{{{labels['replica']},{labels['reason']}}}"
        return f"{name}{{le={float(labels['le'])}}}" if "le" in labels else None

    return _exported_series(key_of)


# ---- the limited app: API key, waiting-queue bound, stream interval ------------------------


@pytest.fixture(scope="class")
def limited_url(serve_url: str, tiny_llama: str) -> Iterator[str]:
    from pagedray.cluster.openai_app import build_app

    args = {
        **IN_PROCESS,
        "model": tiny_llama,
        "api_key": API_KEY,
        "max_num_seqs": 1,
        "max_num_waiting": 1,
        "stream_interval": 4,
    }
    yield from deploy_app(serve_url, "limited", build_app(args))


class TestLimitedApp:
    def test_wrong_api_key_is_refused(self, limited_url: str) -> None:
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
        url = f"{limited_url}/v1/completions"
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            error = _error(httpx.post(url, json=body, headers=headers), 401)
            assert error["code"] == 401
        wrong = openai.OpenAI(base_url=f"{limited_url}/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            wrong.models.list()
        right = openai.OpenAI(base_url=f"{limited_url}/v1", api_key=API_KEY, max_retries=0)
        assert right.completions.create(**body).usage.completion_tokens == 2
        # As vLLM's, the metrics need no key (nor does /health).
        assert httpx.get(f"{limited_url}/metrics", timeout=30).status_code == 200

    def test_cors_preflight_needs_no_key(self, limited_url: str) -> None:
        """A browser sends its preflight without the key (it asks whether it may send one)."""
        preflight = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST"}
        response = httpx.options(f"{limited_url}/v1/completions", headers=preflight)
        assert response.status_code == 200, response.text
        assert response.headers["access-control-allow-origin"] == "*"

    def test_stream_interval_sends_chunks_of_n_tokens(self, limited_url: str) -> None:
        client = openai.OpenAI(base_url=f"{limited_url}/v1", api_key=API_KEY, max_retries=0)
        kwargs: dict[str, Any] = dict(
            model=MODEL,
            prompt="interval",
            max_tokens=10,
            temperature=0,
            logprobs=1,
            extra_body={"ignore_eos": True},
        )
        whole = client.completions.create(**kwargs).choices[0]
        chunks = [c.choices[0] for c in client.completions.create(**kwargs, stream=True)]
        # The engine sends the first token at once, then every 4 tokens, the rest with the
        # finish: [1, 4, 4, 1]. Outputs that queued behind a reader that fell behind leave as
        # one chunk (EngineStreams), e.g. [5, 4, 1] on a busy machine, so a chunk ends only
        # where one of the engine's does: after token 1, 5, 9 or the last.
        ends = list(itertools.accumulate(len(c.logprobs.tokens) for c in chunks))
        assert set(ends) <= {1, 5, 9, 10} and ends[-1] == 10, ends
        assert [c.finish_reason for c in chunks] == [None] * (len(chunks) - 1) + ["length"]
        assert "".join(c.text for c in chunks) == whole.text
        assert [t for c in chunks for t in c.logprobs.tokens] == whole.logprobs.tokens

    def test_full_waiting_queue_gives_503(self, limited_url: str) -> None:
        headers = {"Authorization": f"Bearer {API_KEY}"}
        url = f"{limited_url}/v1/completions"
        small = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
        with httpx.stream("POST", url, json={**LONG, "stream": True}, headers=headers) as running:
            lines = running.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                waiting = pool.submit(httpx.post, url, json=small, headers=headers, timeout=60)
                deadline = time.monotonic() + 10
                while _stats(limited_url)[0]["num_waiting"] < 1:
                    assert time.monotonic() < deadline
                    time.sleep(0.02)
                refused = httpx.post(url, json=small, headers=headers)
                error = _error(refused, 503)
                assert "waiting queue is full" in error["message"]
                assert int(refused.headers["retry-after"]) >= 1
                # Saturated but stepping: still 200, and says so (nothing more).
                health = httpx.get(f"{limited_url}/health")
                assert health.status_code == 200 and health.json() == {"status": "degraded"}
                running.close()  # the long request is aborted, so the waiting one runs
                assert waiting.result().status_code == 200
        assert httpx.post(url, json=small, headers=headers).status_code == 200


# ---- the broken app: an engine whose step raises ------------------------------------------


@pytest.fixture(scope="class")
def broken_url(serve_url: str, tiny_llama: str) -> Iterator[str]:
    def faulty_builder(config: Any) -> tuple[Any, Any, Any, Any]:
        from pagedray.engine.engine_factory import build_engine

        engine, executor, tokenizer, validator = build_engine(config)

        def step(streaming: bool = True) -> list[Any]:
            raise RuntimeError("injected step failure")

        engine.step = step
        return engine, executor, tokenizer, validator

    from pagedray.cluster.openai_app import build_openai_app
    from pagedray.engine.config import EngineConfig

    args = {k: v for k, v in IN_PROCESS.items() if k != "ingress_num_cpus"}
    app = build_openai_app(
        EngineConfig(**args, model=tiny_llama),
        ingress_num_cpus=0.1,
        engine_builder=faulty_builder,  # a nested function: Ray pickles it by value
        health_check_period_s=60.0,  # keep Serve from replacing the replica during the test
    )
    yield from deploy_app(serve_url, "broken", app)


class TestDeadEngine:
    def test_dead_engine_fails_requests_and_health(self, broken_url: str) -> None:
        assert httpx.get(f"{broken_url}/health").status_code == 200
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 4}
        url = f"{broken_url}/v1/completions"
        response = httpx.post(url, json=body, timeout=30)
        error = _error(response, 503)
        # The cause is logged, not sent: the client learns the engine is down and when to retry.
        assert "injected" not in error["message"] and "unavailable" in error["message"]
        assert response.headers["retry-after"] == "1"
        response = httpx.get(f"{broken_url}/health")
        health = _error(response, 503)
        # The failure goes to the log; the client learns only that the engine is down.
        assert health["message"].startswith("engine unavailable")
        assert "injected" not in response.text and "Error" not in health["message"]
        assert response.headers["retry-after"] == "1"
        # Later requests are refused at once instead of hanging.
        _error(httpx.post(url, json=body, timeout=10), 503)
        stream_body = {**body, "stream": True}
        with httpx.stream("POST", url, json=stream_body, timeout=10) as response:
            assert response.status_code == 503
            assert json.loads(response.read())["error"]["code"] == 503
        # Once ready, ready for good: the failure shows per request and on /health only.
        models = httpx.get(f"{broken_url}/v1/models", timeout=10)
        assert models.status_code == 200 and models.json()["data"][0]["id"] == MODEL


# ---- tensor parallelism --------------------------------------------------------------------


@pytest.fixture(scope="class")
def tp2_url(serve_url: str, tiny_llama: str) -> Iterator[str]:
    from pagedray.cluster.openai_app import build_app

    args = {**ENGINE_ARGS, "model": tiny_llama, "tensor_parallel_size": 2}
    yield from deploy_app(serve_url, "tp2", build_app(args))


class TestTensorParallel:
    def test_tp2_matches_tp1_and_frees_blocks(self, tp2_url: str, offline: LLM) -> None:
        import ray

        # The replica's placement group: its own bundle, then one per rank, on one node.
        groups = ray.util.placement_group_table().values()
        assert any(
            g["state"] == "CREATED"
            and g["strategy"] == "STRICT_PACK"
            and list(g["bundles"].values()) == [{"CPU": 1.0}] * 3
            for g in groups
        )
        params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
        expected = offline.generate("tensor parallel", params, use_tqdm=False)[0].outputs[0]
        client = openai.OpenAI(base_url=f"{tp2_url}/v1", api_key="unused", max_retries=0)
        kwargs: dict[str, Any] = dict(
            model=MODEL,
            prompt="tensor parallel",
            max_tokens=16,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        assert client.completions.create(**kwargs).choices[0].text == expected.text
        streamed = client.completions.create(**kwargs, stream=True)
        assert "".join(c.choices[0].text for c in streamed if c.choices) == expected.text
        steps_before = _total_steps(tp2_url)
        with httpx.stream("POST", f"{tp2_url}/v1/completions", json={**LONG, "stream": True}) as r:
            assert next(line for line in r.iter_lines() if line.startswith("data: "))
        _wait_all_blocks_free(tp2_url, timeout_s=2.0)
        assert _total_steps(tp2_url) - steps_before < 500

    def test_tp2_structured_output_equals_offline(self, tp2_url: str, offline: LLM) -> None:
        """The grammar bitmask crosses to both ranks in the pickled plan (in-process it is
        filled beside the forward pass instead): the same constrained tokens either way."""
        _check_structured_equals_offline(tp2_url, offline)


def test_structured_output_through_worker_actors(main_url: str, offline: LLM) -> None:
    _check_structured_equals_offline(main_url, offline)


STRUCTURED_SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "items": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["ok", "items"],
    "additionalProperties": False,
}


def _check_structured_equals_offline(url: str, offline: LLM) -> None:
    params = SamplingParams(
        temperature=0.0, max_tokens=60, structured_outputs={"json": STRUCTURED_SCHEMA}
    )
    expected = offline.generate("constrained", params, use_tqdm=False)[0].outputs[0]
    body = {
        "model": MODEL,
        "prompt": "constrained",
        "max_tokens": 60,
        "temperature": 0,
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "s", "schema": STRUCTURED_SCHEMA},
        },
    }
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert (choice["text"], choice["finish_reason"]) == (expected.text, "stop")
    json.loads(choice["text"])
