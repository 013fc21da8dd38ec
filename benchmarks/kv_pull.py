"""Pulled or computed: a session's next turn sent away from the replica that caches its context.

`pagedray serve` with two engine replicas (cache-aware routing, `--routing-load-threshold 2`,
the host tier at its defaults: no write-through), the default model. For each of the sessions,
one after the other:

1. its context (`--context` tokens) is completed once: it lands on one replica, whose pool
   then holds it (nothing is evicted: the pools are large);
2. three requests that extend the context with long outputs start, and the router sends them
   to that replica (they share its prefix, and it is not busier than the other by more than
   the threshold until the third); each has sent its first token;
3. the session's next turn (the context and a new question) is sent: the holder is busier by
   more than the threshold, so the router sends it to the other replica, which either pulls
   the context's blocks from the holder (`--routing-pull-min-blocks 32`, the default) or
   computes them (`0`). Its time to first token is the figure (a one-token completion, not
   streamed: every request here is unary, as a streamed one leaves its replica's output
   channel open, a call that Serve's load count adds to that replica);
4. the load requests end.

Both servers run the same seeded sessions, alternating with `--repeats`; the turns' greedy texts
must match between them. It prints per server the measured turns' TTFT p50 / p90, the prompt
tokens they had cached, and the blocks the replicas exported and took from a tier (/stats).

    .venv/bin/python benchmarks/kv_pull.py                      # 8 sessions, ~3 minutes
    .venv/bin/python benchmarks/kv_pull.py --repeats 3 --context 1536
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

# NOTE: run as a script, this directory is on sys.path.
from http_throughput import Server

from pagedray.tools.default_model import default_model_path
from pagedray.workers.host_kv_buffer import TIER_DIR_ENV

SERVER_START_S = 300.0
MODEL = "m"
LOAD_THRESHOLD = 2


@dataclass
class ServerRun:
    name: str
    ttfts: list[float] = field(default_factory=list)
    cached: list[int] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    sources: list[str] = field(default_factory=list)  # pulled, computed or the holder's pool
    exported_blocks: int = 0
    external_tokens: int = 0


def sessions(vocab_ids: list[int], count: int, context: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.choice(vocab_ids) for _ in range(context)] for _ in range(count)]


async def first_token(client: httpx.AsyncClient, prompt: list[int]) -> Any:
    """A one-token completion, not streamed (a streamed one would leave its replica's output
    channel open, a call Serve counts as load there): (its latency, text, cached tokens)."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0.0}
    start = time.perf_counter()
    response = await client.post("/v1/completions", json=body)
    latency = time.perf_counter() - start
    response.raise_for_status()
    answer = response.json()
    details = answer["usage"].get("prompt_tokens_details") or {}
    return latency, answer["choices"][0]["text"], details.get("cached_tokens") or 0


async def load_request(client: httpx.AsyncClient, prompt: list[int]) -> None:
    """A long request on the holder. Not streamed: a streamed one opens the
    replica's output channel, a call Serve counts as one more ongoing request there."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 400, "ignore_eos": True,
            "temperature": 0.0}  # fmt: skip
    await client.post("/v1/completions", json=body)


async def run_sessions(url: str, contexts: list[list[int]], load: int, run: ServerRun) -> None:
    rng = random.Random(1)
    limits = httpx.Limits(max_connections=load + 4)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        for context in contexts:
            await client.post("/v1/completions", json={"model": MODEL, "prompt": context,
                                                       "max_tokens": 1})  # fmt: skip
            await asyncio.sleep(0.3)  # the holder's KV events reach the router
            before = await prompt_sources(client)
            tasks = []
            # One at a time, each routed knowing the others' load. NOTE: no /stats meanwhile:
            # its calls to the replicas count as their load for as long as they run.
            for _ in range(load):
                suffix = [rng.randrange(100, 999)]
                tasks.append(asyncio.create_task(load_request(client, context + suffix)))
                await asyncio.sleep(0.3)
            question = [rng.randrange(100, 999) for _ in range(32)]
            ttft, text, cached = await first_token(client, context + question)
            after = await prompt_sources(client)
            # The load requests' prompts were cache hits but for their last token: the turn's
            # context was pulled if a tier gave it, computed if this many were computed.
            computed = after["local_compute"] - before["local_compute"]
            pulled = after["external_kv_transfer"] - before["external_kv_transfer"]
            source = "pulled" if pulled >= len(context) else "pool"
            run.sources.append("computed" if computed >= len(context) else source)
            run.ttfts.append(ttft)
            run.texts.append(text)
            run.cached.append(cached)
            # NOTE: they end, not cancelled: Serve's router kept counting cancelled calls as
            # load on their replica, which then skewed the next session's routing.
            await asyncio.gather(*tasks)
            await asyncio.sleep(0.5)


async def prompt_sources(client: httpx.AsyncClient) -> dict[str, int]:
    """Prompt tokens by where they came from, summed over replicas: the pool that holds them
    (`local_cache_hit`), a tier (`external_kv_transfer`) or computed."""
    replicas = (await client.get("/stats")).json()["replicas"]
    sources = ("local_compute", "local_cache_hit", "external_kv_transfer")
    return {s: sum(r[f"prompt_tokens_{s}"] for r in replicas) for s in sources}


def run_server(name: str, path: str, flags: list[str], contexts, load: int) -> ServerRun:
    os.environ[TIER_DIR_ENV] = tempfile.mkdtemp(prefix="pagedray-kv-pull-", dir="/dev/shm")
    log_dir = Path(tempfile.mkdtemp(prefix="pagedray_kv_pull_"))
    server = Server(path, None, 1, log_dir, 1, ("--served-model-name", MODEL, *flags))
    run = ServerRun(name)
    try:
        server.wait_healthy(SERVER_START_S)
        asyncio.run(run_sessions(server.url, contexts, load, run))
        replicas = httpx.get(f"{server.url}/stats", timeout=30).json()["replicas"]
        run.exported_blocks = sum(r.get("num_kv_exported_blocks", 0) for r in replicas)
        run.external_tokens = sum(r["prompt_tokens_external_kv_transfer"] for r in replicas)
    finally:
        server.stop()
    ms = [t * 1000 for t in run.ttfts]
    print(
        f"{name}: TTFT p50 {statistics.median(ms):.0f} ms, each "
        f"{', '.join(f'{t:.0f}' for t in ms)}; cached {run.cached}; the context "
        f"{run.sources}; exported "
        f"{run.exported_blocks} blocks, {run.external_tokens} prompt tokens from a tier",
        flush=True,
    )
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--context", type=int, default=1536, help="tokens of each context")
    parser.add_argument("--repeats", type=int, default=1, help="passes per server, alternated")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    from transformers import AutoTokenizer

    path = str(default_model_path())
    tokenizer = AutoTokenizer.from_pretrained(path)
    special = set(tokenizer.all_special_ids)
    vocab_ids = [i for i in range(len(tokenizer)) if i not in special]
    # One stream more than the threshold: all of them go to the holder (one more would go to the
    # other replica, which would then hold the context too), and the turn after them does not.
    load = LOAD_THRESHOLD + 1
    base = ["--num-replicas", "2", "--routing", "cache-aware"]
    base += ["--routing-load-threshold", str(LOAD_THRESHOLD)]
    servers = {
        "pulled": [*base, "--routing-pull-min-blocks", "32"],
        "computed": [*base, "--routing-pull-min-blocks", "0"],
    }
    print(f"model {path}; {args.sessions} sessions of {args.context} tokens; load {load}")
    runs: dict[str, list[ServerRun]] = {name: [] for name in servers}
    for repeat in range(args.repeats):
        contexts = sessions(vocab_ids, args.sessions, args.context, args.seed + repeat)
        print(f"-- repeat {repeat + 1}/{args.repeats}", flush=True)
        for name, flags in servers.items():
            runs[name].append(run_server(name, path, flags, contexts, load))
        pulled, computed = runs["pulled"][-1], runs["computed"][-1]
        same = sum(a == b for a, b in zip(pulled.texts, computed.texts))
        print(f"texts equal between the servers: {same}/{len(pulled.texts)}", flush=True)
    p50 = {
        name: statistics.median(statistics.median(r.ttfts) for r in name_runs)
        for name, name_runs in runs.items()
    }
    print(
        f"\nTTFT p50 of the turns sent away, computed / pulled: "
        f"{p50['computed'] / p50['pulled']:.2f}x ({p50['computed'] * 1000:.0f} against "
        f"{p50['pulled'] * 1000:.0f} ms)"
    )


if __name__ == "__main__":
    main()
