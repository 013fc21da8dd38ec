"""Routing across engine replicas on a multi-tenant trace: cache-aware against power-of-two.

16 tenants, each with a system prompt of 512-1,024 tokens, send 8 requests each (the system
prompt, then a question of 32-64 tokens; 32 output tokens, EOS ignored), interleaved (one of
each tenant's in turn), at a fixed concurrency, streamed through `pagedray serve` with 2 engine
replicas (TP=1, one thread each), under each router:

- `cache-aware`: pagedray's router, by the engines' own prefix-cache block hashes;
- `power-of-two`: Serve's default policy, by load alone;
- reference: one replica with twice the KV pool, which never routes: the hit rate a perfect
  router could reach with the same total pool.

Ray Serve LLM's `PrefixCacheAffinityRouter` is not run: it cannot be attached to pagedray's engine
deployment. It reads prompt text from a `prompt` or `messages` attribute of the call's arguments
(pagedray's engine calls carry token ids, in a dict), and it routes every call by prefix, while
pagedray's ingress makes calls addressed to one replica (output-channel and KV-index
subscriptions), which only pagedray's router delivers there.

Tenants 0 and 1 share one system prompt and one `cache_salt` (their requests may share cached
blocks); tenants 2 and 3 share a system prompt under two salts (they must not); the others have
their own prompts and salts. Each replica's pool (`--num-kv-blocks`) holds about half of all the
system prompts, so one replica cannot keep every tenant's prefix, two can if the router keeps
each tenant on one replica.

Per router it prints the prefix-cache hit rate (prompt tokens found cached / looked up, summed
over replicas, from /stats), prompt tokens computed, TTFT p50/p90 and output tok/s; then the
ratios the issue sets targets on. Each run starts a fresh server (cold caches); with --repeats,
the routers alternate and medians are shown.

    .venv/bin/python benchmarks/multi_tenant_routing.py             # a few minutes on 2 cores
    .venv/bin/python benchmarks/multi_tenant_routing.py --repeats 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

# NOTE: run as a script, this directory is on sys.path.
from http_throughput import Server
from offline_throughput import benchmark_workload

NUM_TENANTS = 16
REQUESTS_PER_TENANT = 8
SYSTEM_TOKENS = (512, 1024)
QUESTION_TOKENS = (32, 64)
OUTPUT_TOKENS = 32
BLOCK_SIZE = 16
SERVER_START_S = 300.0


@dataclass(frozen=True)
class TraceRequest:
    tenant: int
    prompt: list[int]
    cache_salt: str


@dataclass
class RouterRun:
    """One pass of the trace through one server."""

    name: str
    hit_rate: float
    prompt_tokens_computed: int
    ttft_p50_s: float
    ttft_p90_s: float
    output_tok_s: float
    failures: int


def make_trace(vocab_ids: list[int], seed: int) -> list[TraceRequest]:
    """The seeded multi-tenant trace, interleaved: request k of every tenant before k + 1."""
    rng = random.Random(seed)

    def tokens(bounds: tuple[int, int]) -> list[int]:
        return [rng.choice(vocab_ids) for _ in range(rng.randint(*bounds))]

    systems = [tokens(SYSTEM_TOKENS) for _ in range(NUM_TENANTS)]
    systems[1] = systems[0]  # tenants 0 and 1: one prompt, one salt (they may share)
    systems[3] = systems[2]  # tenants 2 and 3: one prompt, two salts (they must not)
    salts = [f"tenant-{tenant}" for tenant in range(NUM_TENANTS)]
    salts[1] = salts[0]
    trace = []
    for _ in range(REQUESTS_PER_TENANT):
        for tenant in range(NUM_TENANTS):
            prompt = systems[tenant] + tokens(QUESTION_TOKENS)
            trace.append(TraceRequest(tenant, prompt, salts[tenant]))
    return trace


def kv_blocks_per_replica(trace: list[TraceRequest], concurrency: int) -> int:
    """Half the distinct system prompts' blocks, plus what the running requests add to them (a
    question and the output each): one replica cannot keep every prefix, two can."""
    distinct = {(r.cache_salt, tuple(r.prompt[: SYSTEM_TOKENS[0]])): r for r in trace}
    prefix_blocks = sum(len(r.prompt) // BLOCK_SIZE for r in distinct.values())
    per_request = (QUESTION_TOKENS[1] + OUTPUT_TOKENS) // BLOCK_SIZE + 2
    return prefix_blocks // 2 + concurrency * per_request


async def run_trace(url: str, model: str, trace: list[TraceRequest], concurrency: int) -> Any:
    """Streams every request, `concurrency` at a time; TTFTs, output tokens, failures."""
    queue = list(reversed(trace))
    ttfts: list[float] = []
    output_tokens, failures = 0, 0

    async def one(client: httpx.AsyncClient, request: TraceRequest) -> None:
        nonlocal output_tokens, failures
        body = {
            "model": model,
            "prompt": request.prompt,
            "max_tokens": OUTPUT_TOKENS,
            "ignore_eos": True,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
            "cache_salt": request.cache_salt,
        }
        start, first = time.perf_counter(), None
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                failures += 1
                return
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                if first is None:
                    first = time.perf_counter()
                if '"completion_tokens"' in line:
                    usage = json.loads(line[len("data: ") :]).get("usage")
                    if usage:
                        output_tokens += usage["completion_tokens"]
        if first is None:
            failures += 1
        else:
            ttfts.append(first - start)

    async def worker(client: httpx.AsyncClient) -> None:
        while queue:
            await one(client, queue.pop())

    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        start = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
        wall = time.perf_counter() - start
    return ttfts, output_tokens, failures, wall


def prefix_stats(url: str) -> tuple[int, int]:
    """Prompt tokens looked up in the prefix cache and found there, summed over replicas."""
    replicas = httpx.get(f"{url}/stats", timeout=30).json()["replicas"]
    return (
        sum(r["prefix_cache_queries"] for r in replicas),
        sum(r["prefix_cache_hits"] for r in replicas),
    )


def run_router(
    name: str, path: str, trace: list[TraceRequest], flags: list[str], concurrency: int
) -> RouterRun:
    log_dir = Path(tempfile.mkdtemp(prefix="pagedray_routing_bench_"))
    server = Server(path, 1, 1, log_dir, extra_flags=("--served-model-name", "m", *flags))
    try:
        server.wait_healthy(SERVER_START_S)
        queries0, hits0 = prefix_stats(server.url)
        ttfts, output_tokens, failures, wall = asyncio.run(
            run_trace(server.url, "m", trace, concurrency)
        )
        queries, hits = prefix_stats(server.url)
    finally:
        server.stop()
    queries, hits = queries - queries0, hits - hits0
    deciles = statistics.quantiles(ttfts, n=10) if len(ttfts) > 1 else [float("nan")] * 9
    run = RouterRun(
        name,
        hits / queries if queries else 0.0,
        queries - hits,
        statistics.median(ttfts) if ttfts else float("nan"),
        deciles[8],
        output_tokens / wall,
        failures,
    )
    print(
        f"{name}: hit rate {run.hit_rate:.1%}, prompt tokens computed {run.prompt_tokens_computed}"
        f", TTFT p50 {run.ttft_p50_s * 1000:.0f} ms p90 {run.ttft_p90_s * 1000:.0f} ms, "
        f"{run.output_tok_s:.0f} out tok/s, {run.failures} failed",
        flush=True,
    )
    return run


def median_run(runs: list[RouterRun]) -> RouterRun:
    def med(field: str) -> Any:
        return statistics.median(getattr(run, field) for run in runs)

    return RouterRun(
        runs[0].name,
        med("hit_rate"),
        int(med("prompt_tokens_computed")),
        med("ttft_p50_s"),
        med("ttft_p90_s"),
        med("output_tok_s"),
        sum(run.failures for run in runs),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=1, help="passes per router, alternated")
    parser.add_argument("--concurrency", type=int, default=8, help="requests in flight")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    from transformers import AutoTokenizer

    path, _ = benchmark_workload(1, True, args.seed)
    tokenizer = AutoTokenizer.from_pretrained(path)
    special = set(tokenizer.all_special_ids)
    vocab_ids = [i for i in range(len(tokenizer)) if i not in special]
    trace = make_trace(vocab_ids, args.seed)
    blocks = kv_blocks_per_replica(trace, args.concurrency)
    prompt_tokens = sum(len(r.prompt) for r in trace)
    print(
        f"model {path}; {len(trace)} requests of {NUM_TENANTS} tenants, {prompt_tokens} prompt "
        f"tokens; {blocks} KV blocks of {BLOCK_SIZE} per replica; concurrency {args.concurrency}"
    )
    two = ["--num-replicas", "2", "--num-kv-blocks", str(blocks)]
    routers = {
        "cache-aware": [*two, "--routing", "cache-aware"],
        "power-of-two": [*two, "--routing", "power-of-two"],
        "one replica, 2x KV": ["--num-replicas", "1", "--num-kv-blocks", str(2 * blocks)],
    }
    runs: dict[str, list[RouterRun]] = {name: [] for name in routers}
    for repeat in range(args.repeats):
        print(f"-- repeat {repeat + 1}/{args.repeats}", flush=True)
        for name, flags in routers.items():
            runs[name].append(run_router(name, path, trace, flags, args.concurrency))

    medians = {name: median_run(name_runs) for name, name_runs in runs.items()}
    print(f"\n{'router':<20}{'hit rate':>10}{'computed':>10}{'TTFT p50':>10}{'p90':>8}"
          f"{'tok/s':>8}{'failed':>8}")  # fmt: skip
    for run in medians.values():
        print(
            f"{run.name:<20}{run.hit_rate:>10.1%}{run.prompt_tokens_computed:>10}"
            f"{run.ttft_p50_s * 1000:>8.0f}ms{run.ttft_p90_s * 1000:>6.0f}ms"
            f"{run.output_tok_s:>8.0f}{run.failures:>8}"
        )
    aware, blind = medians["cache-aware"], medians["power-of-two"]
    reference = medians["one replica, 2x KV"]
    print(
        f"\ncache-aware hit rate / one replica with 2x KV: "
        f"{aware.hit_rate / reference.hit_rate:.2f} (target >= 0.90)\n"
        f"TTFT p50, power-of-two / cache-aware: {blind.ttft_p50_s / aware.ttft_p50_s:.2f}x "
        f"(target >= 2x)\n"
        f"output tok/s, cache-aware / power-of-two: {aware.output_tok_s / blind.output_tok_s:.2f}x"
        f" (target >= 1)"
    )


if __name__ == "__main__":
    main()
