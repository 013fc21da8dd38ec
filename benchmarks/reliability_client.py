"""An HTTP client for the reliability workloads: requests that record how they ended (status,
chunks, in-stream errors, Retry-After), a client that hangs up before the first byte, and what
/stats and /health say of the engines (blocks held, open requests, preemptions).
"""

from __future__ import annotations

import json
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import httpx

POLL_S = 0.1  # between /health and /stats polls
CONTROL_TIMEOUT_S = 15.0  # one /health, /stats or short request


@dataclass(frozen=True)
class Target:
    """A running server: base URL (no trailing slash) and the model name clients send."""

    url: str
    model: str


def http_client(num_connections: int = 16) -> httpx.Client:
    # NOTE: trust_env off: a proxy from the environment must never see loopback traffic.
    limits = httpx.Limits(max_connections=num_connections, max_keepalive_connections=8)
    return httpx.Client(limits=limits, trust_env=False)


# ---- engine state ------------------------------------------------------------------------------


def replica_stats(client: httpx.Client, target: Target) -> list[dict[str, Any]]:
    response = client.get(f"{target.url}/stats", timeout=CONTROL_TIMEOUT_S)
    response.raise_for_status()
    return response.json()["replicas"]


def leaked_blocks(replicas: list[dict[str, Any]]) -> int:
    """KV blocks held, summed over replicas: 0 once every request is gone."""
    return sum(int(r["num_kv_blocks"]) - int(r["num_free_blocks"]) for r in replicas)


def wait_idle(client: httpx.Client, target: Target, timeout_s: float) -> tuple[float, int, int]:
    """Poll /stats until no replica holds a request or a block, for at most `timeout_s`.

    Returns (seconds waited, blocks still held, requests still open) at the last poll.
    """
    start = time.monotonic()
    while True:
        replicas = replica_stats(client, target)
        held = leaked_blocks(replicas)
        num_requests = sum(int(r["num_requests"]) for r in replicas)
        waited = time.monotonic() - start
        if (held == 0 and num_requests == 0) or waited > timeout_s:
            return waited, held, num_requests
        time.sleep(POLL_S)


def total_preemptions(client: httpx.Client, target: Target) -> int:
    return sum(int(r["num_preemptions"]) for r in replica_stats(client, target))


def health(client: httpx.Client, target: Target) -> str:
    """GET /health as "STATUS" or "STATUS body-status" (e.g. "200 ok", "503"); "error" if none."""
    try:
        response = client.get(f"{target.url}/health", timeout=CONTROL_TIMEOUT_S)
    except httpx.HTTPError:
        return "error"
    if response.status_code != 200:
        return str(response.status_code)
    return f"200 {response.json().get('status')}"


# ---- one request -------------------------------------------------------------------------------


@dataclass
class Reply:
    """How one request ended: status 0 = no HTTP answer (the client gave up or the connection
    died); `error` is a 200 stream's in-stream error event."""

    status: int
    seconds: float  # sending to the end (or to the client's close)
    num_chunks: int = 0  # streamed data events before [DONE]
    completion_tokens: int = 0  # from usage
    finish_reason: str | None = None
    error: dict[str, Any] | None = None
    body: str = ""  # the body of a non-200 answer
    retry_after: str | None = None


def complete(client: httpx.Client, target: Target, body: dict[str, Any], timeout_s: float) -> Reply:
    """POST a non-streamed completion."""
    start = time.monotonic()
    try:
        response = client.post(
            f"{target.url}/v1/completions", json={"model": target.model, **body}, timeout=timeout_s
        )
    except httpx.HTTPError as exc:
        return Reply(0, time.monotonic() - start, body=repr(exc))
    reply = Reply(response.status_code, time.monotonic() - start)
    if response.status_code != 200:
        reply.body, reply.retry_after = response.text, response.headers.get("retry-after")
        return reply
    payload = response.json()
    reply.completion_tokens = payload["usage"]["completion_tokens"]
    reply.finish_reason = payload["choices"][0]["finish_reason"]
    return reply


def stream(
    client: httpx.Client,
    target: Target,
    body: dict[str, Any],
    timeout_s: float,
    close_after: int | None = None,
    first_chunk: threading.Event | None = None,
) -> Reply:
    """POST a streamed completion (usage included); the client closes it after `close_after`
    data events when given. `first_chunk` is set once the first data event has arrived."""
    start = time.monotonic()
    payload = {"model": target.model, **body, "stream": True}
    payload["stream_options"] = {"include_usage": True}
    reply = Reply(0, 0.0)
    try:
        url = f"{target.url}/v1/completions"
        with client.stream("POST", url, json=payload, timeout=timeout_s) as response:
            reply.status = response.status_code
            if response.status_code != 200:
                reply.body = response.read().decode(errors="replace")
                reply.retry_after = response.headers.get("retry-after")
            else:
                _read_events(response, reply, close_after, first_chunk)
    except httpx.HTTPError as exc:
        reply.body = repr(exc)
    reply.seconds = time.monotonic() - start
    return reply


def _read_events(
    response: httpx.Response, reply: Reply, close_after: int | None, first: threading.Event | None
) -> None:
    for line in response.iter_lines():
        if not line.startswith("data: "):
            continue
        if line == "data: [DONE]":
            return
        event = json.loads(line.removeprefix("data: "))
        if "error" in event:
            reply.error = event["error"]
            continue
        if event.get("usage"):
            reply.completion_tokens = event["usage"]["completion_tokens"]
        for choice in event.get("choices", []):
            reply.finish_reason = choice.get("finish_reason") or reply.finish_reason
        reply.num_chunks += 1
        if first is not None:
            first.set()
        if close_after is not None and reply.num_chunks >= close_after:
            return  # leaving the `with` closes the connection: the server must abort


def post_raw(client: httpx.Client, target: Target, path: str, body: bytes) -> tuple[int, str]:
    """POST raw bytes as JSON; (status, response text), status 0 if no answer came."""
    headers = {"content-type": "application/json"}
    try:
        response = client.post(
            f"{target.url}{path}", content=body, headers=headers, timeout=CONTROL_TIMEOUT_S
        )
    except httpx.HTTPError as exc:
        return 0, repr(exc)
    return response.status_code, response.text


def send_and_hang_up(target: Target, body: dict[str, Any], wait_s: float) -> None:
    """Send a streamed completion over a raw socket and close it before the first byte back."""
    parts = urlsplit(target.url)
    data = json.dumps({"model": target.model, **body, "stream": True}).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {parts.netloc}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
    )
    with socket.create_connection((parts.hostname, parts.port), timeout=5) as sock:
        sock.sendall(head.encode() + data)
        time.sleep(wait_s)
