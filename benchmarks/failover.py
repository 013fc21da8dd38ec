"""Fault injection (issue P14): what an engine's or the ingress's failure costs the clients.

A real `pagedray serve` with two engine replicas serves concurrent streamed completions that mix
greedy and seeded sampling, n = 2, a JSON schema, stop strings and logprobs. They run once
undisturbed (the reference), then once per fault, the fault striking one engine replica when
about a third of the tokens are out: SIGKILL (a crash), SIGSTOP (alive but answering nothing,
until the streams end). The ingress replica is SIGKILLed next, with no load: the seconds until a
completion is answered again (then the same on a server with two ingress replicas sharing the
API port). Last, a server at TP = 2 (each engine's ranks are actors of their own), where one
rank's process is SIGKILLed (its engine dies with it); and a simulated multi-node Ray (one
engine per node, steps slowed, tests/deploy/_multi_node_scenario.py) loses a node (its
replacement counted from when a node with room joins); and an app deployed again from two
engine replicas to one mid-stream (the replica removed drains; its last column: until one is
left). Per fault it prints the requests that
failed, those whose text (every choice) or chosen tokens' logprobs differ from the reference,
the JSON outputs that do not parse (of those that finished), each request's longest pause
between two chunks (p50 / p99, against the reference's), and how long until two engine replicas
serve again.

    .venv/bin/python benchmarks/failover.py                       # the default model
    .venv/bin/python benchmarks/failover.py --requests 24 --max-tokens 48 --tp2-requests 0
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import httpx
import jsonschema

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "deploy"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "cluster"))
from _failover import choice_text  # noqa: E402
from _multi_node_scenario import MAX_TOKENS as NODE_MAX_TOKENS  # noqa: E402
from _multi_node_scenario import run_scenario  # noqa: E402
from _subprocesses import ServeProcess, free_port, pagedray_serve  # noqa: E402

MODEL = "failover"
KINDS = ("greedy", "seeded", "n2", "json", "tool", "stop", "logprobs")
STORY_SCHEMA = {
    "type": "object",
    "properties": {"story": {"type": "string", "minLength": 400}},
    "required": ["story"],
}
# A named tool call (constrained) whose arguments end within the request's tokens.
TOOL_NAME = "log_story"
TOOL_SCHEMA = {
    "type": "object",
    "properties": {"story": {"type": "string", "minLength": 60, "maxLength": 120}},
    "required": ["story"],
    "additionalProperties": False,
}
STRIKE_AT = 1 / 3  # of the expected tokens, when the fault strikes
REQUEST_TIMEOUT_S = 300.0
REPLACEMENT_TIMEOUT_S = 180.0
LOGPROB_TOLERANCE = 1e-3
PAUSED_S = 1.0  # a longest pause beyond this: the fault held the request up


def body_of(index: int, max_tokens: int) -> dict[str, Any]:
    """The request `index` of a run: the same in every run."""
    kind = KINDS[index % len(KINDS)]
    body: dict[str, Any] = {
        "model": MODEL,
        "prompt": f"Request {index} of the fault-injection run tells a story:",
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0.0,
    }
    if kind == "greedy":
        body["ignore_eos"] = True
    elif kind == "seeded":
        body.update(temperature=1.0, top_p=0.9, seed=index, frequency_penalty=0.3)
        body["ignore_eos"] = True
    elif kind == "n2":
        body.update(n=2, temperature=1.0, seed=index, ignore_eos=True)
    elif kind == "json":
        schema = {"name": "story", "schema": STORY_SCHEMA}
        body["response_format"] = {"type": "json_schema", "json_schema": schema}
    elif kind == "tool":
        del body["prompt"]
        body.update(temperature=1.0, seed=index, max_tokens=4 * max_tokens)
        body["messages"] = [{"role": "user", "content": f"Request {index} logs a story."}]
        body["tools"] = [
            {"type": "function", "function": {"name": TOOL_NAME, "parameters": TOOL_SCHEMA}}
        ]
        body["tool_choice"] = {"type": "function", "function": {"name": TOOL_NAME}}
    elif kind == "stop":
        body.update(stop=["e ", "a."], ignore_eos=True)
    else:
        body.update(logprobs=2, ignore_eos=True)
    return body


@dataclass
class StreamRecord:
    """What one client saw of its stream."""

    kind: str
    status: int = 0
    texts: dict[int, str] = field(default_factory=dict)  # by choice index
    finish_reasons: dict[int, str | None] = field(default_factory=dict)
    logprobs: list[tuple[str, float]] = field(default_factory=list)  # (token, logprob)
    chunk_times: list[float] = field(default_factory=list)
    error: str | None = None
    done: bool = False  # [DONE] came

    @property
    def failed(self) -> bool:
        return self.status != 200 or self.error is not None or not self.done

    @property
    def longest_pause_s(self) -> float:
        times = self.chunk_times
        return max((b - a for a, b in zip(times, times[1:])), default=0.0)


def read_stream(client: httpx.Client, url: str, body: dict[str, Any], on_chunk: Callable[[], None]):
    record = StreamRecord(KINDS[0])
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    try:
        with client.stream("POST", f"{url}{path}", json=body, timeout=REQUEST_TIMEOUT_S) as r:
            record.status = r.status_code
            if r.status_code != 200:
                record.error = r.read().decode(errors="replace")[:200]
                return record
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    record.done = True
                    break
                event = json.loads(line.removeprefix("data: "))
                if "error" in event:
                    record.error = str(event["error"])[:200]
                    continue
                for choice in event.get("choices", []):
                    index = choice["index"]
                    record.texts[index] = record.texts.get(index, "") + choice_text(choice)
                    if choice.get("finish_reason"):
                        record.finish_reasons[index] = choice["finish_reason"]
                    logprobs = choice.get("logprobs") or {}
                    record.logprobs += zip(
                        logprobs.get("tokens") or [], logprobs.get("token_logprobs") or []
                    )
                if event.get("choices"):
                    record.chunk_times.append(time.monotonic())
                    on_chunk()
    except httpx.HTTPError as exc:
        record.error = repr(exc)[:200]
    return record


def run_all(url: str, num_requests: int, max_tokens: int, strike: Callable[[], None] | None):
    """Every request at once; `strike()` is called (on a thread of its own) once about
    `STRIKE_AT` of the expected chunks have come."""
    chunks, lock, struck = [0], threading.Lock(), threading.Event()
    expected = sum(
        max_tokens * (2 if KINDS[i % len(KINDS)] == "n2" else 1) for i in range(num_requests)
    )

    def on_chunk() -> None:
        with lock:
            chunks[0] += 1
            due = strike is not None and not struck.is_set() and chunks[0] >= expected * STRIKE_AT
            if due:
                struck.set()
        if due:
            threading.Thread(target=strike, daemon=True).start()

    limits = httpx.Limits(max_connections=num_requests + 4, max_keepalive_connections=num_requests)
    with (
        httpx.Client(limits=limits, trust_env=False) as client,
        ThreadPoolExecutor(num_requests) as pool,
    ):
        futures = [
            pool.submit(read_stream, client, url, body_of(i, max_tokens), on_chunk)
            for i in range(num_requests)
        ]
        records = [future.result() for future in futures]
    for i, record in enumerate(records):
        record.kind = KINDS[i % len(KINDS)]
    return records


def engine_replicas(url: str) -> list[dict[str, Any]]:
    try:
        response = httpx.get(f"{url}/stats", timeout=15, trust_env=False)
        return response.json()["replicas"] if response.status_code == 200 else []
    except (httpx.HTTPError, ValueError, KeyError):
        return []


def wait_for_replicas(url: str, count: int, since: float) -> float | None:
    while time.monotonic() - since < REPLACEMENT_TIMEOUT_S:
        replicas = engine_replicas(url)
        if len(replicas) == count and all(r.get("healthy", True) for r in replicas):
            return time.monotonic() - since
        time.sleep(0.25)
    return None


@dataclass
class FaultFigures:
    name: str
    num_requests: int
    failed: int
    differ: dict[str, int]
    json_invalid: int
    pause_p50: float
    pause_p99: float
    paused: int  # requests whose longest pause passed PAUSED_S: those the fault held up
    replacement_s: float | None


def compare(
    name: str,
    records: list[StreamRecord],
    reference: list[StreamRecord],
    replacement_s: float | None,
) -> FaultFigures:
    differ: dict[str, int] = {}
    json_invalid = 0
    for record, ref in zip(records, reference):
        if record.failed:
            continue
        same = record.texts == ref.texts and record.finish_reasons == ref.finish_reasons
        if record.kind == "logprobs":
            same = (
                same
                and len(record.logprobs) == len(ref.logprobs)
                and all(
                    t == rt and abs(lp - rlp) <= LOGPROB_TOLERANCE
                    for (t, lp), (rt, rlp) in zip(record.logprobs, ref.logprobs)
                )
            )
        if not same:
            differ[record.kind] = differ.get(record.kind, 0) + 1
            print(
                f"  {name}: a {record.kind} request differs: {_difference(record, ref)}",
                file=sys.stderr,
            )
        json_invalid += not _valid(record)
    pauses = sorted(record.longest_pause_s for record in records if not record.failed)
    return FaultFigures(
        name,
        len(records),
        sum(record.failed for record in records),
        differ,
        json_invalid,
        _quantile(pauses, 0.5),
        _quantile(pauses, 0.99),
        sum(pause > PAUSED_S for pause in pauses),
        replacement_s,
    )


def _valid(record: StreamRecord) -> bool:
    """A finished JSON output parses; a finished tool call's arguments match its schema."""
    text, finish = record.texts.get(0, ""), record.finish_reasons.get(0)
    try:
        if record.kind == "json" and finish == "stop":
            json.loads(text)
        elif record.kind == "tool" and finish in ("stop", "tool_calls"):
            if not text.startswith(TOOL_NAME):
                return False
            jsonschema.validate(json.loads(text.removeprefix(TOOL_NAME)), TOOL_SCHEMA)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def _difference(record: StreamRecord, ref: StreamRecord) -> str:
    """Where a request's output first departs from the reference's, per choice."""
    parts = []
    for index in sorted(set(record.texts) | set(ref.texts)):
        got, want = record.texts.get(index, ""), ref.texts.get(index, "")
        at = next(
            (i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want))
        )
        if got != want:
            got_there, want_there = got[at : at + 20], want[at : at + 20]
            parts.append(
                f"choice {index} at char {at} of {len(want)}: {got_there!r} for {want_there!r}"
            )
        finish, want_finish = record.finish_reasons.get(index), ref.finish_reasons.get(index)
        if finish != want_finish:
            parts.append(f"choice {index} finished {finish} for {want_finish}")
    return "; ".join(parts) or "logprobs"


def _quantile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    return values[min(len(values) - 1, int(q * len(values)))]


@dataclass(frozen=True)
class Fault:
    """A fault: the signal, and the processes of the server it may strike (the first is)."""

    name: str
    marker: str  # in the victim's command line
    signum: signal.Signals


# At TP = 1 the rank runs in the engine replica's process; at TP = 2 the ranks are actors.
ENGINE_FAULTS = (
    Fault("SIGKILL engine", "PagedRayEngine", signal.SIGKILL),
    Fault("SIGSTOP engine", "PagedRayEngine", signal.SIGSTOP),
)
TP2_FAULTS = (Fault("SIGKILL TP worker (TP = 2)", "WorkerActor", signal.SIGKILL),)


def run_fault(
    server: ServeProcess, fault: Fault, args: argparse.Namespace, reference: list[StreamRecord]
) -> FaultFigures:
    wait_for_replicas(server.url, 2, time.monotonic())
    time.sleep(2.0)  # the ingress's router hears of a new replica
    victim = server.processes(fault.marker)[0]
    struck_at: list[float] = []

    def strike() -> None:
        os.kill(victim, fault.signum)
        struck_at.append(time.monotonic())

    try:
        records = run_all(server.url, len(reference), args.max_tokens, strike)
    finally:
        if fault.signum == signal.SIGSTOP:
            os.kill(victim, signal.SIGCONT)
    replacement_s = None
    if fault.signum == signal.SIGKILL and struck_at:
        replacement_s = wait_for_replicas(server.url, 2, struck_at[0])
    for record in records:
        if record.failed:
            failure = f"a {record.kind} request failed: {record.error}"
            print(f"  {fault.name}: {failure}", file=sys.stderr)
    return compare(fault.name, records, reference, replacement_s)


def run_faults(
    server: ServeProcess, faults: tuple[Fault, ...], args: argparse.Namespace, num_requests: int
) -> tuple[list[StreamRecord], list[FaultFigures]]:
    """The undisturbed reference run on `server`, then each fault's run against it."""
    started = time.monotonic()
    reference = run_all(server.url, num_requests, args.max_tokens, None)
    print(
        f"reference: {num_requests} streams in {time.monotonic() - started:.1f} s, "
        f"{sum(r.failed for r in reference)} failed, {sum(not _valid(r) for r in reference)} "
        f"JSON invalid, tool calls finished: "
        f"{[r.finish_reasons.get(0) for r in reference if r.kind == 'tool']}"
    )
    return reference, [run_fault(server, fault, args, reference) for fault in faults]


def node_removal(model: str | None) -> FaultFigures:
    """tests/deploy/_multi_node_scenario.py on `model`: one engine replica per node of a
    simulated multi-node Ray (slow steps), greedy and seeded streams; one node removed."""
    if model is None:
        from pagedray.tools.default_model import default_model_path

        model = str(default_model_path())
    report = run_scenario(model, REPLACEMENT_TIMEOUT_S * 3)
    streams, reference = report["streams"], report["reference"]
    differ: dict[str, int] = {}
    for stream, ref in zip(streams, reference):
        if stream["text"] != ref["text"]:
            kind = "greedy" if stream["index"] % 2 == 0 else "seeded"
            differ[kind] = differ.get(kind, 0) + 1
    pauses = sorted(stream["longest_pause_s"] for stream in streams)
    return FaultFigures(
        f"node removed ({len(streams)} streams of {NODE_MAX_TOKENS} tokens)",
        len(streams),
        sum(s["error_code"] is not None or s["tokens"] != NODE_MAX_TOKENS for s in streams),
        differ,
        0,
        _quantile(pauses, 0.5),
        _quantile(pauses, 0.99),
        sum(pause > PAUSED_S for pause in pauses),
        report["replaced_after_s"],
    )


def redeploy_drain(model: str | None, num_requests: int, max_tokens: int) -> FaultFigures:
    """Serve in this process (a local Ray of its own, as `serve run` would) with two engine
    replicas; a third of the way into the streams the app is deployed again with one: the
    replica removed drains, its streams finishing where they run."""
    import ray
    from ray import serve

    from pagedray.cluster.openai_app import build_app

    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False)
    struck_at: list[float] = []
    redeployed = threading.Event()
    try:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        app_args: dict[str, Any] = {"served_model_name": MODEL, "max_num_seqs": 64}
        app_args.update(model=model, num_replicas=2, ingress_num_cpus=0.1)
        serve.run(build_app(app_args), name="drain", route_prefix="/")
        url = f"http://127.0.0.1:{port}"
        reference = run_all(url, num_requests, max_tokens, None)
        wait_for_replicas(url, 2, time.monotonic())

        def redeploy() -> None:
            struck_at.append(time.monotonic())
            try:
                one = build_app({**app_args, "num_replicas": 1})
                serve.run(one, name="drain", route_prefix="/")  # on its own thread: it may wait
            finally:
                redeployed.set()

        records = run_all(url, num_requests, max_tokens, redeploy)
        one_left_s = wait_for_replicas(url, 1, struck_at[0]) if struck_at else None
        figures = compare("redeployed to one replica (drain)", records, reference, None)
        figures.replacement_s = one_left_s
        return figures
    finally:
        # serve.run waits until the removed replica has drained, after the streams end; Ray shut
        # down under that call aborted this whole process a minute later (its GCS gone).
        if struck_at:
            redeployed.wait(REPLACEMENT_TIMEOUT_S)
        serve.shutdown()
        ray.shutdown()


def ingress_kill(server: ServeProcess) -> float | None:
    os.kill(server.processes("OpenAIIngress")[0], signal.SIGKILL)
    killed_at = time.monotonic()
    body = {"model": MODEL, "prompt": "back?", "max_tokens": 4}
    while time.monotonic() - killed_at < REPLACEMENT_TIMEOUT_S:
        try:
            reply = httpx.post(
                f"{server.url}/v1/completions", json=body, timeout=10, trust_env=False
            )
            if reply.status_code == 200:
                return time.monotonic() - killed_at
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", nargs="?", default=None, help="default: the built default model")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument(
        "--tp2-requests", type=int, default=32, help="streams of the TP = 2 run (0: no such run)"
    )
    parser.add_argument(
        "--no-shared-ingress",
        dest="shared_ingress",
        action="store_false",
        help="no run with 2 ingress replicas sharing the API port",
    )
    parser.add_argument(
        "--no-node-removal",
        dest="node_removal",
        action="store_false",
        help="no run on a simulated multi-node Ray with one node removed",
    )
    parser.add_argument(
        "--no-drain",
        dest="drain",
        action="store_false",
        help="no run redeploying two engine replicas to one mid-stream",
    )
    args = parser.parse_args()
    flags = ["--served-model-name", MODEL, "--num-replicas", "2", "--max-num-seqs", "64"]
    with pagedray_serve(args.model, *flags, start_timeout_s=300) as server:
        reference, figures = run_faults(server, ENGINE_FAULTS, args, args.requests)
        wait_for_replicas(server.url, 2, time.monotonic())
        unavailable_s = ingress_kill(server)
    shared_s = None
    if args.shared_ingress:
        shared_flags = [*flags, "--num-ingress-replicas", "2"]
        with pagedray_serve(args.model, *shared_flags, start_timeout_s=300) as server:
            shared_s = ingress_kill(server)
    removed_node = [node_removal(args.model)] if args.node_removal else []
    drained = [redeploy_drain(args.model, args.requests, args.max_tokens)] if args.drain else []
    tp2: list[FaultFigures] = []
    if args.tp2_requests > 0:
        tp2_flags = [*flags, "--tensor-parallel-size", "2"]
        with pagedray_serve(args.model, *tp2_flags, start_timeout_s=300) as server:
            tp2 = run_faults(server, TP2_FAULTS, args, args.tp2_requests)[1]
    ref_pauses = sorted(r.longest_pause_s for r in reference if not r.failed)
    print(
        f"\n{args.requests} streamed requests ({', '.join(KINDS)}; {args.tp2_requests} at TP = 2), "
        f"{args.max_tokens} tokens each, 2 engine replicas; longest pause per request "
        f"undisturbed: p50 {_quantile(ref_pauses, 0.5):.2f} s, "
        f"p99 {_quantile(ref_pauses, 0.99):.2f} s\n"
    )
    print(
        "| fault | failed | differ from the reference | JSON invalid "
        f"| longest pause p50 / p99 | paused > {PAUSED_S:g} s | two replicas again |"
    )
    print("|---|---|---|---|---|---|---|")
    for f in figures + tp2 + removed_node + drained:
        differ = ", ".join(f"{kind} {n}" for kind, n in sorted(f.differ.items())) or "0"
        again = "-" if f.replacement_s is None else f"{f.replacement_s:.1f} s"
        print(
            f"| {f.name} | {f.failed} / {f.num_requests} | {differ} | {f.json_invalid} | "
            f"{f.pause_p50:.2f} / {f.pause_p99:.2f} s | {f.paused} | {again} |"
        )
    shown = "never" if unavailable_s is None else f"{unavailable_s:.1f} s"
    print(f"\nSIGKILL of the ingress replica (no load): a completion answered again after {shown}")
    if args.shared_ingress:
        shown = "never" if shared_s is None else f"{shared_s:.1f} s"
        print(f"the same with 2 ingress replicas on the API port: after {shown}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
