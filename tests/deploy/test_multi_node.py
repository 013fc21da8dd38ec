"""A node of a multi-node Ray dies under load (issues P8, P14): one engine per node, streams on
both; the dead node's streams move to the other node's engine and finish whole (greedy ones
with the text they had undisturbed), the other node's never notice, /health says so at once,
and the engine is replaced once a node with room joins. The cluster is simulated
(`ray.cluster_utils.Cluster`: several raylets on this machine) in a process of its own, run
from `_multi_node_scenario.py`; every process it started is gone afterwards.
"""

from __future__ import annotations

from _multi_node_scenario import run_scenario

TIMEOUT_S = 480.0
# From the kill to /health's 503; Ray's own node-death timeouts are 30 s and more, so this
# still tells a fast failure from a slow one. (Before requests moved, the dead node's streams
# ended with a 503 1.6 s after the kill.)
FAIL_FAST_S = 20.0
# Each stream's tokens: about 6 s of slow steps, under way on both engines when the node dies.
MAX_TOKENS = 120


def test_a_dead_nodes_streams_move_to_the_other_engine_and_its_engine_is_replaced(
    tiny_llama: str,
) -> None:
    report = run_scenario(tiny_llama, TIMEOUT_S, args=(str(MAX_TOKENS),))

    # One engine per node, each on a worker node.
    assert report["engine_nodes"] == report["worker_nodes"]
    streams = report["streams"]
    on_victim = report["running_at_kill"][report["victim_replica"]]
    whole = [s for s in streams if s["tokens"] == MAX_TOKENS and s["error_code"] is None]
    # The dead node held streams; they moved to the other engine: every stream is whole, its
    # usage counted once.
    assert on_victim >= 1 and len(whole) == len(streams), streams
    # Token for token as undisturbed, greedy and seeded alike: the context recomputed in one
    # prefill gives the same logits' bits as the decode steps that made it (exact rows).
    assert [s["text"] for s in streams] == [r["text"] for r in report["reference"]]
    assert report["health_503_after_s"] < FAIL_FAST_S
    # Replaced on the node that joined; serving again.
    assert len(report["engine_nodes_after"]) == 2
    assert report["completion_after"] == 200
