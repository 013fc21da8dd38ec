"""Blocks pulled across nodes under Serve, on a simulated multi-node Ray (`ray.cluster_utils`),
run by test_cross_node_pull.py in a process of its own (it cannot share the test session's Ray).

Two worker nodes of one CPU each, one engine replica on each, each node with a host KV tier of
its own (`PAGEDRAY_KV_TIER_DIR` set per raylet, so each node's engines open their node's file).
Cache-aware routing with a load threshold of 0: a prompt completes once on one engine; while a
long stream that shares it runs there, the prompt is sent again and goes to the other node's
engine, which pulls the blocks' bytes from the holder into its own node's tier and loads them.
The answers and both replicas' /stats are printed as one JSON line for the test to judge.

    python tests/deploy/_cross_node_pull_scenario.py MODEL_DIR
"""

from __future__ import annotations

import json
import random
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/deploy
from _multi_node_scenario import _engine_nodes, _free_port, _wait  # noqa: E402

from pagedray.workers.host_kv_buffer import TIER_DIR_ENV  # noqa: E402

PROMPT_TOKENS = 100  # 6 full blocks of 16


def _complete(url: str, prompt: list[int]) -> dict[str, Any]:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0.0,
            "ignore_eos": True}  # fmt: skip
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    response.raise_for_status()
    return response.json()


def main(model: str) -> None:
    import ray
    from ray import serve
    from ray.cluster_utils import Cluster

    from pagedray.cluster.openai_app import build_openai_app
    from pagedray.engine.config import EngineConfig

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    tiers = [tempfile.mkdtemp(prefix="pdr-tier-", dir="/dev/shm") for _ in range(2)]
    for tier in tiers:
        cluster.add_node(num_cpus=1, env_vars={TIER_DIR_ENV: tier})
    ray.init(address=cluster.address)
    try:
        port = _free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port}, proxy_location="HeadOnly")
        config = EngineConfig(
            model=model, served_model_name="tiny", num_kv_blocks=256, num_threads=1,
            use_ray_workers=False, kv_offloading_size=0.01,
        )  # fmt: skip
        app = build_openai_app(
            config,
            num_replicas=2,
            routing="cache-aware",
            routing_load_threshold=0,
            routing_pull_min_blocks=2,
        )
        serve.run(app, name="pulls", route_prefix="/")
        url = f"http://127.0.0.1:{port}"
        report: dict[str, Any] = {"engine_nodes": sorted(_engine_nodes().values())}
        rng = random.Random(7)
        prompt = [rng.randrange(1, 250) for _ in range(PROMPT_TOKENS)]
        report["first"] = _complete(url, prompt)
        time.sleep(0.5)  # the holder's KV events reach the router
        started = threading.Event()

        def occupy() -> None:  # a long stream sharing the prompt: on the holder, busier
            body = {"model": "tiny", "prompt": prompt + [5] * 20, "max_tokens": 600,
                    "temperature": 0.0, "ignore_eos": True, "stream": True}  # fmt: skip
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
                for _ in r.iter_lines():
                    started.set()

        stream = threading.Thread(target=occupy, daemon=True)
        stream.start()
        _wait("the long stream", started.is_set)
        report["again"] = _complete(url, prompt)
        report["replicas"] = httpx.get(f"{url}/stats", timeout=30).json()["replicas"]
        stream.join(120)
        print("REPORT " + json.dumps(report), flush=True)
    finally:
        serve.shutdown()
        ray.shutdown()
        cluster.shutdown()
        for tier in tiers:
            shutil.rmtree(tier, ignore_errors=True)


if __name__ == "__main__":
    main(sys.argv[1])
