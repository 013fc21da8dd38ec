"""How `pagedray serve` sets up its local Ray (`serve_runtime.py`): the lean path's environment,
the proxy's port, the readiness wait, and the dropped reconnect line. The path itself runs in
tests/deploy (test_serve_binding.py: the ingress replica listens on the API port)."""

from __future__ import annotations

import logging
from typing import Any

import httpx
import pytest

from pagedray.cli import serve_runtime
from pagedray.cli.serve_runtime import (
    QuietReconnect,
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
    serve_runtime.WORKER_NICENESS_ENV,
    serve_runtime.REQUEST_LOG_BUFFER_ENV,
    serve_runtime.FORCE_STOP_UNHEALTHY_ENV,
    serve_runtime.CONTROL_LOOP_INTERVAL_ENV,
    serve_runtime.METRICS_EXPORT_INTERVAL_ENV,
    serve_runtime.LOG_MONITOR_FILES_THRESHOLD_ENV,
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
        "RAY_worker_niceness": "0",
        "RAY_SERVE_REQUEST_PATH_LOG_BUFFER_SIZE": "1",
        "RAY_SERVE_FORCE_STOP_UNHEALTHY_REPLICAS": "1",
        "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5",
        "RAY_SERVE_METRICS_EXPORT_INTERVAL_MS": "1000",
        "RAY_LOG_MONITOR_MANY_FILES_THRESHOLD": "0",
    }


def test_several_ingress_replicas_share_the_port_through_the_proxy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    env = lean_serve_env(8000, num_ingress_replicas=3)
    assert env["RAY_SERVE_ENABLE_DIRECT_INGRESS"] == "0"
    assert "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT" not in env
    monkeypatch.setenv(serve_runtime.DIRECT_INGRESS_ENV, "0")
    assert proxy_port(8000, "127.0.0.1") == 8000  # no direct ingress: the proxy has the port


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

    wait_until_ready("http://x/health", lambda: "DEPLOYING", 10.0, get=get)


def test_a_failed_deployment_is_an_error_not_a_wait() -> None:
    def unavailable(url: str) -> _Answer:
        return _Answer(503)

    with pytest.raises(RuntimeError, match="DEPLOY_FAILED"):
        wait_until_ready("http://x/health", lambda: "DEPLOY_FAILED", 10.0, get=unavailable)
    with pytest.raises(TimeoutError):
        wait_until_ready("http://x/health", lambda: None, 0.3, get=unavailable)


def test_the_reconnect_line_is_dropped_and_nothing_else() -> None:
    quiet = QuietReconnect()

    def record(message: str) -> logging.LogRecord:
        return logging.LogRecord("ray.serve", logging.INFO, __file__, 1, message, None, None)

    assert not quiet.filter(record('Connecting to existing Serve app in namespace "serve".'))
    assert quiet.filter(record("Started Serve in namespace serve."))
