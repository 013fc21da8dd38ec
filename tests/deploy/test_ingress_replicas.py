"""`pagedray serve --num-ingress-replicas 2`: both ingress replicas listen on the API port itself
(cluster/shared_api_port.py), so the API has no single process to lose (issue P14). Requests on
fresh connections reach both; one replica SIGKILLed while the `openai` SDK sends completions one
after another costs that client nothing (a request on a connection the dead replica held is
sent again by the SDK, as on any dropped connection, and lands on the live one), and Serve's
replacement listens on the port again.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator

import httpx
import openai
import pytest
from _subprocesses import ServeProcess, listeners, pagedray_serve

MODEL = "tiny"
RECOVERY_S = 90.0  # the killed replica's replacement starts, on a loaded 2-core machine
LOAD_S = 8.0  # of completions after the kill
NUM_FRESH = 24  # requests on fresh connections: each lands on either listener

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(tiny_llama: str) -> Iterator[ServeProcess]:
    flags = ["--served-model-name", MODEL, "--num-kv-blocks", "64", "--num-threads", "1"]
    flags += ["--device", "cpu", "--num-ingress-replicas", "2"]
    with pagedray_serve(tiny_llama, *flags) as serving:
        yield serving


def _listening_pids(port: int, pids: list[int]) -> set[int]:
    """Which of `pids` hold a socket listening on `port`."""
    return {pid for _, listening, pid in listeners(set(pids)) if listening == port}


def _answered_by(server: ServeProcess) -> dict[str, int]:
    """Completions answered so far, by ingress replica (from their access lines)."""
    folder = server.ray_tmp / "session_latest" / "logs" / "serve"
    return {
        path.name: path.read_text(errors="replace").count("POST /v1/completions 200")
        for path in folder.glob("replica_pagedray_OpenAIIngress_*.log")
    }


def test_both_ingress_replicas_answer_on_the_api_port(server: ServeProcess) -> None:
    ingress = server.processes("OpenAIIngress")
    assert len(ingress) == 2
    port = int(server.url.rsplit(":", 1)[1])
    # Themselves, no proxy in between; the server is up once one listens, the other follows.
    deadline = time.monotonic() + 30
    while _listening_pids(port, ingress) != set(ingress):
        assert time.monotonic() < deadline, (_listening_pids(port, ingress), ingress)
        time.sleep(0.2)
    body = {"model": MODEL, "prompt": "which replica?", "max_tokens": 2}
    for _ in range(NUM_FRESH):  # a connection of its own each: the kernel picks a listener
        reply = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60, trust_env=False)
        assert reply.status_code == 200, reply.text
    deadline = time.monotonic() + 30
    while sum(n > 0 for n in _answered_by(server).values()) < 2:
        assert time.monotonic() < deadline, _answered_by(server)
        time.sleep(0.5)


def test_a_killed_ingress_replica_costs_a_client_nothing(server: ServeProcess) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", timeout=60)
    answered: list[float] = []
    failures: list[str] = []
    stop = threading.Event()

    def send() -> None:
        while not stop.is_set():
            try:
                client.completions.create(model=MODEL, prompt="still there?", max_tokens=2)
                answered.append(time.monotonic())
            except openai.OpenAIError as exc:
                failures.append(repr(exc))

    sender = threading.Thread(target=send)
    sender.start()
    try:
        time.sleep(1.0)
        [victim, _] = server.processes("OpenAIIngress")
        os.kill(victim, signal.SIGKILL)
        killed_at = time.monotonic()
        time.sleep(LOAD_S)
    finally:
        stop.set()
        sender.join(120)
    assert not failures, failures
    after = [t - killed_at for t in answered if t > killed_at]
    gaps = [b - a for a, b in zip([0.0, *after], after)]
    assert after and max(gaps) < 5.0, gaps  # the API never went away for longer
    deadline = time.monotonic() + RECOVERY_S
    while len(server.processes("OpenAIIngress")) != 2:  # Serve's replacement
        assert time.monotonic() < deadline, "no replacement ingress replica"
        time.sleep(0.5)
    replicas = server.processes("OpenAIIngress")
    assert victim not in replicas
    port = int(server.url.rsplit(":", 1)[1])
    deadline = time.monotonic() + RECOVERY_S
    while _listening_pids(port, replicas) != set(replicas):  # the new one joins the port
        assert time.monotonic() < deadline, "the replacement does not listen on the API port"
        time.sleep(0.5)
