"""An engine replica that dies costs its requests nothing (issue P14): the ingress sends each
again to a live replica, a non-streamed one whole, a stream resumed from the tokens its client
has, and the client gets the answer it would have had, token for token, in one stream.

Two engine replicas whose steps sleep (so that requests are still running when one is killed);
a replica's process is killed by Ray (no exit handler runs, as in a crash) while it holds them,
or stopped (SIGSTOP: alive, but answering nothing, as a wedged process).
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import time
from typing import Any, Iterator

import httpx
import jsonschema
import pytest
from _failover import (
    TIMEOUT_S,
    replicas,
    strike_mid_stream,
    survivors_hold_no_block,
    two_replica_app,
    two_replicas_serving,
)
from _serve_apps import deploy_app
from hypothesis import given, settings
from hypothesis import strategies as st

MODEL = "tiny"
APP = "failover"
MAX_TOKENS = 48  # about 2.5 s a request: still running when the replica dies
NUM_REQUESTS = 8


@pytest.fixture(scope="module")
def url(serve_url: str, tiny_llama: str) -> Iterator[str]:
    yield from deploy_app(serve_url, APP, two_replica_app(tiny_llama, MODEL))


def _complete(url: str, index: int) -> tuple[int, str]:
    body = {
        "model": MODEL,
        "prompt": f"request {index} of the failover test:",
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
    }
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=TIMEOUT_S)
    text = response.json()["choices"][0]["text"] if response.status_code == 200 else response.text
    return response.status_code, text


def _replica_actor(replica_id: str) -> Any:
    import ray

    return ray.get_actor(f"SERVE_REPLICA::{APP}#PagedRayEngine#{replica_id}", namespace="serve")


def _kill_replica(replica_id: str) -> None:
    """Kill an engine replica's process, as a crash would (Serve then starts another)."""
    import ray

    ray.kill(_replica_actor(replica_id), no_restart=True)


def _replica_pid(replica_id: str) -> int:
    import ray

    return ray.get(_replica_actor(replica_id).__ray_call__.remote(lambda _: os.getpid()))


def test_requests_on_a_killed_engine_replica_are_answered_by_the_other(url: str) -> None:
    two_replicas_serving(url)
    indices = list(range(NUM_REQUESTS))
    with concurrent.futures.ThreadPoolExecutor(NUM_REQUESTS) as pool:
        expected = list(pool.map(lambda i: _complete(url, i), indices))
    assert all(status == 200 for status, _ in expected), expected

    with concurrent.futures.ThreadPoolExecutor(NUM_REQUESTS) as pool:
        futures = [pool.submit(_complete, url, i) for i in indices]
        deadline = time.monotonic() + 30
        while True:  # both replicas hold requests: the killed one takes some with it
            running = {r["replica_id"]: r["num_running"] for r in replicas(url)}
            if len(running) == 2 and all(n > 0 for n in running.values()):
                break
            assert time.monotonic() < deadline, running
            time.sleep(0.05)
        victim = min(running, key=lambda replica_id: -running[replica_id])
        _kill_replica(victim)
        answers = [future.result() for future in futures]

    assert answers == expected  # every one answered, token-exact, none failed


# A JSON object whose string runs long: the stream is still inside it when its engine dies.
STORY_SCHEMA = {
    "type": "object",
    "properties": {"story": {"type": "string", "minLength": 200}},
    "required": ["story"],
}


@pytest.mark.parametrize(
    "sampling",
    [
        {"temperature": 0, "ignore_eos": True},
        {"temperature": 1.0, "seed": 7, "frequency_penalty": 0.5, "ignore_eos": True},
        {
            "temperature": 0,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "story", "schema": STORY_SCHEMA},
            },
        },
        {"n": 2, "temperature": 1.0, "seed": 11, "ignore_eos": True},
    ],
    ids=["greedy", "seeded", "json-schema", "n2-seeded"],
)
def test_a_stream_whose_engine_dies_goes_on_token_exact(url: str, sampling: dict[str, Any]) -> None:
    """The stream's replica is killed once some of its tokens reached the client: the client
    sees one stream, no error event, and the text of the same request undisturbed (for a
    structured output: the new engine replays the delivered tokens through the grammar, so
    the JSON goes on where it was, neither restarted nor duplicated; each of n choices goes on
    from its own tokens)."""
    body = {"prompt": "a stream that outlives its engine:", "max_tokens": 60, **sampling}
    struck = strike_mid_stream(url, MODEL, body, 10, _kill_replica)
    assert struck.error is None
    assert struck.texts == struck.expected and struck.num_chunks > 10


# A tool whose arguments run for a few dozen tokens and end well within the request's budget.
TOOL = {
    "type": "function",
    "function": {
        "name": "log_story",
        "parameters": {
            "type": "object",
            "properties": {"story": {"type": "string", "minLength": 40, "maxLength": 80}},
            "required": ["story"],
            "additionalProperties": False,
        },
    },
}


def test_a_tool_call_whose_engine_dies_goes_on_to_valid_arguments(url: str) -> None:
    """A chat stream making a (named, so constrained) tool call: its engine dies mid-arguments,
    the new engine replays them through the grammar, and the client gets the arguments of the
    undisturbed request, whole and valid, in one stream."""
    body = {
        "messages": [{"role": "user", "content": "log a story that outlives its engine"}],
        "tools": [TOOL],
        "tool_choice": {"type": "function", "function": {"name": "log_story"}},
        "temperature": 1.0,
        "seed": 5,
        "max_tokens": 200,
    }
    struck = strike_mid_stream(url, MODEL, body, 10, _kill_replica)
    assert struck.error is None
    assert struck.texts == struck.expected and struck.num_chunks > 10
    name, arguments = struck.texts[0][: len("log_story")], struck.texts[0][len("log_story") :]
    assert name == "log_story"
    jsonschema.validate(json.loads(arguments), TOOL["function"]["parameters"])


def test_a_responses_api_stream_whose_engine_dies_goes_on_token_exact(url: str) -> None:
    """The Responses API streams a chat generation: the same move, its output_text deltas the
    undisturbed ones."""
    body = {
        "input": "a response that outlives its engine:",
        "max_output_tokens": 60,
        "temperature": 0,
        "store": False,
    }
    struck = strike_mid_stream(url, MODEL, body, 10, _kill_replica)
    assert struck.error is None
    assert struck.texts == struck.expected and struck.num_chunks > 10


def test_a_stream_on_a_stopped_engine_replica_moves_before_serve_gives_up(url: str) -> None:
    """A replica that holds a stream stops answering (its process is stopped): the ingress's
    probe finds it within seconds and the stream goes on, token-exact, on the other replica,
    well before Serve's health check (30 s timeout) would replace it."""
    from pagedray.cluster.engine_deployment import HEALTH_CHECK_TIMEOUT_S

    body = {"prompt": "a stream whose engine stops:", "max_tokens": 60, "temperature": 0}
    body["ignore_eos"] = True
    stopped: list[int] = []

    def stop(victim: str) -> None:
        stopped.append(_replica_pid(victim))
        os.kill(stopped[0], signal.SIGSTOP)

    def resume() -> None:
        for pid in stopped:
            os.kill(pid, signal.SIGCONT)

    struck = strike_mid_stream(url, MODEL, body, 10, stop, resume)
    assert struck.error is None
    assert struck.texts == struck.expected and struck.num_chunks > 10
    assert struck.ended_after_s < HEALTH_CHECK_TIMEOUT_S


@settings(max_examples=3, deadline=None, derandomize=True)
@given(kill_after=st.integers(min_value=1, max_value=50))
def test_a_stream_killed_at_any_point_goes_on_and_the_survivor_leaks_no_block(
    url: str, kill_after: int
) -> None:
    """The kill lands after a drawn number of chunks; the stream ends as undisturbed, and once
    idle the surviving replica holds no KV block."""
    body = {"prompt": "a stream killed at a drawn point:", "max_tokens": 56, "temperature": 0}
    body["ignore_eos"] = True
    struck = strike_mid_stream(url, MODEL, body, kill_after, _kill_replica)
    assert struck.error is None and struck.texts == struck.expected
    survivors_hold_no_block(url, struck.victim)
