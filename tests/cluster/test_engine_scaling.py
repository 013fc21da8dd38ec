"""Engine replicas coming and going under Serve, with nothing lost (issue P8): autoscaling on the
engines' own load (cluster/engine_autoscaling.py) and draining a replica that is removed.

The engines step slowly on purpose (each step sleeps), so that requests last long enough for
Serve's control loop to see them and for a drain to outlast Serve's default shutdown timeout.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any, Iterator

import httpx
import pytest
from slow_engine import slow_engine_builder

from pagedray.cluster.engine_autoscaling import engine_autoscaling_config

MODEL = "tiny"
STEP_SLEEP_S = 0.1
MAX_NUM_SEQS = 4  # autoscaling's target: 3.2 sequences per replica
SCALE_TIMEOUT_S = 90.0
# Serve's own drain timeout: a drained stream must outlast it to show ours is in force.
SERVE_DEFAULT_DRAIN_S = 20.0


def _app(tiny_llama: str, **options: Any) -> Any:
    from pagedray.cluster.openai_app import build_openai_app
    from pagedray.engine.config import EngineConfig

    config = EngineConfig(
        model=tiny_llama,
        served_model_name=MODEL,
        num_kv_blocks=128,
        num_threads=1,
        max_num_seqs=MAX_NUM_SEQS,
        request_timeout_s=120,
    )
    builder = slow_engine_builder(STEP_SLEEP_S)
    return build_openai_app(config, ingress_num_cpus=0.1, engine_builder=builder, **options)


def _replicas(url: str) -> list[dict[str, Any]]:
    response = httpx.get(f"{url}/stats", timeout=30)
    return response.json()["replicas"] if response.status_code == 200 else []


def _wait_for(condition: Any, what: str, timeout_s: float = SCALE_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.5)


class Streams:
    """Streamed completions in threads; each records its tokens and how it ended."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.results: list[tuple[int, str | None, str | None]] = []  # tokens, finish, error
        self.threads: list[threading.Thread] = []

    def start(self, count: int, max_tokens: int) -> None:
        for index in range(count):
            thread = threading.Thread(target=self._run, args=(index, max_tokens), daemon=True)
            thread.start()
            self.threads.append(thread)

    def join(self, timeout_s: float) -> list[tuple[int, str | None, str | None]]:
        deadline = time.monotonic() + timeout_s
        for thread in self.threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        assert not any(thread.is_alive() for thread in self.threads), "streams still running"
        return self.results

    def _run(self, index: int, max_tokens: int) -> None:
        body = {
            "model": MODEL,
            "prompt": f"stream {index} {time.monotonic()}",
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        tokens, finish, error = 0, None, None
        try:
            with httpx.stream("POST", f"{self.url}/v1/completions", json=body, timeout=300) as r:
                for line in r.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[len("data: ") :])
                    if "error" in chunk:
                        error = str(chunk["error"])
                    for choice in chunk.get("choices") or []:
                        finish = choice.get("finish_reason") or finish
                    if chunk.get("usage"):
                        tokens = chunk["usage"]["completion_tokens"]
                if r.status_code != 200:
                    error = f"HTTP {r.status_code}"
        except httpx.HTTPError as exc:
            error = repr(exc)
        self.results.append((tokens, finish, error))


@pytest.fixture(scope="module")
def scaled_url(serve_url: str, tiny_llama: str) -> Iterator[str]:
    from ray import serve

    autoscaling = engine_autoscaling_config(
        1,
        2,
        MAX_NUM_SEQS,
        upscale_delay_s=0,
        downscale_delay_s=2,
        metrics_interval_s=0.5,
        look_back_period_s=1,
    )
    app = _app(tiny_llama, autoscaling_config=autoscaling)
    serve.run(app, name="scaled", route_prefix="/scaled")
    yield f"{serve_url}/scaled"
    serve.delete("scaled")


def test_engines_scale_out_on_queued_sequences_and_back_in_when_idle(scaled_url: str) -> None:
    assert len(_replicas(scaled_url)) == 1
    streams = Streams(scaled_url)
    # 4 running + 4 waiting: 2.5 replicas' worth, for 2 x 14 s: time for a replica to start
    # on a loaded machine (an engine replica is up 3-6 s after Serve asks for it) before the
    # load is gone and Serve would remove it again.
    streams.start(8, max_tokens=140)
    _wait_for(lambda: len(_replicas(scaled_url)) == 2, "no second engine replica")
    assert streams.join(300) == [(140, "length", None)] * 8
    _wait_for(lambda: len(_replicas(scaled_url)) == 1, "idle, yet still two engine replicas")


def test_replicas_removed_by_a_redeploy_finish_their_streams(
    serve_url: str, tiny_llama: str
) -> None:
    """Redeploy from two engines to one while both stream: Serve replaces the app's replicas, and
    each removed one, ingress and engines, drains for longer than Serve's default shutdown
    timeout, so that every stream ends whole."""
    from ray import serve

    serve.run(_app(tiny_llama, num_replicas=2), name="drained", route_prefix="/drained")
    url = f"{serve_url}/drained"
    try:
        streams = Streams(url)
        max_tokens = int(1.5 * SERVE_DEFAULT_DRAIN_S / STEP_SLEEP_S)  # 30 s of steps
        streams.start(6, max_tokens=max_tokens)
        _wait_for(
            lambda: sorted(r["num_running"] > 0 for r in _replicas(url)) == [True, True],
            "the streams did not reach both replicas",
            timeout_s=60,
        )
        serve.run(_app(tiny_llama, num_replicas=1), name="drained", route_prefix="/drained")
        results = streams.join(300)
        assert results == [(max_tokens, "length", None)] * 6
        _wait_for(lambda: len(_replicas(url)) == 1, "not one engine replica after the redeploy")
    finally:
        serve.delete("drained")
