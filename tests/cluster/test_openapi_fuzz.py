"""Schemathesis against a live server (Ray Serve, an in-process engine, the tiny model): bodies
generated from /openapi.json, a bounded number per endpoint and reproducible, must never get a
5xx or hang, and leave no KV block held once they are answered."""

from __future__ import annotations

import time
from typing import Any, Iterator

import httpx
import pytest
import schemathesis
from _serve_apps import deploy_tiny
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode

MODEL = "tiny"
NUM_KV_BLOCKS = 32
EXAMPLES_PER_ENDPOINT = 25
# The slowest answer allowed: a generation of max_model_len tokens at n = max_num_seqs.
MAX_RESPONSE_S = 20.0
REQUEST_TIMEOUT_S = 60.0
OPERATIONS = [
    ("POST", "/v1/completions"),
    ("POST", "/v1/chat/completions"),
    ("POST", "/v1/responses"),
    ("POST", "/v1/messages"),
    ("POST", "/v1/messages/count_tokens"),
    ("GET", "/v1/responses/{response_id}"),
    ("DELETE", "/v1/responses/{response_id}"),
    ("POST", "/tokenize"),
    ("POST", "/detokenize"),
    ("GET", "/v1/models"),
    ("GET", "/v1/models/{model_id}"),
    ("GET", "/health"),
    ("GET", "/ping"),
    ("POST", "/ping"),
    ("GET", "/version"),
    ("GET", "/stats"),
    ("POST", "/v1/load_lora_adapter"),
    ("POST", "/v1/unload_lora_adapter"),
]


@pytest.fixture(scope="module")
def fuzz_url(
    serve_url: str, tiny_llama: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    yield from deploy_tiny(
        serve_url,
        "fuzz",
        tiny_llama,
        served_model_name=MODEL,
        num_kv_blocks=NUM_KV_BLOCKS,
        max_model_len=128,  # a generation is at most 128 steps
        max_num_seqs=4,
        # The routes that link adapters into a folder, fuzzed with it on.
        enable_lora=True,
        lora_resolver_dir=str(tmp_path_factory.mktemp("fuzz_loras")),
        allow_runtime_lora_updating=True,
    )


@pytest.fixture(scope="module")
def api_schema(fuzz_url: str) -> Any:
    return schemathesis.openapi.from_url(f"{fuzz_url}/openapi.json")


# NOTE: each operation is driven by its own Hypothesis test, rather than by schemathesis' pytest
# plugin (`from_fixture`), which does not run under this pytest.
@pytest.mark.parametrize(("method", "path"), OPERATIONS)
def test_no_server_error_and_no_hang(
    api_schema: Any, fuzz_url: str, method: str, path: str
) -> None:
    operation = api_schema[path][method]
    cases = st.one_of(
        operation.as_strategy(GenerationMode.POSITIVE),
        operation.as_strategy(GenerationMode.NEGATIVE),
    )

    @settings(
        max_examples=EXAMPLES_PER_ENDPOINT,
        deadline=None,
        derandomize=True,  # the same bodies every run
        suppress_health_check=list(HealthCheck),
        phases=[Phase.generate],  # no shrinking: the first failing body is reported as is
    )
    @given(case=cases)
    def check(case: Any) -> None:
        if isinstance(case.body, dict) and isinstance(case.body.get("model"), str):
            case.body["model"] = MODEL  # else nearly every body would be an unknown model's 404
        start = time.monotonic()
        response = case.call(base_url=fuzz_url, timeout=REQUEST_TIMEOUT_S)
        elapsed = time.monotonic() - start
        assert response.status_code < 500, (case.as_curl_command(), response.text)
        assert elapsed < MAX_RESPONSE_S, (case.as_curl_command(), elapsed)

    check()


def test_the_schema_lists_every_operation(api_schema: Any) -> None:
    listed = {(op.ok().method.upper(), op.ok().path) for op in api_schema.get_all_operations()}
    assert listed == set(OPERATIONS)


def test_no_kv_block_held_after_the_fuzz(fuzz_url: str) -> None:
    deadline = time.monotonic() + 5.0
    while True:
        replicas = httpx.get(f"{fuzz_url}/stats", timeout=10).json()["replicas"]
        if all(
            r["num_free_blocks"] == r["num_kv_blocks"] == NUM_KV_BLOCKS and r["num_requests"] == 0
            for r in replicas
        ):
            break
        assert time.monotonic() < deadline, replicas
        time.sleep(0.1)
    assert sum(r["num_steps"] for r in replicas) > 0  # some fuzzed bodies did generate
    response = httpx.post(
        f"{fuzz_url}/v1/completions", json={"prompt": "still here", "max_tokens": 2}, timeout=30
    )
    assert response.status_code == 200, response.text
