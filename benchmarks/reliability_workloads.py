"""The reliability workloads (issue P5), each against a running `pagedray serve` and returning
figures: bad bodies beside a streamed request, an abort storm with preemption, a flood of long
requests while short ones are timed, and a worker kill. benchmarks/reliability.py prints them at
the issue's scale; tests/deploy/test_reliability.py asserts on the same figures at a small one.
"""

from __future__ import annotations

import json
import os
import random
import signal
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

import httpx
from reliability_client import (
    CONTROL_TIMEOUT_S,
    POLL_S,
    Reply,
    Target,
    complete,
    health,
    http_client,
    post_raw,
    replica_stats,
    send_and_hang_up,
    stream,
    total_preemptions,
    wait_idle,
)

WORKER_MARKER = "ray::WorkerActor"  # in the command line of each worker actor's process
ENGINE_REPLICA_MARKER = "PagedRayEngine"  # in the command line of each engine replica's process


def rank_process_marker(tensor_parallel_size: int) -> str:
    """What marks the processes the model's ranks run in: at TP=1 the engine replica itself
    (the rank runs in it), at TP > 1 the worker actors."""
    return ENGINE_REPLICA_MARKER if tensor_parallel_size == 1 else WORKER_MARKER


# Token ids every model here has (the tiny preset's vocabulary is 512): prompts sent as ids
# have exact lengths, so their KV blocks are known.
PROMPT_TOKEN_IDS = range(10, 500)


# ---- a: bodies that used to crash the engine, or got a 500 --------------------------------------


def bad_bodies(model: str, pool_tokens: int) -> list[tuple[str, str, bytes]]:
    """(name, path, raw body): issue items 1, 2 and 7, as the raw JSON an attacker sends
    (`\\ud800` and `1e999` cannot be written by `json.dumps`). `pool_tokens` is what the KV pool
    holds: a streamed prompt longer than it must be refused before the stream starts."""
    ids = ",".join(str(i) for i in range(100, 140))
    too_long = ",".join(str(PROMPT_TOKEN_IDS[i % 400]) for i in range(pool_tokens + 16))
    completions = {
        "cache_salt lone surrogate": f'"prompt":[{ids}],"max_tokens":2,"cache_salt":"\\ud800"',
        "repetition_penalty 1e-300": '"prompt":"hello hello hello world","max_tokens":4,'
        '"temperature":1.0,"repetition_penalty":1e-300',
        "temperature 1e999": '"prompt":"hello","max_tokens":4,"temperature":1e999,"min_tokens":2',
        "top_k 2e20": '"prompt":"hello","max_tokens":4,"top_k":200000000000000000000,"top_p":0.5',
        "prompt lone surrogate": '"prompt":"hi \\ud800 there","max_tokens":2',
        "JSON nested 10,000 deep": f'"prompt":{"[" * 10_000}{"]" * 10_000},"max_tokens":2',
        "invalid UTF-8": '"prompt":"\udcff\udcfe","max_tokens":2',  # bytes FF FE, see below
        "max_tokens 1.5": '"prompt":"hello","max_tokens":1.5',
        "token id true": '"prompt":[true,5],"max_tokens":2',
        "prompt null": '"prompt":null,"max_tokens":2',
        "prompt 5": '"prompt":5,"max_tokens":2',
        "streamed prompt over the pool": f'"prompt":[{too_long}],"max_tokens":2,"stream":true',
    }
    bodies = [(name, "/v1/completions", text) for name, text in completions.items()]
    bodies += [
        (
            "chat content lone surrogate",
            "/v1/chat/completions",
            '"messages":[{"role":"user","content":"hi \\ud800"}]',
        ),
        ("/tokenize lone surrogate", "/tokenize", '"prompt":"hi \\ud800"'),
    ]
    # NOTE: surrogateescape turns the two escaped surrogates above back into raw bytes FF FE.
    head = f'{{"model":{json.dumps(model)},'
    return [
        (name, path, (head + text + "}").encode("utf-8", "surrogateescape"))
        for name, path, text in bodies
    ]


def bad_bodies_beside_stream(
    target: Target, max_tokens: int, timeout_s: float, block_size: int = 16
) -> tuple[list[tuple[str, int, str]], Reply]:
    """Replay the bad bodies while a long streamed request runs: ((name, status, response
    text) of each, the streamed request's reply)."""
    body = {"prompt": "a neighbour", "max_tokens": max_tokens, "ignore_eos": True}
    started = threading.Event()
    with http_client() as client, ThreadPoolExecutor(1) as pool:
        num_blocks = min(int(r["num_kv_blocks"]) for r in replica_stats(client, target))
        neighbour = pool.submit(stream, client, target, body, timeout_s, None, started)
        started.wait(timeout_s)
        results = [
            (name, *post_raw(client, target, path, raw))
            for name, path, raw in bad_bodies(target.model, num_blocks * block_size)
        ]
        return results, neighbour.result(timeout=timeout_s)


# ---- b: an abort storm with preemption --------------------------------------------------------


@dataclass
class StormFigures:
    num_sent: int
    statuses: Counter[int]  # of the streamed ones; 503s are admission refusals
    num_hung_up: int  # closed before the first byte back
    num_preemptions: int  # the engines' count grew by this during the storm
    settle_s: float  # after the last client closed, until no block or request was held
    leaked_blocks: int  # held after settling (0 expected)
    open_requests: int  # still open after settling (0 expected)


def abort_storm(
    target: Target,
    num_requests: int,
    concurrency: int,
    prompt_len: int,
    max_tokens: int,
    seed: int = 0,
    settle_timeout_s: float = 30.0,
    timeout_s: float = 120.0,
) -> StormFigures:
    """Streamed requests each closed by the client after a seeded random number of chunks
    (one in eight before the first byte back); long prompts overflow the KV pool."""
    rng = random.Random(seed)
    # (prompt, chunks read before closing: 0 = none, hang up within `wait_s` of sending)
    plans = [
        (
            rng.choices(PROMPT_TOKEN_IDS, k=prompt_len),
            0 if rng.random() < 0.125 else rng.randint(1, max_tokens),
            rng.random() * 0.05,
        )
        for _ in range(num_requests)
    ]
    with http_client(concurrency + 4) as client:
        preemptions_before = total_preemptions(client, target)

        def run(plan: tuple[list[int], int, float]) -> int:
            prompt, close_after, wait_s = plan
            body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}
            if close_after == 0:
                send_and_hang_up(target, body, wait_s)
                return 0
            return stream(client, target, body, timeout_s, close_after).status

        with ThreadPoolExecutor(concurrency) as pool:
            statuses = list(pool.map(run, plans))
        settle_s, held, left = wait_idle(client, target, settle_timeout_s)
        num_preemptions = total_preemptions(client, target) - preemptions_before
    replies = Counter(s for s in statuses if s != 0)
    hung_up = statuses.count(0)
    return StormFigures(num_requests, replies, hung_up, num_preemptions, settle_s, held, left)


# ---- c: a flood of long requests while short ones are timed -----------------------------------


@dataclass
class FloodFigures:
    long: list[Reply]  # every attempt of every long client, refusals included
    short: list[Reply]
    health_seen: Counter[str]  # /health answers polled while the shorts ran ("200 degraded")
    drain_s: float  # from the last answer until no block or request was held
    leaked_blocks: int  # held after draining (0 expected)

    def short_seconds(self, status: int) -> list[float]:
        return sorted(r.seconds for r in self.short if r.status == status)


def flood(
    target: Target,
    num_long: int,
    long_max_tokens: int,
    num_short: int,
    short_gap_s: float,
    budget_s: float,
    short_priority: int = 0,
    retry: bool = True,
) -> FloodFigures:
    """`num_long` clients each after one long completion (EOS ignored), with `retry` trying a
    503 again after its Retry-After (plus jitter) while the short ones run, so the queue stays
    full; meanwhile `num_short` short requests are sent one every `short_gap_s`, each timed
    whether or not the last was answered. Every request gives up after `budget_s`."""
    rng = random.Random(1)
    shorts_done = threading.Event()
    num_threads = num_long + num_short + 1
    with http_client(num_threads + 8) as client, ThreadPoolExecutor(num_threads) as pool:

        def long_client(seed: int) -> list[Reply]:
            body = _long_body(random.Random(seed), long_max_tokens)
            replies = [complete(client, target, body, budget_s)]
            while retry and replies[-1].status == 503 and not shorts_done.is_set():
                time.sleep(float(replies[-1].retry_after or 1) * (1 + rng.random()))
                replies.append(complete(client, target, body, budget_s))
            return replies

        seen = pool.submit(_poll_health, client, target, shorts_done)
        longs = [pool.submit(long_client, seed) for seed in range(num_long)]
        time.sleep(0.5)  # the longs reach the engine first
        short_body = {"prompt": "a short one", "max_tokens": 4, "priority": short_priority}
        shorts = []
        for _ in range(num_short):
            shorts.append(pool.submit(complete, client, target, short_body, budget_s))
            time.sleep(short_gap_s)
        short_replies = [future.result() for future in shorts]
        shorts_done.set()
        long_replies = [reply for future in longs for reply in future.result()]
        drain_s, held, _ = wait_idle(client, target, timeout_s=budget_s)
        return FloodFigures(long_replies, short_replies, seen.result(), drain_s, held)


def _long_body(rng: random.Random, max_tokens: int) -> dict[str, Any]:
    prompt = rng.choices(PROMPT_TOKEN_IDS, k=16)
    return {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}


def _poll_health(client: httpx.Client, target: Target, stop: threading.Event) -> Counter[str]:
    seen: Counter[str] = Counter()
    while not stop.wait(POLL_S * 2):
        seen[health(client, target)] += 1
    return seen


# ---- d: a worker killed mid-stream -------------------------------------------------------------


@dataclass
class KillFigures:
    pid: int  # the worker process killed
    stream: Reply  # the streamed request in flight when it died
    stream_end_s: float  # kill → that stream ended
    health_503_s: float | None  # kill → the first /health 503 (None: never seen)
    health_200_s: float | None  # kill → /health 200 again, after the 503
    completion_s: float | None  # kill → the first completion answered 200
    leaked_blocks: int  # held once recovered (0 expected)


def worker_kill(
    target: Target, worker_pids: Callable[[], list[int]], max_tokens: int, budget_s: float
) -> KillFigures:
    """SIGKILL one worker process (from `worker_pids`, which returns only processes the caller
    started) while a streamed request runs; time the failure and the recovery."""
    first_chunk = threading.Event()
    body = {"prompt": "in flight", "max_tokens": max_tokens, "ignore_eos": True}

    def in_flight() -> tuple[Reply, float]:
        reply = stream(client, target, body, budget_s, None, first_chunk)
        return reply, time.monotonic()

    with http_client() as client, ThreadPoolExecutor(1) as pool:
        running = pool.submit(in_flight)
        if not first_chunk.wait(budget_s):
            raise RuntimeError(f"no token within {budget_s:.0f} s: {running.result()}")
        time.sleep(0.2)  # mid-stream: steps in flight
        pid = worker_pids()[0]
        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        health_503_s = _until(lambda: health(client, target) == "503", killed, 10.0)
        health_200_s = _until(lambda: health(client, target).startswith("200"), killed, budget_s)
        probe = {"prompt": "after", "max_tokens": 2}
        ok = lambda: complete(client, target, probe, CONTROL_TIMEOUT_S).status == 200  # noqa: E731
        completion_s = _until(ok, killed, budget_s)
        reply, ended = running.result(timeout=budget_s)
        _, held, _ = wait_idle(client, target, timeout_s=10.0)
    return KillFigures(pid, reply, ended - killed, health_503_s, health_200_s, completion_s, held)


def _until(check: Callable[[], bool], since: float, timeout_s: float) -> float | None:
    """Seconds from `since` until `check()` first holds; None if not within `timeout_s`."""
    while time.monotonic() - since < timeout_s:
        if check():
            return time.monotonic() - since
        time.sleep(POLL_S)
    return None
