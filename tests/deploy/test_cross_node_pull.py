"""A prefix pulled from another node's engine (P15): the request sent away from the busy
replica that cached its prompt reaches an engine on another node, with a host tier of its own;
that engine pulls the blocks' bytes, writes them into its node's tier and answers from them,
token for token. The cluster is simulated (`ray.cluster_utils.Cluster`) in a process of its own,
run from `_cross_node_pull_scenario.py`."""

from __future__ import annotations

from pathlib import Path

from _multi_node_scenario import run_scenario

TIMEOUT_S = 300.0
SCRIPT = str(Path(__file__).resolve().with_name("_cross_node_pull_scenario.py"))


def test_a_prefix_cached_on_another_node_is_pulled_there_not_computed(tiny_llama: str) -> None:
    report = run_scenario(tiny_llama, TIMEOUT_S, SCRIPT)
    assert len(set(report["engine_nodes"])) == 2, "one engine per node"
    first, again = report["first"], report["again"]
    assert again["choices"][0]["text"] == first["choices"][0]["text"]
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 6 * 16
    exported = {r["replica_id"]: r["num_kv_exported_blocks"] for r in report["replicas"]}
    imported = {r["replica_id"]: r["num_kv_imported_blocks"] for r in report["replicas"]}
    # One engine exported the prompt's 6 blocks with their bytes; the other, on its own node's
    # tier, wrote them there and loaded them.
    assert sorted(exported.values()) == [0, 6] and sorted(imported.values()) == [0, 6]
    (holder,) = [replica for replica, n in exported.items() if n]
    assert imported[holder] == 0
