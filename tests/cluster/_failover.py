"""What the failover tests share (issue P14): an app's engine replicas, a stream read chunk by
chunk, and a stream struck mid-way (its engine replica killed or stopped) beside the same
request undisturbed."""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import httpx

TIMEOUT_S = 120.0
STEP_SLEEP_S = 0.05  # each engine step sleeps: requests are still running when one is struck


def two_replica_app(model_dir: str, served_name: str, **config: Any) -> Any:
    """Two engine replicas of the tiny model (`config`: more `EngineConfig` fields) whose steps
    sleep, routed by power of two (so both hold requests)."""
    from slow_engine import slow_engine_builder

    from pagedray.cluster.openai_app import build_openai_app
    from pagedray.engine.config import EngineConfig

    engine_config = EngineConfig(
        model=model_dir, served_model_name=served_name, num_kv_blocks=128, num_threads=1, **config
    )
    return build_openai_app(
        engine_config,
        engine_builder=slow_engine_builder(STEP_SLEEP_S),
        num_replicas=2,
        routing="power-of-two",
        ingress_num_cpus=0.1,
    )


def replicas(url: str) -> list[dict[str, Any]]:
    response = httpx.get(f"{url}/stats", timeout=30)
    return response.json()["replicas"] if response.status_code == 200 else []


def two_replicas_serving(url: str) -> None:
    """Wait until two healthy engine replicas serve (an earlier test's victim has been replaced:
    one whose rank died is listed, unhealthy, until Serve stops it), and a moment more for the
    ingress's router to hear of the new one."""
    deadline = time.monotonic() + TIMEOUT_S
    while sum(replica.get("healthy", False) for replica in replicas(url)) != 2:
        assert time.monotonic() < deadline, "no second engine replica"
        time.sleep(0.2)
    time.sleep(2.0)


def survivors_hold_no_block(url: str, victim: str) -> None:
    """Wait until the replicas other than `victim` are idle with every KV block free."""
    deadline = time.monotonic() + 30
    while True:
        survivors = [r for r in replicas(url) if r["replica_id"] != victim]
        held = sum(r["num_kv_blocks"] - r["num_free_blocks"] for r in survivors)
        if survivors and held == 0 and all(r["num_requests"] == 0 for r in survivors):
            return
        assert time.monotonic() < deadline, survivors
        time.sleep(0.2)


def stream(url: str, model: str, body: dict[str, Any], chunks: list[tuple[int, str]]) -> str | None:
    """Stream a completion (a chat completion where `body` has messages, a response where it has
    an input), appending each chunk's (choice index, text) to `chunks` as it comes; returns the
    error event's message, if one came."""
    body = {**body, "model": model, "stream": True}
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    path = "/v1/responses" if "input" in body else path
    with httpx.stream("POST", f"{url}{path}", json=body, timeout=TIMEOUT_S) as reply:
        for line in reply.iter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line.removeprefix("data: "))
            if "error" in event or event.get("type") in ("error", "response.failed"):
                return str(event.get("error") or event)
            if event.get("type") == "response.output_text.delta":
                chunks.append((0, event["delta"]))
            chunks.extend((c["index"], choice_text(c)) for c in event.get("choices", []))
    return None


def choice_text(choice: dict[str, Any]) -> str:
    """A completion chunk's text; a chat chunk's content, then its tool calls' names and
    arguments as they come."""
    if "text" in choice:
        return str(choice["text"])
    delta = choice.get("delta") or {}
    parts = [delta.get("content") or ""]
    for call in delta.get("tool_calls") or []:
        function = call.get("function") or {}
        parts.append((function.get("name") or "") + (function.get("arguments") or ""))
    return "".join(parts)


def texts(chunks: list[tuple[int, str]]) -> dict[int, str]:
    """Each choice's text."""
    by_choice: dict[int, str] = {}
    for index, text in chunks:
        by_choice[index] = by_choice.get(index, "") + text
    return by_choice


@dataclass
class StruckStream:
    """A stream whose engine replica was struck mid-way, and the same request undisturbed."""

    expected: dict[int, str]  # each choice's text, undisturbed
    texts: dict[int, str]  # each choice's text, struck
    num_chunks: int
    error: str | None  # the error event, if one came
    victim: str  # the replica struck
    ended_after_s: float  # from the strike to the stream's end


def strike_mid_stream(
    url: str,
    model: str,
    body: dict[str, Any],
    after_chunks: int,
    strike: Callable[[str], None],
    recover: Callable[[], None] = lambda: None,
) -> StruckStream:
    """Stream `body` to `model` once undisturbed, then again, calling `strike(replica id)` on
    the replica holding it once `after_chunks` chunks have come; `recover()` once the stream has
    ended."""
    two_replicas_serving(url)
    expected: list[tuple[int, str]] = []
    assert stream(url, model, body, expected) is None
    chunks: list[tuple[int, str]] = []
    errors: list[str | None] = []
    reader = threading.Thread(target=lambda: errors.append(stream(url, model, body, chunks)))
    reader.start()
    deadline = time.monotonic() + 30
    while len(chunks) < after_chunks:
        assert time.monotonic() < deadline and reader.is_alive(), chunks
        time.sleep(0.01)
    [victim] = [r["replica_id"] for r in replicas(url) if r["num_running"] > 0]
    strike(victim)
    struck_at = time.monotonic()
    try:
        reader.join(TIMEOUT_S)
        ended_after_s = time.monotonic() - struck_at
    finally:
        recover()
    assert errors, "the stream did not end"
    return StruckStream(
        texts(expected), texts(chunks), len(chunks), errors[0], victim, ended_after_s
    )
