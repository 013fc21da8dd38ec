"""How `pagedray serve` sets up its local Ray (`serve_runtime.py`): the lean path's environment,
the proxy's port, the readiness wait, and the dropped reconnect line. The path itself runs in
tests/deploy (test_serve_api_port.py: the ingress replica listens on the API port)."""

from __future__ import annotations

import logging
from typing import Any

import httpx
import pytest
from ray.serve.schema import (
    ApplicationStatus,
    ApplicationStatusOverview,
    DeploymentStatus,
    DeploymentStatusOverview,
    DeploymentStatusTrigger,
    ServeStatus,
)

from pagedray.cli import serve_runtime
from pagedray.cli.serve_runtime import (
    AppState,
    QuietReconnect,
    StartupFailed,
    app_state,
    lean_serve_env,
    proxy_port,
    wait_until_ready,
)

LEAN_VARS = (
    serve_runtime.THROUGHPUT_ENV,
    serve_runtime.DIRECT_INGRESS_ENV,
    serve_runtime.DIRECT_INGRESS_MIN_PORT_ENV,
    serve_runtime.DIRECT_INGRESS_MAX_PORT_ENV,
    serve_runtime.DIRECT_INGRESS_DRAIN_ENV,
    serve_runtime.PORT_QUARANTINE_ENV,
    serve_runtime.WORKER_NICENESS_ENV,
    serve_runtime.REQUEST_LOG_BUFFER_ENV,
    serve_runtime.FORCE_STOP_UNHEALTHY_ENV,
    serve_runtime.CONTROL_LOOP_INTERVAL_ENV,
    serve_runtime.METRICS_EXPORT_INTERVAL_ENV,
    serve_runtime.LOG_MONITOR_FILES_THRESHOLD_ENV,
    serve_runtime.SHARED_API_PORT_ENV,
)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in LEAN_VARS:
        monkeypatch.delenv(name, raising=False)


def test_one_ingress_replica_takes_the_api_port_itself() -> None:
    env = lean_serve_env(8000, num_ingress_replicas=1)
    assert env == {
        "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1",
        "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": "8000",
        "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": "8001",
        "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "0",
        "RAY_SERVE_PORT_QUARANTINE_S": "0",
        "PAGEDRAY_SHARED_API_PORT": "0",
        "RAY_worker_niceness": "0",
        "RAY_SERVE_REQUEST_PATH_LOG_BUFFER_SIZE": "1",
        "RAY_SERVE_FORCE_STOP_UNHEALTHY_REPLICAS": "1",
        "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5",
        "RAY_SERVE_METRICS_EXPORT_INTERVAL_MS": "1000",
        "RAY_LOG_MONITOR_MANY_FILES_THRESHOLD": "0",
    }


def test_several_ingress_replicas_all_take_the_api_port() -> None:
    """Each listens on it (cluster/shared_api_port.py): none of them, and no proxy, is the
    API's single point of failure."""
    env = lean_serve_env(8000, num_ingress_replicas=3)
    assert "RAY_SERVE_ENABLE_DIRECT_INGRESS" not in env  # on, with Serve's throughput mode
    assert env["RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT"] == "8000"
    assert env["RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT"] == "8001"
    assert env["PAGEDRAY_SHARED_API_PORT"] == "1"
    assert env["RAY_SERVE_PORT_QUARANTINE_S"] == "0"


def test_the_ports_are_always_this_servers(monkeypatch: pytest.MonkeyPatch) -> None:
    """A port left in the environment (an earlier server in the same process) never wins."""
    monkeypatch.setenv(serve_runtime.DIRECT_INGRESS_MIN_PORT_ENV, "9000")
    env = lean_serve_env(8000, num_ingress_replicas=1)
    assert env["RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT"] == "8000"


def test_the_users_settings_win(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(serve_runtime.THROUGHPUT_ENV, "0")
    forced = {
        "RAY_SERVE_FORCE_STOP_UNHEALTHY_REPLICAS": "1",
        "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5",
        "RAY_SERVE_METRICS_EXPORT_INTERVAL_MS": "1000",
        "RAY_LOG_MONITOR_MANY_FILES_THRESHOLD": "0",
    }
    assert lean_serve_env(8000, 1) == {"RAY_worker_niceness": "0", **forced}
    monkeypatch.setenv(serve_runtime.WORKER_NICENESS_ENV, "5")
    monkeypatch.setenv(serve_runtime.FORCE_STOP_UNHEALTHY_ENV, "0")
    monkeypatch.setenv(serve_runtime.CONTROL_LOOP_INTERVAL_ENV, "0.1")
    monkeypatch.setenv(serve_runtime.METRICS_EXPORT_INTERVAL_ENV, "100")
    monkeypatch.setenv(serve_runtime.LOG_MONITOR_FILES_THRESHOLD_ENV, "1000")
    assert lean_serve_env(8000, 1) == {}


def test_with_direct_ingress_the_proxy_moves_to_a_free_port(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(serve_runtime.THROUGHPUT_ENV, "1")
    port = proxy_port(8000, "0.0.0.0")
    assert port != 8000 and port > 0


class _Answer:
    def __init__(self, status_code: int) -> None:
        self.status_code = status_code


def test_ready_when_health_answers_200() -> None:
    answers = iter([httpx.ConnectError("not yet"), _Answer(503), _Answer(200)])

    def get(url: str) -> Any:
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer

    wait_until_ready("http://x/health", lambda: AppState("DEPLOYING"), 10.0, get=get)


def _unavailable(url: str) -> _Answer:
    return _Answer(503)


def test_a_failed_deployment_is_an_error_not_a_wait() -> None:
    with pytest.raises(StartupFailed, match="DEPLOY_FAILED"):
        failed = AppState("DEPLOY_FAILED")
        wait_until_ready("http://x/health", lambda: failed, 10.0, get=_unavailable)
    with pytest.raises(TimeoutError):
        wait_until_ready("http://x/health", lambda: AppState(None), 0.3, get=_unavailable)


# What Serve 2.60's controller reports of a replica whose start raised, then of the deployment
# once it gave up (deployment_state.py), quoting the replica's traceback.
_TRACEBACK = (
    "ray::ServeReplica:pagedray:OpenAIIngress.initialize_and_get_metadata() (pid=7, ip=10.0.0.1)"
    '\n  File "replica.py", line 2327, in allocate_and_start_server\n    port = await ...'
    "\nray.serve._private.node_port_manager.NoAvailablePortError: No available ports on node "
    "abc for HTTP protocol.\n"
)
RETRYING = (
    f"A replica failed to start with exception. Retrying 2 more time(s). Error:\n{_TRACEBACK}"
)
GAVE_UP = (
    "The deployment failed to start 3 times in a row. This may be due to a problem with its "
    f"constructor or initial health check failing. See controller logs for details. Error:\n"
    f"{_TRACEBACK}"
)
CAUSE = "NoAvailablePortError: No available ports on node abc for HTTP protocol."


def _serve_status(app_status: str, deployment_status: str, message: str) -> ServeStatus:
    """`serve.status()`'s answer for one application of an ingress and an engine deployment."""

    def deployment(status: str, message: str) -> DeploymentStatusOverview:
        trigger = DeploymentStatusTrigger.CONFIG_UPDATE_STARTED
        return DeploymentStatusOverview(DeploymentStatus(status), trigger, {}, message)

    deployments = {
        "PagedRayEngine": deployment("HEALTHY", ""),
        "OpenAIIngress": deployment(deployment_status, message),
    }
    app = ApplicationStatusOverview(ApplicationStatus(app_status), "", 0.0, deployments)
    return ServeStatus(applications={"pagedray": app})


def test_serves_failure_messages_become_one_line() -> None:
    assert app_state(ServeStatus(), "pagedray") == AppState(None)
    starting = app_state(_serve_status("DEPLOYING", "UPDATING", ""), "pagedray")
    assert starting == AppState("DEPLOYING")
    retrying = app_state(_serve_status("DEPLOYING", "UPDATING", RETRYING), "pagedray")
    assert retrying.problem == f"OpenAIIngress: A replica failed to start with exception: {CAUSE}"
    failed = app_state(_serve_status("DEPLOY_FAILED", "DEPLOY_FAILED", GAVE_UP), "pagedray")
    assert failed.status == "DEPLOY_FAILED"
    gave_up = "The deployment failed to start 3 times in a row"
    assert failed.problem == f"OpenAIIngress: {gave_up}: {CAUSE}"


def test_a_replica_that_fails_to_start_is_said_at_once_and_its_cause_ends_the_wait() -> None:
    """Serve retries a replica that failed to start a few times before it gives the application
    up: the cause is printed at its first failure, and ends the wait at the last."""
    states = iter(
        [
            AppState("DEPLOYING"),
            AppState("DEPLOYING", "OpenAIIngress: failed: X"),
            AppState("DEPLOYING", "OpenAIIngress: failed: X"),
            AppState("DEPLOY_FAILED", "OpenAIIngress: gave up: X"),
        ]
    )
    reports: list[str] = []
    with pytest.raises(StartupFailed, match="^OpenAIIngress: gave up: X$"):
        wait_until_ready(
            "http://x/health", lambda: next(states), 10.0, get=_unavailable, report=reports.append
        )
    assert reports == ["pagedray: OpenAIIngress: failed: X (Serve retries)"]


def test_the_reconnect_line_is_dropped_and_nothing_else() -> None:
    quiet = QuietReconnect()

    def record(message: str) -> logging.LogRecord:
        return logging.LogRecord("ray.serve", logging.INFO, __file__, 1, message, None, None)

    assert not quiet.filter(record('Connecting to existing Serve app in namespace "serve".'))
    assert quiet.filter(record("Started Serve in namespace serve."))
