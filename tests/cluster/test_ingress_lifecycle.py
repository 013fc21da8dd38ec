"""The ingress from its start to a dropped stream, over HTTP through Serve's proxy (issue P6).

One app whose engine takes seconds to build: until it serves, /health, /v1/models and the
generation routes answer 503 (so a client's first 200 means requests work), then all at once
200. A stream its client drops leaves no traceback in the replicas' logs (behind the proxy a
hang-up may reach the app as a cancelled Ray call), the ingress writes at most one access line
per request and the engine none (its per-call line is at DEBUG).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

MODEL = "tiny"
APP = "lifecycle"
# Long enough that the ingress answers while the engine is still being built.
ENGINE_START_S = 8.0
START_TIMEOUT_S = 120.0
# Streams to drop: behind the proxy, a hang-up surfaces as a cancelled Ray call only in a race.
DROPS = 20


@pytest.fixture(scope="module")
def slow_url(serve_url: str, tiny_llama: str) -> Iterator[str]:
    """The app's URL, yielded before its engine replica is up (Serve does not wait for it)."""
    from ray import serve

    from pagedray.cluster.openai_app import build_openai_app
    from pagedray.engine.config import EngineConfig

    def slow_builder(config: Any) -> tuple[Any, Any, Any, Any]:
        import time

        from pagedray.engine.engine_factory import build_engine

        time.sleep(ENGINE_START_S)
        return build_engine(config)

    config = EngineConfig(
        model=tiny_llama, served_model_name=MODEL, num_kv_blocks=64, num_threads=1
    )
    app = build_openai_app(config, ingress_num_cpus=0.1, engine_builder=slow_builder)
    target = serve.RunTarget(app, name=APP, route_prefix=f"/{APP}")
    serve.run_many([target], wait_for_applications_running=False)
    yield f"{serve_url}/{APP}"
    serve.delete(APP)


def _error(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status
    return error


def _ours(response: httpx.Response) -> bool:
    """An answer of the ingress (not Serve's proxy, which answers before the replica is up)."""
    return response.headers.get("content-type", "").startswith("application/json")


def test_not_ready_until_the_engine_serves_then_ready(slow_url: str) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    health = httpx.get(f"{slow_url}/health", timeout=30)
    while not _ours(health):
        assert time.monotonic() < deadline, health.text
        time.sleep(0.2)
        health = httpx.get(f"{slow_url}/health", timeout=30)
    assert health.status_code == 503, "the engine was up before the ingress: raise ENGINE_START_S"
    refusals = [
        httpx.get(f"{slow_url}/v1/models"),
        httpx.post(f"{slow_url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}),
        httpx.post(
            f"{slow_url}/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        ),
    ]
    for response in [health, *refusals]:
        error = _error(response, 503)
        assert error["type"] == "ServiceUnavailableError"
        assert error["message"].startswith("engine unavailable (request ")
        assert response.headers["retry-after"] == "1"
    # The tokenizer routes need no engine.
    assert httpx.post(f"{slow_url}/tokenize", json={"prompt": "hi"}).status_code == 200

    while health.status_code != 200:
        assert time.monotonic() < deadline, health.text
        time.sleep(0.2)
        health = httpx.get(f"{slow_url}/health", timeout=30)
    # One fact: from the first 200 of /health on, the engine's routes serve.
    models = httpx.get(f"{slow_url}/v1/models")
    assert models.status_code == 200 and models.json()["data"][0]["max_model_len"] == 64 * 16
    completion = httpx.post(
        f"{slow_url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=60
    )
    assert completion.status_code == 200 and completion.json()["usage"]["completion_tokens"] == 2


def _replica_logs(deployment: str) -> str:
    import ray

    # NOTE: Ray's private accessor for this session's log folder; Serve has no public one.
    logs = Path(ray._private.worker._global_node.get_logs_dir_path()) / "serve"
    files = sorted(logs.glob(f"replica_{APP}_{deployment}_*.log"))
    assert files, f"no {deployment} log in {logs}"
    return "".join(path.read_text(errors="replace") for path in files)


def _completion_access_lines(log: str) -> list[str]:
    return [line for line in log.splitlines() if f"POST /{APP}/v1/completions " in line]


def test_a_dropped_stream_logs_no_traceback(slow_url: str) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while httpx.get(f"{slow_url}/health", timeout=30).status_code != 200:
        assert time.monotonic() < deadline
        time.sleep(0.2)
    before = len(_completion_access_lines(_replica_logs("OpenAIIngress")))
    body = {"prompt": "drop me", "max_tokens": 500, "ignore_eos": True, "stream": True}
    for _ in range(DROPS):
        with httpx.stream("POST", f"{slow_url}/v1/completions", json=body, timeout=60) as response:
            assert next(line for line in response.iter_lines() if line.startswith("data: "))
    after = httpx.post(f"{slow_url}/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert after.status_code == 200
    time.sleep(1.0)  # the replicas write their logs as they go
    ingress, engine = _replica_logs("OpenAIIngress"), _replica_logs("PagedRayEngine")
    assert "Traceback" not in ingress and "TaskCancelledError" not in ingress
    assert "Traceback" not in engine
    # At most one access line per request in the ingress (Serve's, at INFO). NOTE: behind the
    # proxy, Serve writes none in the replica for some requests the proxy cancels (the proxy's
    # own log has them); with direct ingress every one has its line (tests/deploy).
    lines = _completion_access_lines(ingress)[before:]
    request_ids = [line.split(" -- ")[0].split()[-1] for line in lines]
    assert 1 <= len(lines) <= DROPS + 1 and len(set(request_ids)) == len(lines), lines
    assert all(line.startswith("INFO ") for line in lines)
    # The engine's per-call access lines are off; its own line per generate is at DEBUG.
    assert "CALL generate" not in engine and "CALL health" not in engine


def test_a_cancelled_read_is_a_disconnect(caplog: pytest.LogCaptureFixture) -> None:
    """The race above, made certain: the app's read raises TaskCancelledError mid-stream."""
    import asyncio

    from fastapi import FastAPI
    from fastapi.responses import StreamingResponse
    from ray.exceptions import TaskCancelledError

    from pagedray.cluster.client_disconnect import ClientDisconnect
    from pagedray.openai.ingress_guard import GuardSettings, IngressGuard

    app = FastAPI()
    closed: list[bool] = []

    @app.post("/stream")
    async def stream() -> StreamingResponse:
        async def events() -> Any:
            try:
                while True:
                    yield "data: x\n\n"
                    await asyncio.sleep(0.01)
            finally:
                closed.append(True)

        return StreamingResponse(events(), media_type="text/event-stream")

    app.add_middleware(IngressGuard, settings_of=GuardSettings, routes=app.router.routes)
    app.add_middleware(ClientDisconnect)
    body = [{"type": "http.request", "body": b"{}", "more_body": False}]

    async def receive() -> dict[str, Any]:
        if body:
            return body.pop()
        await asyncio.sleep(0.05)
        raise TaskCancelledError()  # as Serve's proxy path raises it once the client is gone

    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "method": "POST",
        "path": "/stream",
        "raw_path": b"/stream",
        "root_path": "",
        "query_string": b"",
        "headers": [(b"content-length", b"2")],
        "http_version": "1.1",
        "scheme": "http",
        "server": ("test", 80),
        "client": ("test", 1),
    }
    with caplog.at_level(logging.INFO, logger="pagedray"):
        asyncio.run(app(scope, receive, send))  # type: ignore[arg-type]
    assert closed and sent[0]["status"] == 200
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text


def test_an_app_deleted_after_a_stream_does_not_wait_for_its_idle_channel(
    serve_url: str, tiny_llama: str
) -> None:
    """A finished stream leaves its ingress subscribed to the engine's output channel until
    the channel has been idle for `IDLE_S`, and Serve counts that subscription as a call in
    flight: a stopping engine waited for it (an app's deletion, a redeploy, a Ctrl-C took
    `IDLE_S` and more). The stopping ingress now ends its subscriptions itself."""
    from ray import serve

    from pagedray.cluster.openai_app import build_app
    from pagedray.engine.output_channel import IDLE_S

    name = "stopping"
    args = {"model": tiny_llama, "served_model_name": MODEL, "num_kv_blocks": 32}
    args |= {"num_threads": 1, "ingress_num_cpus": 0.1, "use_ray_workers": False}
    serve.run(build_app(args), name=name, route_prefix=f"/{name}")
    body = {"prompt": "one stream", "max_tokens": 4, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{serve_url}/{name}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200 and "data: [DONE]" in list(r.iter_lines())
    started = time.monotonic()
    serve.delete(name)  # returns once every replica has stopped
    # Waiting for the channel to go idle took IDLE_S from the stream's end, at the least.
    assert time.monotonic() - started < IDLE_S - 1.0
