"""A node of a multi-node Ray dies under load (issues P8, P14): one engine per node, streams on
both; the dead node's streams move to the other node's engine and finish whole, the other
node's never notice, /health says so at once, and the engine is replaced once a node with room
joins. The cluster is simulated
(`ray.cluster_utils.Cluster`: several raylets on this machine) in a process of its own, run
from `_multi_node_scenario.py`; every process it started is gone afterwards.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _subprocesses import descendants, kill_all, start_time

SCENARIO = Path(__file__).with_name("_multi_node_scenario.py")
TIMEOUT_S = 480.0
# From the kill to /health's 503; Ray's own node-death timeouts are 30 s and more, so this
# still tells a fast failure from a slow one. (Before requests moved, the dead node's streams
# ended with a 503 1.6 s after the kill.)
FAIL_FAST_S = 20.0


def test_a_dead_nodes_streams_move_to_the_other_engine_and_its_engine_is_replaced(
    tiny_llama: str,
) -> None:
    workdir = Path(tempfile.mkdtemp(prefix="pdr-mn-", dir="/tmp"))
    env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}
    env.update(RAY_TMPDIR=str(workdir), OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    log_path = workdir / "scenario.log"
    started: set[tuple[int, int]] = set()
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            [sys.executable, str(SCENARIO), tiny_llama], env=env, stdout=log, stderr=log
        )
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while proc.poll() is None and time.monotonic() < deadline:
            for pid in descendants(proc.pid):  # remembered while they are ours to name
                if (started_at := start_time(pid)) is not None:
                    started.add((pid, started_at))
            time.sleep(0.5)
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)
    finally:
        left = kill_all(started, 30)
    output = log_path.read_text(errors="replace")
    lines = [line for line in output.splitlines() if line.startswith("REPORT ")]
    assert proc.returncode == 0 and lines, output[-5000:]
    assert not left, f"processes outlived the scenario: {left}"
    report = json.loads(lines[-1][len("REPORT ") :])

    # One engine per node, each on a worker node.
    assert report["engine_nodes"] == report["worker_nodes"]
    streams = report["streams"]
    on_victim = report["running_at_kill"][report["victim_replica"]]
    whole = [s for s in streams if s["tokens"] == 300 and s["error_code"] is None]
    # The dead node held streams; they moved to the other engine: every stream is whole, its
    # usage counted once.
    assert on_victim >= 1 and len(whole) == len(streams), streams
    assert report["health_503_after_s"] < FAIL_FAST_S
    # Replaced on the node that joined; serving again.
    assert len(report["engine_nodes_after"]) == 2
    assert report["completion_after"] == 200
