"""No request can take the engine down (issue P5), checked against a real `pagedray serve` with
its own local Ray, at TP=1 and TP=2 (gloo): bad bodies get a 4xx while a stream beside them
completes, an abort storm with preemption leaks no KV block, a flood of long requests leaves
short ones answered or refused at once, and a killed worker's engine is replaced by Serve.

The workloads are benchmarks/reliability_workloads.py's (the benchmark prints the same figures at
the issue's scale). Each TP size starts one server, and every scenario runs against it in turn;
the worker kill runs last, as it replaces the engine.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from _subprocesses import ServeProcess, pagedray_serve, thread_policies

from pagedray.cluster.pipe_dispatch import plan_reader_name
from pagedray.workers import cpu_scheduling
from pagedray.workers.compute_thread import OS_THREAD_NAME

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from reliability_workloads import (  # noqa: E402
    Target,
    abort_storm,
    bad_bodies_beside_stream,
    complete,
    flood,
    http_client,
    rank_process_marker,
    worker_kill,
)

MODEL = "tiny"
NUM_KV_BLOCKS = 64  # 1,024 tokens: the tiny model's whole context, and what preemption needs
MAX_NUM_SEQS = 4  # so a flood fills the waiting queue (2 x 4) with a few dozen requests
NEIGHBOUR_TOKENS = 300  # the stream that runs while the bad bodies arrive
STORM = {"num_requests": 100, "concurrency": 8, "prompt_len": 224, "max_tokens": 96}
FLOOD = {"num_long": 60, "long_max_tokens": 200, "num_short": 20, "short_gap_s": 0.2}
SHORT_ANSWER_S = 30.0  # an admitted short request, queued behind at most 8 long ones
REFUSAL_S = 2.0  # a 503 comes at once
KILL_TOKENS = 900  # the stream in flight when the worker dies: still running when killed
RECOVERY_S = 60.0  # kill -> Serve's new replica answers /health and a completion
BUDGET_S = 120.0  # any one request or wait in a scenario
# The threads torch's gloo backend starts from the compute thread as it joins the group (its
# transport loop, its run loop, rank 0's TCPStore server): the collectives' path, under the
# compute thread's policy.
COLLECTIVE_THREADS = ("gloo_tcp_loop", "pt_gloo_runloop", "pt_tcpstore_uv")

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", params=[1, 2], ids=["tp1", "tp2"])
def server(request: pytest.FixtureRequest, tiny_llama: str) -> Iterator[ServeProcess]:
    flags = ["--served-model-name", MODEL, "--num-kv-blocks", str(NUM_KV_BLOCKS)]
    flags += ["--max-num-seqs", str(MAX_NUM_SEQS), "-tp", str(request.param)]
    flags += ["--num-threads", "1", "--device", "cpu"]
    with pagedray_serve(tiny_llama, *flags) as serving:
        yield serving


@pytest.fixture()
def target(server: ServeProcess) -> Target:
    return Target(server.url, MODEL)


def _error_body_problems(status: int, text: str) -> list[str]:
    """What is wrong with an error answer: not a 4xx, not OpenAI's shape, or internals shown."""
    problems = [] if 400 <= status < 500 else [f"status {status}"]
    try:
        error = json.loads(text)["error"]
        if not {"message", "type", "param", "code"} <= set(error):
            problems.append(f"error fields {sorted(error)}")
    except (ValueError, KeyError, TypeError):
        problems.append("not an OpenAI-style error body")
    if "Traceback" in text or 'File "' in text:
        problems.append("a traceback")
    return problems


def _seconds(value: float | None) -> str:
    return "never" if value is None else f"{value:.2f} s"


def _health(target: Target) -> httpx.Response:
    return httpx.get(f"{target.url}/health", timeout=10, trust_env=False)


def test_bad_bodies_get_a_4xx_while_a_stream_beside_them_completes(target: Target) -> None:
    results, neighbour = bad_bodies_beside_stream(target, NEIGHBOUR_TOKENS, BUDGET_S)
    failures = [
        f"{name}: {', '.join(problems)}: {text[:300]}"
        for name, status, text in results
        if (problems := _error_body_problems(status, text))
    ]
    assert not failures, "\n".join(failures)
    assert neighbour.status == 200 and neighbour.error is None, neighbour
    assert neighbour.completion_tokens == NEIGHBOUR_TOKENS, neighbour
    assert neighbour.finish_reason == "length"
    response = _health(target)
    assert response.status_code == 200
    assert response.json() == {"status": "ok"}


def test_an_abort_storm_with_preemption_leaks_no_block(target: Target) -> None:
    storm = abort_storm(target, **STORM, seed=0, settle_timeout_s=10.0)
    assert storm.num_preemptions > 0, storm  # the storm overflowed the pool
    assert set(storm.statuses) <= {200, 503}, storm
    assert storm.statuses[200] >= STORM["num_requests"] // 4, storm  # not all refused
    assert storm.num_hung_up > 0
    assert (storm.leaked_blocks, storm.open_requests) == (0, 0), storm
    with http_client() as client:
        after = complete(client, target, {"prompt": "hi", "max_tokens": 8}, BUDGET_S)
    assert (after.status, after.completion_tokens) == (200, 8), after


def test_a_flood_leaves_short_requests_answered_or_refused_at_once(
    target: Target, capsys: pytest.CaptureFixture[str]
) -> None:
    figures = flood(target, **FLOOD, budget_s=BUDGET_S)
    answered, refused = figures.short_seconds(200), figures.short_seconds(503)
    with capsys.disabled():
        print(
            f"\nflood ({target.url}): long tries {Counter(r.status for r in figures.long)}, "
            f"short answered {len(answered)} (max {max(answered, default=0):.2f} s), "
            f"refused {len(refused)} (max {max(refused, default=0):.2f} s), "
            f"/health {dict(figures.health_seen)}"
        )
    for reply in figures.long:
        assert reply.status in (200, 503), reply
        if reply.status == 200:
            assert reply.completion_tokens == FLOOD["long_max_tokens"], reply
    assert any(reply.status == 503 for reply in figures.long)  # admission control is on
    for reply in figures.short:
        assert reply.status in (200, 503), reply
        if reply.status == 503:
            assert reply.retry_after is not None and reply.seconds < REFUSAL_S, reply
        else:
            assert reply.completion_tokens == 4 and reply.seconds < SHORT_ANSWER_S, reply
    # Saturated but stepping: degraded, never 503 (that is for an engine that cannot step).
    assert figures.health_seen["200 degraded"] > 0, figures.health_seen
    assert all(seen.startswith("200") for seen in figures.health_seen), figures.health_seen
    assert figures.leaked_blocks == 0, figures


def test_the_ranks_step_threads_take_a_core_on_waking_and_their_others_do_not(
    server: ServeProcess, request: pytest.FixtureRequest
) -> None:
    """Under pagedray serve's SCHED_BATCH, each rank process's compute thread (and its OpenMP
    team) and, at TP > 1, its plan reader and gloo's threads run SCHED_OTHER; every other thread
    SCHED_BATCH (workers/cpu_scheduling.py)."""
    if not cpu_scheduling.supported():
        pytest.skip("no SCHED_BATCH on this OS (Linux only)")
    tp = request.node.callspec.params["server"]
    ranks = server.processes(rank_process_marker(tp))
    assert len(ranks) == tp
    readers = set()
    for pid in ranks:
        policies = thread_policies(pid)
        assert policies.pop(OS_THREAD_NAME) == {os.SCHED_OTHER}
        for rank in range(tp) if tp > 1 else ():
            if (reader := policies.pop(plan_reader_name(rank), None)) is not None:
                assert reader == {os.SCHED_OTHER}
                readers.add(rank)
        for name in COLLECTIVE_THREADS if tp > 1 else ():
            assert policies.pop(name, {os.SCHED_OTHER}) == {os.SCHED_OTHER}, name
        others = {name: p for name, p in policies.items() if p != {os.SCHED_BATCH}}
        assert not others and policies, others
    assert readers == (set(range(tp)) if tp > 1 else set())


def test_a_killed_worker_fails_its_stream_fast_and_serve_replaces_the_engine(
    server: ServeProcess,
    target: Target,
    capsys: pytest.CaptureFixture[str],
    request: pytest.FixtureRequest,
) -> None:
    """At TP=1 the rank runs in the engine replica, so that process is the one killed."""
    marker = rank_process_marker(request.node.callspec.params["server"])
    kill = worker_kill(target, lambda: server.processes(marker), KILL_TOKENS, BUDGET_S)
    with capsys.disabled():
        print(
            f"\nworker kill ({server.url}): after the kill, the stream ended in "
            f"{kill.stream_end_s:.2f} s, /health 503 in {_seconds(kill.health_503_s)}, "
            f"200 in {_seconds(kill.health_200_s)}, a completion in {_seconds(kill.completion_s)}"
        )
    reply = kill.stream
    assert reply.error is not None or reply.status >= 500, reply
    assert reply.completion_tokens < KILL_TOKENS, reply
    assert kill.stream_end_s < 5.0, kill
    assert kill.health_503_s is not None and kill.health_503_s < 3.0, kill
    assert kill.health_200_s is not None and kill.health_200_s < RECOVERY_S, kill
    assert kill.completion_s is not None and kill.completion_s < RECOVERY_S, kill
    assert kill.leaked_blocks == 0, kill
    assert kill.pid not in server.processes(marker)


def test_a_killed_ingress_replica_is_replaced_on_the_api_port(
    server: ServeProcess, target: Target, capsys: pytest.CaptureFixture[str]
) -> None:
    """The process that listens on the API port is killed: Serve starts another ingress
    replica, which listens on the same port at once (Serve's 150 s port quarantine, for an
    HAProxy in front, is off: none is), and the API answers again."""
    [pid] = server.processes("OpenAIIngress")
    os.kill(pid, signal.SIGKILL)
    killed_at = time.monotonic()
    body = {"model": MODEL, "prompt": "back?", "max_tokens": 4}
    answered_s = None
    while time.monotonic() - killed_at < BUDGET_S:
        try:
            reply = httpx.post(f"{target.url}/v1/completions", json=body, timeout=10)
        except httpx.HTTPError:
            reply = None
        if reply is not None and reply.status_code == 200:
            answered_s = time.monotonic() - killed_at
            break
        time.sleep(0.25)
    with capsys.disabled():
        print(f"\ningress kill ({server.url}): a completion answered {_seconds(answered_s)} after")
    assert answered_s is not None and answered_s < RECOVERY_S
    assert pid not in server.processes("OpenAIIngress")
