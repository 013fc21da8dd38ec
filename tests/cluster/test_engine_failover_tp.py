"""A tensor-parallel rank that dies costs its engine's streams nothing (issue P14): the engine
finds the rank gone (its executor's `dead_rank`), fails its requests as dead, and the ingress
resumes each on the other engine replica from the tokens its client has, token for token.

Two engine replicas at TP = 2 whose steps sleep (so that a stream is still running when a rank
dies), each rank a Ray actor of its own; one rank's process is SIGKILLed, as a crash of its
host process would, after a number of chunks and at a rank that hypothesis draws.
"""

from __future__ import annotations

import os
import signal
from typing import Iterator

import pytest
from _failover import strike_mid_stream, survivors_hold_no_block, two_replica_app
from _serve_apps import deploy_app
from hypothesis import given, settings
from hypothesis import strategies as st

MODEL = "tiny-tp2"
APP = "failover-tp2"
TENSOR_PARALLEL_SIZE = 2


@pytest.fixture(scope="module")
def url(serve_url: str, tiny_llama: str) -> Iterator[str]:
    app = two_replica_app(tiny_llama, MODEL, tensor_parallel_size=TENSOR_PARALLEL_SIZE)
    yield from deploy_app(serve_url, APP, app)


def _kill_rank(replica_id: str, rank: int) -> None:
    """SIGKILL the process of one rank of an engine replica (cluster/ray_executor.py names each
    rank's actor after its replica, in the namespace of the job that deployed the app: this
    test's)."""
    import ray

    actor = ray.get_actor(f"pagedray-replica-{replica_id}-rank{rank}")
    os.kill(ray.get(actor.__ray_call__.remote(lambda _: os.getpid())), signal.SIGKILL)


@settings(max_examples=2, deadline=None, derandomize=True)
@given(
    kill_after=st.integers(min_value=1, max_value=40),
    rank=st.integers(min_value=0, max_value=TENSOR_PARALLEL_SIZE - 1),
)
def test_a_stream_whose_rank_dies_goes_on_token_exact_and_the_survivor_leaks_no_block(
    url: str, kill_after: int, rank: int
) -> None:
    """Greedy and seeded at once (n = 2): each choice goes on from its own tokens."""
    body = {"prompt": "a stream that outlives a rank:", "max_tokens": 48, "n": 2}
    body.update(temperature=1.0, seed=5, ignore_eos=True)
    struck = strike_mid_stream(
        url, MODEL, body, kill_after, lambda victim: _kill_rank(victim, rank)
    )
    assert struck.error is None and struck.texts == struck.expected
    survivors_hold_no_block(url, struck.victim)
