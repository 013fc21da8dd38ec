"""How `pagedray serve` runs Ray Serve on its own local Ray: the lean request path, and when the
API counts as ready.

The lean path is Ray Serve's own throughput mode (`RAY_SERVE_THROUGHPUT_OPTIMIZED`, Ray's
"performance tuning" guide): replicas run user code on their main event loop, handles speak gRPC,
access logs are buffered; and direct ingress, where the ingress replica itself listens on the API
port, so a request crosses no proxy: HTTP → ingress replica → engine replica. Serve still starts
its proxy, which answers on a free port of its own; nothing needs it. These are process
environment variables, read when Ray's modules load in each Serve process, so they are set before
the local Ray starts (its processes inherit them). A Ray cluster joined with `--address` keeps the
settings it was started with. Ray's workers run at nice 0 instead of 15, since the model's
threads run in them; Serve's controller reconciles every 0.5 s instead of 0.1, and its replicas
and handles pass their cached request metrics on every 1 s instead of 0.1; Ray's log monitor
looks for new log files every 0.5 s instead of 0.1.

Direct ingress gives each ingress replica a port of its own, for a balancer in front; none is in
front of a local server, so its ingress replicas (`--num-ingress-replicas`) all listen on the
API port, which the kernel shares among them (cluster/shared_api_port.py).

A start that cannot succeed says why at once: a replica's failure to start is printed as Serve
reports it (Serve retries it a few times), and once Serve gives the application up, that cause
ends the wait, in a line; the traceback stays in the Serve logs.
"""

from __future__ import annotations

import logging
import os
import re
import socket
import time
from dataclasses import dataclass
from typing import Any, Callable

from pagedray.cli.console import replica_progress
from pagedray.cluster.shared_api_port import SHARED_API_PORT_ENV

THROUGHPUT_ENV = "RAY_SERVE_THROUGHPUT_OPTIMIZED"
DIRECT_INGRESS_ENV = "RAY_SERVE_ENABLE_DIRECT_INGRESS"
DIRECT_INGRESS_MIN_PORT_ENV = "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT"
DIRECT_INGRESS_MAX_PORT_ENV = "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT"
DIRECT_INGRESS_DRAIN_ENV = "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S"
WORKER_NICENESS_ENV = "RAY_worker_niceness"
REQUEST_LOG_BUFFER_ENV = "RAY_SERVE_REQUEST_PATH_LOG_BUFFER_SIZE"
FORCE_STOP_UNHEALTHY_ENV = "RAY_SERVE_FORCE_STOP_UNHEALTHY_REPLICAS"
CONTROL_LOOP_INTERVAL_ENV = "RAY_SERVE_CONTROL_LOOP_INTERVAL_S"
METRICS_EXPORT_INTERVAL_ENV = "RAY_SERVE_METRICS_EXPORT_INTERVAL_MS"
LOG_MONITOR_FILES_THRESHOLD_ENV = "RAY_LOG_MONITOR_MANY_FILES_THRESHOLD"
PORT_QUARANTINE_ENV = "RAY_SERVE_PORT_QUARANTINE_S"
# Seconds between readiness polls while the app starts.
READY_POLL_S = 0.1
# Serve's statuses of an application, or a deployment, that will not serve without a redeploy.
FAILED_STATUSES = ("DEPLOY_FAILED", "UNHEALTHY")
# The line a Python traceback ends with: the exception's (dotted) type and message.
_EXCEPTION_LINE = re.compile(r"(?:\w+\.)*(\w+(?:Error|Exception|Exit)):\s*(.*)")
MAX_CAUSE_CHARS = 300


def lean_serve_env(api_port: int, num_ingress_replicas: int) -> dict[str, str]:
    """The environment a local Ray needs for the lean path. A mode variable already set is kept
    (a user's `RAY_SERVE_THROUGHPUT_OPTIMIZED=0` turns Serve's mode and direct ingress off);
    the ports are always this server's, never ones left in the environment by another."""
    # NOTE: Ray starts its workers at nice 15 (below its own daemons). The engine replica runs
    # the model's OpenMP team there: any nice-0 process on the machine (a client, the raylet)
    # then preempts one of its threads, and the whole team stalls at the next barrier. At nice 0
    # the model keeps its share (+25% non-streamed throughput on 2 cores).
    env = {WORKER_NICENESS_ENV: "0"}
    # NOTE: an engine replica drains for up to its requests' deadline when it is removed; one
    # that failed its health check (a dead rank, a stuck step) has nothing left to finish, and
    # would hold its placement group, so its replacement could not start: stop it at once.
    env[FORCE_STOP_UNHEALTHY_ENV] = "1"
    # NOTE: Serve's controller reconciles every 0.1 s, each time asking the GCS for the nodes'
    # resources: 3.3-3.6% of a core on an idle 2-core server, 1.5-1.7% at 0.5 s, taken from the
    # model. A replica's start (seconds) or a health check's period (10 s) dwarfs the 0.4 s.
    env[CONTROL_LOOP_INTERVAL_ENV] = "0.5"
    # NOTE: each replica, and each handle's router, hands the request metrics it cached to
    # Ray's metric API every 0.1 s: on an idle 2-core server the replicas and the proxy took
    # 5.5% of a core at 0.1 s, 3.8% at 1 s (the whole server 13.8%, 11.3%). Ray exports them
    # to Prometheus every 10 s, so the series do not change.
    env[METRICS_EXPORT_INTERVAL_ENV] = "1000"
    # NOTE: Ray's log monitor globs the logs folder for new files every 0.1 s while it holds
    # fewer than this many files, else every 0.5 s: 0.93% of a core on an idle 2-core server,
    # 0.43-0.47% at 0.5 s (two runs each). A new worker's log lines reach the console 0.4 s
    # later at most; lines of files it already follows still go every 0.1 s.
    env[LOG_MONITOR_FILES_THRESHOLD_ENV] = "0"
    if os.environ.get(THROUGHPUT_ENV, "1") == "0":
        return {key: value for key, value in env.items() if key not in os.environ}
    env[THROUGHPUT_ENV] = "1"
    ports: dict[str, str] = {}
    # NOTE: the mode buffers 1,000 access lines per replica, and a replica that stops loses
    # what is buffered: one line per request is cheap enough to write at once.
    env[REQUEST_LOG_BUFFER_ENV] = "1"
    # NOTE: the controller hands ingress replicas ports from [min, max): one port, the API's.
    ports[DIRECT_INGRESS_MIN_PORT_ENV] = str(api_port)
    ports[DIRECT_INGRESS_MAX_PORT_ENV] = str(api_port + 1)
    # Serve keeps a stopping ingress replica listening 30 s so that a load balancer in front
    # notices; none is in front of a local server, so it stops at once (as the proxy did).
    env[DIRECT_INGRESS_DRAIN_ENV] = "0"
    # NOTE: Serve holds a released replica port out of its pool for 150 s, so that an HAProxy
    # in front drops its stale slot first; none is in front here, and with a one-port range a
    # dead ingress replica's replacement could not listen for 150 s (the API down).
    env[PORT_QUARANTINE_ENV] = "0"
    # More than one: all of them on the API port (cluster/shared_api_port.py).
    ports[SHARED_API_PORT_ENV] = "1" if num_ingress_replicas > 1 else "0"
    return {**{key: value for key, value in env.items() if key not in os.environ}, **ports}


def uses_direct_ingress() -> bool:
    """Whether this process's environment asks Serve for direct ingress."""
    if DIRECT_INGRESS_ENV in os.environ:
        return os.environ[DIRECT_INGRESS_ENV] == "1"
    return os.environ.get(THROUGHPUT_ENV) == "1"


def proxy_port(api_port: int, host: str) -> int:
    """Where Serve's proxy listens: the API port itself, unless the ingress replica takes it."""
    if not uses_direct_ingress():
        return api_port
    with socket.socket() as sock:
        sock.bind((host if host not in ("", "0.0.0.0", "::") else "127.0.0.1", 0))
        return sock.getsockname()[1]


class QuietReconnect(logging.Filter):
    """Drops Serve's "Connecting to existing Serve app" line: `pagedray serve` starts Serve
    itself (to give it the HTTP options) and then deploys to it, which is no reconnection."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Connecting to existing Serve app" not in record.getMessage()


class StartupFailed(RuntimeError):
    """The application cannot start; the message says why, in a line."""


@dataclass(frozen=True)
class AppState:
    """The application as `serve.status()` shows it while it starts."""

    status: str | None  # Serve's ApplicationStatus value; None: not deployed yet
    problem: str | None = None  # why a replica failed to start (or the app failed), in a line
    progress: str | None = None  # the replicas running of each deployment, in a line


def app_state(serve_status: Any, app_name: str) -> AppState:
    """`app_name`'s status in `serve.status()`'s answer, and the first problem its deployments
    report: a replica that failed to start (Serve retries it), or a failed deployment."""
    app = serve_status.applications.get(app_name)
    if app is None:
        return AppState(None)
    status = _value(app.status)
    progress = replica_progress(app.deployments)
    for name, deployment in app.deployments.items():
        message = deployment.message or ""
        if _value(deployment.status) in FAILED_STATUSES or "failed to start" in message:
            problem = f"{name}: {_summary(message)}" if message else None
            return AppState(status, problem, progress)
    return AppState(status, _summary(app.message) if app.message else None, progress)


def _value(status: Any) -> str:
    # NOTE: Serve's statuses are `str` enums, whose str() is "ApplicationStatus.DEPLOY_FAILED".
    return str(getattr(status, "value", status))


def _summary(message: str) -> str:
    """A Serve status message as one line: its first sentence, and the exception that ends the
    traceback it quotes (after "Error:\n", or its first line) as `Type: message`, without the
    type's module."""
    head, quoted, error = message.partition("Error:\n")
    if not quoted:
        head, _, error = message.partition("\n")
    lines = [line.strip() for line in error.splitlines() if line.strip()]
    for idx in range(len(lines) - 1, -1, -1):
        match = _EXCEPTION_LINE.fullmatch(lines[idx])
        if match is not None:
            name, text = match.groups()
            text = text or " ".join(lines[idx + 1 : idx + 2])  # a message on the next line
            head = head.split(". ")[0].strip().rstrip(".:")
            return f"{head}: {name}: {text}"[:MAX_CAUSE_CHARS]
    return " ".join(message.split())[:MAX_CAUSE_CHARS]


def _print_now(line: str) -> None:
    print(line, flush=True)


def wait_until_ready(
    health_url: str,
    state_of: Callable[[], AppState],
    timeout_s: float,
    get: Callable[[str], Any] | None = None,
    report: Callable[[str], None] = _print_now,
) -> None:
    """Return once `health_url` answers 200 (every engine can serve). `report` how many replicas
    run whenever that changes, and each new problem Serve shows while it retries; raise
    StartupFailed, with its cause, once the application's status is a failure, and TimeoutError
    after `timeout_s`."""
    import httpx

    get = get or (lambda url: httpx.get(url, timeout=2.0))
    deadline = time.monotonic() + timeout_s
    reported = progress = None

    def report_progress(state: AppState) -> None:
        nonlocal progress
        if state.progress is not None and state.progress != progress:
            report(f"pagedray: {state.progress}")
            progress = state.progress

    while time.monotonic() < deadline:
        try:
            if get(health_url).status_code == 200:
                report_progress(state_of())  # where it ended: every replica running
                return
        except httpx.HTTPError:
            pass  # not listening yet
        state = state_of()
        report_progress(state)
        if state.status in FAILED_STATUSES:
            raise StartupFailed(state.problem or f"the Serve application is {state.status}")
        if state.problem is not None and state.problem != reported:
            report(f"pagedray: {state.problem} (Serve retries)")
            reported = state.problem
        time.sleep(READY_POLL_S)
    cause = f"; last problem: {reported}" if reported else ""
    raise TimeoutError(f"the API was not ready within {timeout_s:.0f} s{cause}")
