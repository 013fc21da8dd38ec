"""HTTP throughput: `pagedray serve` driven by the official OpenAI client, against `LLM.generate`.

The seeded ShareGPT-like workload of `offline_throughput.py` (greedy, EOS ignored, per-request
output lengths) runs offline through `LLM.generate`, then through a `pagedray serve` subprocess on
its own local Ray: every request at once to /v1/completions, without and with streaming. Each
system first runs the whole workload once untimed (`--cold` skips it), so that a fresh server's
one-off costs (oneDNN compiling a primitive per batch size it meets) are not timed against an
engine that has paid them already. Each repeat starts each system once and times `--passes`
passes of the workload through it (a server's alternate streamed and not): on a 2-core machine
one pass's wall time varies by 10-25% with what else wakes meanwhile, and a pass costs a few
seconds where a server's start costs 20. Each system runs at its defaults: `LLM.generate` on every
core (`--threads`), the server on all but one, which it leaves to its serving path
(`--server-threads` overrides).

    .venv/bin/python benchmarks/http_throughput.py            # 64 requests, a few minutes
    .venv/bin/python benchmarks/http_throughput.py --quick    # 16 short requests, a smoke run
    .venv/bin/python benchmarks/http_throughput.py --tp2      # also tensor_parallel_size=2
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import os
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai

# NOTE: run as a script, this directory is on sys.path: the workload is the offline benchmark's.
from offline_throughput import (
    NUM_CHECKED,
    Workload,
    benchmark_workload,
    timed,
)

from pagedray.workers.compute_thread import OS_THREAD_NAME
from pagedray.workers.host_kv_buffer import TIER_DIR_ENV

# Seconds between /health polls while the server starts.
POLL_S = 1.0
# Seconds the server gets to exit after each signal before the next, harsher one.
EXIT_WAIT_S = 30.0
# Other processes' CPU use, as a share of all the machine's CPUs, above which a run is flagged.
CONTENDED = 0.1
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")  # /proc times are in these per second


@dataclass
class Run:
    """One timed pass of the workload through one system."""

    name: str
    tp: int  # tensor_parallel_size
    wall_s: float  # seconds, first submission to the last result
    num_output_tokens: int  # generated tokens, as the system reports them
    texts: list[str]  # generated text per request
    token_counts: list[int]  # generated tokens per request
    others_cpu_s: float  # CPU seconds other processes used during the run (see OtherCpu)
    ttft_s: list[float] = field(default_factory=list)  # per request, streaming only
    # CPU seconds over the run by process role (the server's processes; offline: this one).
    cpu_by_role: dict[str, float] = field(default_factory=dict)
    client_cpu_s: float = 0.0  # the HTTP client's (this process's) CPU seconds over the run

    def cpu_ms_per_token(self) -> float:
        return 1000 * sum(self.cpu_by_role.values()) / max(1, self.num_output_tokens)

    @property
    def output_tok_s(self) -> float:
        return self.num_output_tokens / self.wall_s

    @property
    def others_share(self) -> float:
        """Other processes' CPU use as a share of every CPU over the run's wall time."""
        return self.others_cpu_s / (self.wall_s * (os.cpu_count() or 1))


# ---- CPU contention (Linux /proc) ------------------------------------------------------------


def _stat_fields(pid: int | str) -> list[str] | None:
    """/proc/<pid>/stat after the command (state, ppid, pgrp, session, ...); None if gone."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            # The command is parenthesised and may itself contain spaces or parentheses.
            return stat.read().rsplit(")", 1)[1].split()
    except OSError:
        return None


def session_pids(session: int) -> list[int]:
    """Live (not zombie) processes in `session`."""
    pids = []
    for entry in os.listdir("/proc"):
        fields = _stat_fields(entry) if entry.isdigit() else None
        if fields is not None and fields[0] != "Z" and int(fields[3]) == session:
            pids.append(int(entry))
    return pids


class OtherCpu:
    """CPU seconds used by processes outside `sessions` over a `with` block: the machine's busy
    time less that of the processes in them (ours, Ray's and the server's).

    A run-queue sampler (as `offline_throughput.py` has) would count the server as another
    process; this reads /proc only at the start and the end. Processes of ours that exit
    within the block are missed, and so counted as others'.
    """

    def __init__(self, sessions: list[int]) -> None:
        self.sessions = sessions
        self.others_s = 0.0

    def _snapshot(self) -> tuple[float, float]:
        with open("/proc/stat") as stat:
            # cpu user nice system idle iowait irq softirq steal ...
            times = [int(x) for x in stat.readline().split()[1:9]]
        busy = sum(times) - times[3] - times[4]
        ours = 0
        for pid in (pid for session in self.sessions for pid in session_pids(session)):
            fields = _stat_fields(pid)
            ours += int(fields[11]) + int(fields[12]) if fields else 0  # utime + stime
        return busy / CLOCK_TICKS, ours / CLOCK_TICKS

    def __enter__(self) -> OtherCpu:
        self._start = self._snapshot()
        return self

    def __exit__(self, *exc: object) -> None:
        (busy_start, ours_start), (busy_end, ours_end) = self._start, self._snapshot()
        self.others_s = max(0.0, (busy_end - busy_start) - (ours_end - ours_start))


def process_title(pid: int) -> str | None:
    """A process's command line as one string (Ray and vLLM put their titles there); None if
    it is gone."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            return cmdline.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return None


def _role_of(pid: int) -> str:
    """What a server process is, from its title (Ray names actors `ray::Class...`)."""
    title = process_title(pid)
    if title is None:
        return "gone"
    for marker, role in (
        ("PagedRayEngine", "engine replica"),
        ("OpenAIIngress", "ingress replica"),
        ("ProxyActor", "Serve proxy"),
        ("WorkerActor", "worker actors"),
        ("ServeController", "Serve controller"),
        ("pagedray serve", "pagedray serve CLI"),
        ("raylet", "raylet"),
        ("gcs_server", "GCS"),
        ("dashboard", "Ray dashboard and agents"),
        ("DashboardAgent", "Ray dashboard and agents"),
        ("RuntimeEnvAgent", "Ray dashboard and agents"),
    ):
        if marker in title:
            return role
    return "other Ray processes"


# The OS name of pagedray's compute thread, which the OpenMP threads it starts inherit: their
# CPU is the model's.
COMPUTE_THREAD_NAME = OS_THREAD_NAME
MODEL_PART, LOOP_PART = "model", "loop and Ray"


def cpu_ticks(pid: int, role: str) -> dict[str, int]:
    """A process's CPU ticks (user + system) by role; the engine replica's split between its
    model ("engine replica: model": the compute thread and its OpenMP threads) and the rest
    (the event loop, output processing, Ray's and Serve's threads)."""
    fields = _stat_fields(pid)
    if not fields:
        return {}
    total = int(fields[11]) + int(fields[12])
    if role != "engine replica":
        return {role: total}
    model = 0
    with contextlib.suppress(OSError):  # exited meanwhile
        for tid in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError):
                with open(f"/proc/{pid}/task/{tid}/comm") as comm:
                    if comm.read().strip() != COMPUTE_THREAD_NAME:
                        continue
                task = _stat_fields(f"{pid}/task/{tid}")
                model += int(task[11]) + int(task[12]) if task else 0
    return {f"{role}: {MODEL_PART}": model, f"{role}: {LOOP_PART}": max(0, total - model)}


class ServerCpu:
    """CPU seconds each role of a server's processes used over a `with` block (from /proc)."""

    def __init__(self, session: int) -> None:
        self.session = session
        self.by_role: dict[str, float] = {}

    def _snapshot(self) -> dict[tuple[int, str], int]:
        snapshot = {}
        for pid in session_pids(self.session):
            for role, ticks in cpu_ticks(pid, _role_of(pid)).items():
                snapshot[pid, role] = ticks
        return snapshot

    def __enter__(self) -> ServerCpu:
        self._start = self._snapshot()
        return self

    def __exit__(self, *exc: object) -> None:
        for (pid, role), ticks in self._snapshot().items():
            used = ticks - self._start.get((pid, role), 0)
            self.by_role[role] = self.by_role.get(role, 0.0) + used / CLOCK_TICKS


# ---- offline: LLM.generate -------------------------------------------------------------------


def run_offline(
    path: str, workload: Workload, threads: int, tp: int, warm: bool, passes: int
) -> list[Run]:
    """`LLM.generate` in this process (its TP ranks as Ray actors on a local Ray of our own):
    `passes` timed passes of the workload, each under a cache salt of its own."""
    import ray

    from pagedray import LLM, SamplingParams

    if tp > 1:
        # NOTE: address="local" always starts a fresh Ray, never joins one already on the machine.
        ray.init(
            address="local", num_cpus=max(os.cpu_count() or 1, 1 + tp), include_dashboard=False
        )
    llm = None
    texts: list[str] = []

    def generate(
        prompts: list[list[int]], output_lens: list[int], salt: str | None = None
    ) -> list[list[int]]:
        params = [
            SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in output_lens
        ]
        # A salt keeps the untimed pass's prefix-cache entries from serving the timed one.
        inputs = [{"prompt_token_ids": p, "cache_salt": salt} for p in prompts]
        outputs = llm.generate(inputs, params, use_tqdm=False)
        texts[:] = [out.outputs[0].text for out in outputs]
        return [list(out.outputs[0].token_ids) for out in outputs]

    runs = []
    try:
        llm = LLM(path, dtype="float32", num_threads=threads, tensor_parallel_size=tp)
        generate(workload.warmup_prompts, workload.warmup_output_lens)  # not timed
        if warm:
            generate(workload.prompts, workload.output_lens, "warm")  # not timed
        for index in range(passes):
            with OtherCpu([os.getsid(0)]) as others:
                cpu_start = time.process_time()
                salt = f"pass{index}"
                result = timed(
                    "LLM.generate",
                    functools.partial(generate, workload.prompts, workload.output_lens, salt),
                )
                cpu_s = time.process_time() - cpu_start
            counts = [len(t) for t in result.token_ids]
            # NOTE: at TP=2 the ranks are actors in other processes: their CPU is not counted.
            cpu = {"LLM.generate process": cpu_s}
            run = Run(
                "LLM.generate", tp, result.wall_s, sum(counts), list(texts), counts,
                others.others_s, [], cpu,
            )  # fmt: skip
            print_progress(run)
            runs.append(run)
    finally:
        if llm is not None:
            llm.shutdown()
        if tp > 1:
            ray.shutdown()
    return runs


# ---- the server ------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Server:
    """`pagedray serve` in a session of its own, with its own local Ray, logging to a file."""

    _own_tier_dir: str | None = None  # a host KV tier made for this server, removed at stop

    def __init__(
        self,
        path: str,
        threads: int | None,
        tp: int,
        log_dir: Path,
        stream_interval: int = 1,
        extra_flags: tuple[str, ...] = (),
        dtype: str = "float32",
        tier_dir: str | None = None,
    ) -> None:
        """`threads` None: the server's own default (workers/cpu_threads.py); `extra_flags` go
        to `pagedray serve` as they are; `tier_dir` holds its host KV tier. By default the
        server gets a tier of its own, removed at `stop`, unless the environment names one
        (PAGEDRAY_KV_TIER_DIR: a caller sharing a tier across its servers on purpose): the
        node's outlives a server, and one started after another would find the prompts of the
        earlier one computed (seeded workloads repeat them), which no peer's server does."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        executable = Path(sys.executable).with_name("pagedray")
        command = [
            str(executable) if executable.exists() else "pagedray",
            "serve",
            path,
            "--port",
            str(self.port),
            "--metrics-export-port",
            str(free_port()),
            "--dtype",
            dtype,
            "--tensor-parallel-size",
            str(tp),
            "--stream-interval",
            str(stream_interval),
        ]
        if threads is not None:
            command += ["--num-threads", str(threads)]
        command += extra_flags
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # never join another Ray
        if tier_dir is None and not env.get(TIER_DIR_ENV):
            shm = Path("/dev/shm")
            tier_dir = tempfile.mkdtemp(
                prefix="pagedray-bench-tier-", dir=shm if shm.is_dir() else None
            )
            self._own_tier_dir = tier_dir
        if tier_dir is not None:
            env[TIER_DIR_ENV] = tier_dir
        self.log_path = log_dir / f"serve_tp{tp}.log"
        try:
            self._log = open(self.log_path, "w")  # noqa: SIM115 - closed in stop()
            # start_new_session: the server and all it starts form a session apart from ours.
            self.proc = subprocess.Popen(
                command, stdout=self._log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        except BaseException:
            if self._own_tier_dir is not None:
                shutil.rmtree(self._own_tier_dir, ignore_errors=True)
            raise

    def wait_healthy(self, timeout_s: float) -> float:
        """Seconds until GET /health answers 200; raises if the server exits or takes too long."""
        start = time.perf_counter()
        while time.perf_counter() - start < timeout_s:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited ({self.proc.returncode}):\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=5.0).status_code == 200:
                    return time.perf_counter() - start
            except httpx.HTTPError:
                pass  # not listening yet
            time.sleep(POLL_S)
        raise RuntimeError(f"server not healthy after {timeout_s:.0f} s:\n{self.log_tail()}")

    def stop(self) -> str:
        """SIGINT to the server (a graceful Serve and Ray shutdown), then SIGTERM and SIGKILL to
        each process left in its session, each step bounded.

        Returns how it went, for the log: the last signal sent and the seconds it all took.
        """
        # NOTE: Ray's actors lead process groups of their own, but stay in the server's session,
        # so the session, not the process group, is what holds everything the server started.
        # SIGINT goes to the server alone, so that it deletes the app and stops its Ray in order.
        start, sent = time.perf_counter(), "no signal"
        for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGKILL):
            pids = [self.proc.pid] if signum == signal.SIGINT else self._session_pids()
            if not self._session_pids():
                break
            sent = f"{signum.name} to {len(pids)} process(es)"
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):  # exited meanwhile
                    os.kill(pid, signum)
            deadline = time.perf_counter() + EXIT_WAIT_S
            while time.perf_counter() < deadline and self._session_pids():
                time.sleep(0.2)
        if left := self._session_pids():
            print(f"WARNING: server processes {left} are still running")
        if self._own_tier_dir is not None:
            shutil.rmtree(self._own_tier_dir, ignore_errors=True)
        self._log.close()
        return f"{sent}, {time.perf_counter() - start:.1f} s"

    def _session_pids(self) -> list[int]:
        self.proc.poll()  # reap the server, so that it does not linger as a zombie
        return session_pids(self.proc.pid)

    def log_tail(self, num_lines: int = 30) -> str:
        self._log.flush()
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-num_lines:])


# ---- HTTP clients ----------------------------------------------------------------------------


@dataclass
class Reply:
    text: str
    completion_tokens: int
    ttft_s: float | None  # seconds from sending to the first text chunk (streaming only)


async def complete(
    client: openai.AsyncOpenAI,
    model: str,
    prompt: list[int],
    max_tokens: int,
    stream: bool,
    salt: str,
) -> Reply:
    """One /v1/completions request: greedy, EOS ignored, `max_tokens` generated."""
    # cache_salt: each pass has its own prefix-cache namespace, so none reuses another's prompts.
    kwargs: dict[str, Any] = dict(
        model=model,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0,
        extra_body={"ignore_eos": True, "cache_salt": salt},
    )
    if not stream:
        response = await client.completions.create(**kwargs)
        return Reply(response.choices[0].text, response.usage.completion_tokens, None)
    start = time.perf_counter()
    chunks = await client.completions.create(
        **kwargs, stream=True, stream_options={"include_usage": True}
    )
    parts: list[str] = []
    ttft_s, completion_tokens = None, 0
    async for chunk in chunks:
        if chunk.choices:
            # NOTE: the server sends no chunk for a token whose text is still incomplete.
            ttft_s = ttft_s if ttft_s is not None else time.perf_counter() - start
            parts.append(chunk.choices[0].text)
        if chunk.usage is not None:
            completion_tokens = chunk.usage.completion_tokens
    return Reply("".join(parts), completion_tokens, ttft_s)


async def send_all(
    url: str, workload: Workload, stream: bool, salt: str, sessions: list[int], warm: bool
) -> tuple[float, list[Reply], float, dict[str, float]]:
    """One untimed warm-up request (and with `warm` the whole workload, untimed, under another
    cache salt), then every request at once.

    Returns the wall seconds, the replies, and other processes' CPU seconds meanwhile.
    """
    client = openai.AsyncOpenAI(
        base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=3600.0
    )
    async with client:
        model = (await client.models.list()).data[0].id
        warmup = workload.warmup_prompts[0], workload.warmup_output_lens[0]
        await complete(client, model, *warmup, stream, f"{salt}-warmup")  # not timed
        if warm:
            await asyncio.gather(
                *(
                    complete(client, model, p, n, stream, f"{salt}-warm")
                    for p, n in zip(workload.prompts, workload.output_lens)
                )
            )
        with OtherCpu(sessions) as others, ServerCpu(sessions[1]) as server_cpu:
            client_cpu_start = time.process_time()
            start = time.perf_counter()
            replies = await asyncio.gather(
                *(
                    complete(client, model, p, n, stream, salt)
                    for p, n in zip(workload.prompts, workload.output_lens)
                )
            )
            wall_s = time.perf_counter() - start
            server_cpu.by_role["client"] = time.process_time() - client_cpu_start
        return wall_s, replies, others.others_s, server_cpu.by_role


def run_http(
    server: Server, workload: Workload, stream: bool, tp: int, warm: bool, index: int
) -> Run:
    """Timed pass `index` of the workload through the server, under a cache salt of its own."""
    name = "HTTP stream" if stream else "HTTP"
    sessions = [os.getsid(0), server.proc.pid]
    wall_s, replies, others_s, cpu_by_role = asyncio.run(
        send_all(server.url, workload, stream, f"{name} tp{tp} pass{index}", sessions, warm)
    )
    client_cpu_s = cpu_by_role.pop("client")
    counts = [r.completion_tokens for r in replies]
    ttft_s = [r.ttft_s for r in replies if r.ttft_s is not None]
    texts = [r.text for r in replies]
    run = Run(name, tp, wall_s, sum(counts), texts, counts, others_s, ttft_s, cpu_by_role)
    run.client_cpu_s = client_cpu_s
    return run


def run_server(
    path: str,
    workload: Workload,
    threads: int | None,
    tp: int,
    timeout_s: float,
    stream_interval: int,
    warm: bool,
    passes: int,
    serve_args: tuple[str, ...] = (),
) -> list[Run]:
    """Start a server, run the workload through it without and with streaming, alternating,
    `passes` times each (the untimed warm pass before each mode's first), stop it."""
    log_dir = Path(tempfile.mkdtemp(prefix="pagedray_http_bench_"))
    server = Server(path, threads, tp, log_dir, stream_interval, serve_args)
    try:
        startup_s = server.wait_healthy(timeout_s)
        print(f"server tp={tp} healthy after {startup_s:.0f} s at {server.url}", flush=True)
        runs = []
        for index in range(passes):
            for stream in (False, True):
                runs.append(run_http(server, workload, stream, tp, warm and index == 0, index))
                print_progress(runs[-1])
    except BaseException:
        print(f"server tp={tp} failed; its log stays at {server.log_path}", flush=True)
        raise
    finally:
        print(f"server tp={tp} stopped ({server.stop()})", flush=True)
    shutil.rmtree(log_dir, ignore_errors=True)
    return runs


# ---- report ----------------------------------------------------------------------------------


def print_progress(run: Run) -> None:
    print(
        f"{run.name} tp={run.tp}: {run.wall_s:.2f} s wall, {run.output_tok_s:.1f} output tok/s",
        flush=True,
    )


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def median_runs(runs: list[Run]) -> list[Run]:
    """Per system (name and TP), the run of median throughput over every pass of every repeat,
    in first-seen order."""
    groups: dict[tuple[str, int], list[Run]] = {}
    for run in runs:
        groups.setdefault((run.name, run.tp), []).append(run)
    medians = []
    for (name, tp), group in groups.items():
        ordered = sorted(group, key=lambda run: run.output_tok_s)
        if len(group) > 1:
            figures = ", ".join(f"{run.output_tok_s:.0f}" for run in group)
            print(f"{name} tp={tp}: output tok/s per pass {figures}")
        medians.append(ordered[(len(ordered) - 1) // 2])
    return medians


def report(workload: Workload, runs: list[Run]) -> None:
    """The table, TTFTs, and a loose check of output lengths and texts against `LLM.generate`."""
    offline = {run.tp: run for run in runs if run.name == "LLM.generate"}
    print()
    # others: other processes' CPU use over the run, as a share of all the CPUs.
    print(f"{'system':<20}{'wall s':>9}{'out tok/s':>11}{'vs LLM.generate':>17}{'others':>8}")
    for run in runs:
        base = offline.get(run.tp)
        ratio = f"{run.output_tok_s / base.output_tok_s:.2f}x" if base else "-"
        label = f"{run.name} tp={run.tp}"
        others = f"{run.others_share:.0%}"
        print(f"{label:<20}{run.wall_s:>9.2f}{run.output_tok_s:>11.1f}{ratio:>17}{others:>8}")
    for run in runs:
        if run.others_share >= CONTENDED:
            print(
                f"WARNING: {run.name} tp={run.tp} shared the CPUs with other processes "
                f"({run.others_cpu_s:.1f} CPU s of theirs): its wall time is inflated"
            )
    for run in runs:
        if run.ttft_s:
            print(
                f"{run.name} tp={run.tp}: TTFT median {statistics.median(run.ttft_s):.2f} s, "
                f"p90 {percentile(run.ttft_s, 0.9):.2f} s over {len(run.ttft_s)} requests"
            )
    print("CPU per output token (ms), by process; serving overhead = all of a server's CPU less")
    print("what LLM.generate's process spent per token on the same workload; outside the model =")
    print("all of it but the engine replica's compute thread and its OpenMP threads:")
    for run in runs:
        base = offline.get(run.tp)
        roles = ", ".join(
            f"{role} {1000 * s / max(1, run.num_output_tokens):.3f}"
            for role, s in sorted(run.cpu_by_role.items(), key=lambda item: -item[1])
        )
        line = f"  {run.name} tp={run.tp}: total {run.cpu_ms_per_token():.3f} ({roles})"
        if base is not None and run is not base and run.tp == 1:
            line += f"; serving overhead {run.cpu_ms_per_token() - base.cpu_ms_per_token():.3f}"
            outside = sum(s for role, s in run.cpu_by_role.items() if MODEL_PART not in role)
            line += f"; outside the model {1000 * outside / max(1, run.num_output_tokens):.3f}"
        if run.client_cpu_s:
            line += f"; the client {1000 * run.client_cpu_s / max(1, run.num_output_tokens):.3f}"
        print(line)
    print("correctness (loose):")
    for run in runs:
        bad = sum(c != n for c, n in zip(run.token_counts, workload.output_lens))
        verdict = "all equal the targets" if not bad else f"{bad} differ from the targets"
        line = f"  {run.name} tp={run.tp}: output token counts {verdict}"
        base = offline.get(run.tp)
        if base is not None and run is not base:
            num = min(NUM_CHECKED, len(run.texts))
            same = sum(run.texts[i] == base.texts[i] for i in range(num))
            line += f"; text of requests 0-{num - 1} same as LLM.generate: {same}/{num}"
        print(line)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="16 short requests: a smoke run")
    parser.add_argument("--num-requests", type=int, default=None, help="default 64 (16 quick)")
    parser.add_argument("--threads", type=int, default=2, help="LLM.generate's threads at TP=1")
    parser.add_argument(
        "--server-threads",
        type=int,
        default=None,
        help="the server's --num-threads (default: its own, the cores but one among its ranks)",
    )
    parser.add_argument("--tp2", action="store_true", help="also TP=2, 1 thread per rank")
    parser.add_argument("--seed", type=int, default=0, help="seeds the workload")
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="interleaved repeats of every system; the report shows each one's median run",
    )
    parser.add_argument(
        "--passes",
        type=int,
        default=3,
        help="timed passes of the workload per system and repeat (a server starts once per "
        "repeat; its passes alternate streamed and not)",
    )
    parser.add_argument(
        "--stream-interval", type=int, default=1, help="the server's --stream-interval (tokens)"
    )
    parser.add_argument(
        "--startup-timeout", type=float, default=300.0, help="seconds to wait for /health"
    )
    parser.add_argument(
        "--cold", action="store_true", help="no untimed pass of the workload before the timed one"
    )
    parser.add_argument(
        "--serve-args",
        default="",
        help="more flags for `pagedray serve`, as one string: '--max-num-batched-tokens 4096'",
    )
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    num_requests = args.num_requests or (16 if args.quick else 64)
    path, workload = benchmark_workload(num_requests, args.quick, args.seed)
    print(
        f"model {path}, {num_requests} requests, seed {args.seed}, "
        f"stream interval {args.stream_interval}"
        + (f", serve args {args.serve_args!r}" if args.serve_args else "")
    )
    print(f"prompt tokens {workload.num_prompt_tokens}, output tokens {workload.num_output_tokens}")
    runs: list[Run] = []
    for repeat in range(args.repeats):
        for tp, threads in [(1, args.threads)] + ([(2, 1)] if args.tp2 else []):
            load = " ".join(f"{x:.2f}" for x in os.getloadavg())
            print(
                f"-- repeat {repeat + 1}/{args.repeats}, tp={tp}, {threads} thread(s) per rank "
                f"offline, {args.server_threads or 'the default'} served; "
                f"load average {load}",
                flush=True,
            )
            runs.extend(run_offline(path, workload, threads, tp, not args.cold, args.passes))
            runs.extend(
                run_server(
                    path,
                    workload,
                    args.server_threads,
                    tp,
                    args.startup_timeout,
                    args.stream_interval,
                    not args.cold,
                    args.passes,
                    tuple(shlex.split(args.serve_args)),
                )  # fmt: skip
            )
    report(workload, median_runs(runs))


if __name__ == "__main__":
    main()
