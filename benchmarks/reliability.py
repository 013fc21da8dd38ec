"""Reliability under hostile and crowded traffic (issue P5), measured against a real `pagedray
serve` this script starts (its own local Ray): bodies that used to crash the engine, an abort
storm with preemption, a worker kill, and a flood of long requests while short ones are timed:
first-come-first-served, then `--scheduling-policy priority` with the short ones at priority -1;
each sent once (the issue's), then by clients that retry each 503 (a crowd).

    .venv/bin/python benchmarks/reliability.py                # the default model, issue's scale
    .venv/bin/python benchmarks/reliability.py --model DIR -tp 2
    .venv/bin/python benchmarks/reliability.py --quick        # a smoke run at the test's scale
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from pathlib import Path

# NOTE: run as a script, this directory is on sys.path; the server is started by the tests'
# helper, so that one piece of code starts it and kills exactly what it started.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "deploy"))
from _subprocesses import pagedray_serve  # noqa: E402
from reliability_workloads import (  # noqa: E402
    FloodFigures,
    KillFigures,
    Reply,
    StormFigures,
    Target,
    abort_storm,
    bad_bodies_beside_stream,
    flood,
    rank_process_marker,
    worker_kill,
)

SERVED_NAME = "reliability"
# The abort storm's requests: prompts of 19 blocks (of 16 tokens), so three fill most of a
# 64-block pool and their output soon needs blocks no one has (preemption).
STORM_PROMPT_LEN = 300
STORM_MAX_TOKENS = 128
KILL_MAX_TOKENS = 900  # the stream in flight when the worker is killed
NEIGHBOUR_MAX_TOKENS = 256  # the stream beside the bad bodies


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f} s"


def _statuses(replies: list[Reply]) -> str:
    counts = Counter(r.status for r in replies)
    return ", ".join(f"{status or 'no answer'}: {n}" for status, n in sorted(counts.items()))


def report_bad_bodies(results: list[tuple[str, int, str]], neighbour: Reply) -> list[list[str]]:
    for name, status, text in results:
        print(f"  {status}  {name}: {text[:120]}")
    print(
        f"  neighbour stream: {neighbour.status}, {neighbour.completion_tokens} tokens, "
        f"finish {neighbour.finish_reason}, error {neighbour.error}"
    )
    counts = Counter(status for _, status, _ in results)
    statuses = ", ".join(f"{status}: {n}" for status, n in sorted(counts.items()))
    return [
        ["bad bodies", f"{len(results)} sent ({statuses})"],
        [
            "bad bodies: neighbour",
            f"{neighbour.completion_tokens} tokens, {neighbour.finish_reason}",
        ],
    ]


def report_storm(storm: StormFigures) -> list[list[str]]:
    print(f"  {storm}")
    statuses = ", ".join(f"{s}: {n}" for s, n in sorted(storm.statuses.items()))
    return [
        ["abort storm: sent", f"{storm.num_sent} ({statuses}; hung up {storm.num_hung_up})"],
        ["abort storm: preemptions", str(storm.num_preemptions)],
        [
            "abort storm: leaked blocks",
            f"{storm.leaked_blocks} (settled in {storm.settle_s:.2f} s)",
        ],
    ]


def report_flood(label: str, figures: FloodFigures) -> list[list[str]]:
    ok, refused = figures.short_seconds(200), figures.short_seconds(503)
    print(f"  long: {_statuses(figures.long)}; short: {_statuses(figures.short)}")
    print(f"  /health during the flood: {dict(figures.health_seen)}")
    latency = f"p50 {_seconds(_percentile(ok, 0.5))}, p99 {_seconds(_percentile(ok, 0.99))}"
    return [
        [f"{label}: long (every try)", _statuses(figures.long)],
        [f"{label}: short", _statuses(figures.short)],
        [f"{label}: short answered", f"{len(ok)}, {latency}"],
        [
            f"{label}: short refused 503",
            f"{len(refused)}, p50 {_seconds(_percentile(refused, 0.5))}, "
            f"max {_seconds(max(refused, default=None))}",
        ],
        [f"{label}: /health", ", ".join(f"{k}: {n}" for k, n in figures.health_seen.items())],
        [
            f"{label}: leaked blocks",
            f"{figures.leaked_blocks} (drained in {figures.drain_s:.1f} s)",
        ],
    ]


def report_kill(kill: KillFigures) -> list[list[str]]:
    reply = kill.stream
    print(
        f"  stream in flight: status {reply.status}, {reply.num_chunks} chunks, "
        f"error {reply.error}, {reply.body[:200]}"
    )
    return [
        ["worker kill: stream ended", f"{_seconds(kill.stream_end_s)} ({_how_ended(reply)})"],
        ["worker kill: -> /health 503", _seconds(kill.health_503_s)],
        ["worker kill: -> /health 200", _seconds(kill.health_200_s)],
        ["worker kill: -> completion 200", _seconds(kill.completion_s)],
        ["worker kill: leaked blocks", str(kill.leaked_blocks)],
    ]


def _how_ended(reply: Reply) -> str:
    if reply.error is not None:
        return f"in-stream error {reply.error.get('code')}"
    if reply.status != 200:
        return f"status {reply.status or 'none'}"
    return f"finish {reply.finish_reason}, {reply.completion_tokens} tokens"


def print_table(rows: list[list[str]]) -> None:
    width = max(len(name) for name, _ in rows)
    print()
    for name, value in rows:
        print(f"{name:<{width}}  {value}")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="HF checkpoint dir (default: built)")
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--num-kv-blocks", type=int, default=64)
    parser.add_argument("--num-long", type=int, default=300, help="the flood's long requests")
    parser.add_argument("--long-max-tokens", type=int, default=128)
    parser.add_argument("--num-short", type=int, default=150, help="timed during the flood")
    parser.add_argument("--short-gap", type=float, default=0.1, help="seconds between shorts")
    parser.add_argument("--num-storm", type=int, default=500, help="the abort storm's requests")
    parser.add_argument("--budget", type=float, default=180.0, help="seconds per scenario")
    parser.add_argument("--no-priority", action="store_true", help="skip the priority flood")
    parser.add_argument("--quick", action="store_true", help="the test's scale")
    args = parser.parse_args()
    if args.quick:
        args.max_num_seqs, args.num_long, args.num_short, args.num_storm = 4, 60, 20, 100
    return args


def serve_flags(args: argparse.Namespace, policy: str) -> list[str]:
    return [
        *("--served-model-name", SERVED_NAME, "-tp", str(args.tensor_parallel_size)),
        *("--max-num-seqs", str(args.max_num_seqs), "--num-kv-blocks", str(args.num_kv_blocks)),
        *("--num-threads", "1", "--scheduling-policy", policy),
    ]


def run_fcfs(args: argparse.Namespace) -> list[list[str]]:
    """Every scenario against one fcfs server; the worker kill last (it replaces the engine)."""
    rows: list[list[str]] = []
    start = time.monotonic()
    with pagedray_serve(args.model, *serve_flags(args, "fcfs"), start_timeout_s=600) as server:
        rows.append(["server start (fcfs)", f"{time.monotonic() - start:.1f} s"])
        target = Target(server.url, SERVED_NAME)
        print("a. bad bodies beside a streamed request", flush=True)
        bad = bad_bodies_beside_stream(target, NEIGHBOUR_MAX_TOKENS, args.budget)
        rows += report_bad_bodies(*bad)
        print("b. abort storm", flush=True)
        concurrency = 2 * args.max_num_seqs  # within what runs and waits: few refusals
        storm = abort_storm(
            target,
            args.num_storm,
            concurrency,
            STORM_PROMPT_LEN,
            STORM_MAX_TOKENS,
            timeout_s=args.budget,
        )
        rows += report_storm(storm)
        rows += run_floods(target, args, "fcfs", short_priority=0)
        print("d. worker kill", flush=True)
        marker = rank_process_marker(args.tensor_parallel_size)
        workers = lambda: server.processes(marker)  # noqa: E731
        kill = worker_kill(target, workers, KILL_MAX_TOKENS, args.budget)
        rows += report_kill(kill)
    return rows


def run_floods(
    target: Target, args: argparse.Namespace, policy: str, short_priority: int
) -> list[list[str]]:
    """The flood sent once (the issue's), then by clients that retry each 503 (a crowd)."""
    rows: list[list[str]] = []
    for retry in (False, True):
        label = f"flood {policy} {'retrying' if retry else 'once'}"
        print(f"c. {label} (short requests at priority {short_priority})", flush=True)
        loads = (args.num_long, args.long_max_tokens, args.num_short, args.short_gap)
        figures = flood(target, *loads, args.budget, short_priority, retry)
        rows += report_flood(label, figures)
    return rows


def run_priority(args: argparse.Namespace) -> list[list[str]]:
    """The floods again, with `--scheduling-policy priority` and the short requests at -1."""
    with pagedray_serve(args.model, *serve_flags(args, "priority"), start_timeout_s=600) as server:
        return run_floods(Target(server.url, SERVED_NAME), args, "priority", short_priority=-1)


def main() -> int:
    args = parse_args()
    rows = run_fcfs(args)
    if not args.no_priority:
        rows += run_priority(args)
    print_table(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
