"""A node failure under Serve, on a simulated multi-node Ray (`ray.cluster_utils.Cluster`), run by
test_multi_node.py in a process of its own (it cannot share the test session's Ray).

A head node with no CPUs (Serve's controller and proxy) and two worker nodes of one CPU each,
so that each engine replica's STRICT_PACK group lands on a node of its own (the ingress, which
takes no CPU, may land anywhere: the node removed is one that does not hold it). With
streams running on both engines (greedy and seeded, run once undisturbed before), one worker
node is removed the hard way (its raylet and workers killed): what happened to each stream (its
text, its longest pause), /health, and the replacement once a node with room joins, is printed
as one JSON line for the test (and benchmarks/failover.py) to judge.

    python tests/deploy/_multi_node_scenario.py MODEL_DIR [MAX_TOKENS]   # or `run_scenario(...)`
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for slow_engine
sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/deploy, for _subprocesses
from _subprocesses import descendants, kill_all, start_time  # noqa: E402
from slow_engine import slow_engine_builder  # noqa: E402

STREAMS = 6
MAX_TOKENS = 200  # a stream's (the benchmark's; the test's are shorter)
STEP_SLEEP_S = 0.05  # 200 tokens last about 10 s, so the node dies while they run
# Room for every stream on one engine (6 x 14 blocks of 16 tokens): the moved ones are not held
# up waiting for blocks, so their pause is the move's.
KV_BLOCKS = 128
TIMEOUT_S = 120.0


def run_scenario(
    model: str, timeout_s: float, script: str = __file__, args: tuple[str, ...] = ()
) -> dict[str, Any]:
    """The scenario (`script`'s `main`, this one's by default) in a process of its own (it
    cannot share a Ray with its caller), serving `model`: its report. Every process it started
    is gone afterwards; an AssertionError with the output's end says why when no report came
    or a process outlived it."""
    workdir = Path(tempfile.mkdtemp(prefix="pdr-mn-", dir="/tmp"))
    env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}
    env.update(RAY_TMPDIR=str(workdir), OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    log_path = workdir / "scenario.log"
    started: set[tuple[int, int]] = set()
    with log_path.open("w") as log:
        command = [sys.executable, script, model, *args]
        proc = subprocess.Popen(command, env=env, stdout=log, stderr=log)
    try:
        deadline = time.monotonic() + timeout_s
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
    assert proc.returncode == 0 and lines, f"{output[-5000:]}\n(Ray's logs: {workdir})"
    assert not left, f"processes outlived the scenario: {left}"
    shutil.rmtree(workdir, ignore_errors=True)  # kept where it failed: its Ray logs say why
    return json.loads(lines[-1][len("REPORT ") :])


def _stream(url: str, index: int, max_tokens: int, results: list[dict[str, Any]]) -> None:
    """Stream `index`: greedy for an even index, seeded sampling for an odd one."""
    body = {
        "model": "tiny",
        "prompt": f"stream number {index}",
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        **({"temperature": 0.0} if index % 2 == 0 else {"temperature": 1.0, "seed": index}),
    }
    outcome: dict[str, Any] = {"index": index, "tokens": 0, "error_code": None, "ended": None}
    text, chunk_times = [], []
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300) as response:
            outcome["status"] = response.status_code
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: ") :])
                if "error" in chunk:
                    outcome["error_code"] = chunk["error"].get("code")
                if chunk.get("usage"):
                    outcome["tokens"] = chunk["usage"]["completion_tokens"]
                if chunk.get("choices"):
                    text.append(chunk["choices"][0]["text"])
                    chunk_times.append(time.monotonic())
    except httpx.HTTPError as exc:
        outcome["error_code"] = repr(exc)
    outcome["ended"] = time.monotonic()
    outcome["text"] = "".join(text)
    outcome["longest_pause_s"] = max(
        (b - a for a, b in zip(chunk_times, chunk_times[1:])), default=0
    )
    results.append(outcome)


def _run_streams(url: str, max_tokens: int) -> tuple[list[threading.Thread], list[dict[str, Any]]]:
    """Every stream at once, each on a thread of its own (started); their outcomes."""
    results: list[dict[str, Any]] = []
    threads = [
        threading.Thread(target=_stream, args=(url, i, max_tokens, results), daemon=True)
        for i in range(STREAMS)
    ]
    for thread in threads:
        thread.start()
    return threads, results


def _wait(what: str, check: Any, timeout_s: float = TIMEOUT_S) -> float:
    start = time.monotonic()
    while not check():
        if time.monotonic() - start > timeout_s:
            raise TimeoutError(what)
        time.sleep(0.1)
    return time.monotonic() - start


def _engine_nodes() -> dict[str, str]:
    """Each live engine replica's id and the node it runs on (Ray's actor table)."""
    from ray._private import state

    nodes = {}
    for actor in state.actors().values():
        name = actor.get("Name") or ""
        if "#PagedRayEngine#" in name and actor.get("State") == "ALIVE":
            nodes[name.rsplit("#", 1)[1]] = actor["Address"]["NodeID"]
    return nodes


def _ingress_node() -> str:
    from ray._private import state

    (node,) = [
        actor["Address"]["NodeID"]
        for actor in state.actors().values()
        if "#OpenAIIngress#" in (actor.get("Name") or "") and actor.get("State") == "ALIVE"
    ]
    return node


def main(model: str, max_tokens: int = MAX_TOKENS) -> None:
    import ray
    from ray import serve
    from ray.cluster_utils import Cluster

    from pagedray.cluster.openai_app import build_openai_app
    from pagedray.engine.config import EngineConfig

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    workers = [cluster.add_node(num_cpus=1) for _ in range(2)]
    ray.init(address=cluster.address)
    try:
        port = _free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port}, proxy_location="HeadOnly")
        config = EngineConfig(
            model=model, served_model_name="tiny", num_kv_blocks=KV_BLOCKS, num_threads=1,
            use_ray_workers=False,
        )  # fmt: skip
        # Power of two: the streams spread over both engines (cache-aware routing would send
        # them all where the undisturbed run left their prompts' blocks).
        app = build_openai_app(
            config,
            num_replicas=2,
            engine_builder=slow_engine_builder(STEP_SLEEP_S),
            routing="power-of-two",
        )
        serve.run(app, name="multinode", route_prefix="/")
        url = f"http://127.0.0.1:{port}"
        report: dict[str, Any] = {}
        engine_nodes = _engine_nodes()
        report["engine_nodes"] = sorted(engine_nodes.values())
        report["worker_nodes"] = sorted(node.node_id for node in workers)
        ingress_node = _ingress_node()

        # The same streams undisturbed first: what each must still say after the node dies.
        threads, reference = _run_streams(url, max_tokens)
        for thread in threads:
            thread.join(TIMEOUT_S)
        report["reference"] = [
            {"text": o["text"], "longest_pause_s": o["longest_pause_s"]}
            for o in sorted(reference, key=lambda o: o["index"])
        ]
        threads, results = _run_streams(url, max_tokens)

        def running() -> dict[str, int]:
            stats = httpx.get(f"{url}/stats", timeout=10).json()["replicas"]
            return {r["replica_id"]: r["num_running"] for r in stats}

        _wait(
            "every stream running, on both engines",
            lambda: sum(running().values()) == STREAMS and min(running().values()) > 0,
        )
        # The victim: an engine's node that does not also hold the ingress.
        victim_replica = next(r for r, n in engine_nodes.items() if n != ingress_node)
        victim_node = next(w for w in workers if w.node_id == engine_nodes[victim_replica])
        report["running_at_kill"] = running()
        report["victim_replica"] = victim_replica
        killed_at = time.monotonic()
        cluster.remove_node(victim_node, allow_graceful=False)
        report["health_503_after_s"] = _wait(
            "/health 503", lambda: httpx.get(f"{url}/health", timeout=10).status_code == 503
        )
        for thread in threads:
            thread.join(TIMEOUT_S)
        report["streams"] = [
            {**outcome, "ended": outcome["ended"] - killed_at}
            for outcome in sorted(results, key=lambda o: o["index"])
        ]
        # Room for the replacement: a node joins; Serve starts the engine there.
        cluster.add_node(num_cpus=1)
        report["replaced_after_s"] = _wait(
            "a replacement engine",
            lambda: len(httpx.get(f"{url}/stats", timeout=10).json().get("replicas", [])) == 2,
            timeout_s=180,
        )
        report["health_200_after_s"] = _wait(
            "/health 200", lambda: httpx.get(f"{url}/health", timeout=10).status_code == 200
        )
        completion = httpx.post(
            f"{url}/v1/completions",
            json={"model": "tiny", "prompt": "after", "max_tokens": 4},
            timeout=60,
        )
        report["completion_after"] = completion.status_code
        report["engine_nodes_after"] = sorted(_engine_nodes().values())
        print("REPORT " + json.dumps(report), flush=True)
    finally:
        serve.shutdown()
        ray.shutdown()
        cluster.shutdown()


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


if __name__ == "__main__":
    main(sys.argv[1], *(int(arg) for arg in sys.argv[2:3]))
