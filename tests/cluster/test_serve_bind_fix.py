"""The ingress replica's direct-ingress server listens on a port whose last connection is still
in TIME_WAIT (a restart soon after a stop), and still not on one another socket listens on:
`serve_bind_fix.py`, through Serve's own server start; and `pagedray serve` refuses such a port
up front, in a line, before it starts Ray. The restart itself: tests/deploy/test_serve_restart.py.
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import ray.serve._private.http_util as serve_http_util
import ray.serve._private.replica as serve_replica
from ray.serve.config import HTTPOptions

from pagedray.cli import serve as serve_cli
from pagedray.cluster.serve_bind_fix import install_serve_bind_fix

# For the CLI to import and refuse (it starts nothing before), on a loaded 2-core machine.
REFUSAL_TIMEOUT_S = 60


def _port_in_time_wait() -> int:
    """A port whose listener is gone and whose one connection the server side closed first, as
    a stopping server closes a client's idle keep-alive connection: it lingers in TIME_WAIT.

    NOTE: Linux lets a new socket bind through TIME_WAIT only when both it and the socket that
    left it had SO_REUSEADDR: the listener has it here, as the fixed replica's had."""
    with socket.socket() as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        client = socket.create_connection(("127.0.0.1", port))
        conn, _ = listener.accept()
        conn.close()
        assert client.recv(1) == b""  # the server's FIN
        client.close()
    return port


async def _app(scope: Any, receive: Any, send: Any) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


async def _serve_once(port: int) -> None:
    """Start Serve's direct-ingress server on `port` as the replica does, then stop it."""
    start = serve_replica.start_asgi_http_server
    options = HTTPOptions(host="127.0.0.1", port=port)
    task, server = await start(_app, options, event_loop=asyncio.get_running_loop())
    while not server.started:
        await asyncio.sleep(0.01)
    server.should_exit = True
    await task


def test_a_port_in_time_wait_binds_and_a_listened_one_does_not(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    start = serve_replica.start_asgi_http_server
    monkeypatch.setattr(
        serve_replica, "start_asgi_http_server", getattr(start, "__wrapped__", start)
    )
    # NOTE: the upstream bug itself; once the pinned Ray sets SO_REUSEADDR, this fix can go.
    with pytest.raises(RuntimeError, match="Failed to bind") as refused:
        asyncio.run(_serve_once(_port_in_time_wait()))
    assert isinstance(refused.value.__cause__, OSError)

    install_serve_bind_fix()
    fixed = serve_replica.start_asgi_http_server
    install_serve_bind_fix()  # once per process, whatever calls it again
    assert serve_replica.start_asgi_http_server is fixed
    asyncio.run(_serve_once(_port_in_time_wait()))
    assert serve_http_util.socket is socket  # nothing left substituted
    with socket.socket() as other_server:  # SO_REUSEADDR, not SO_REUSEPORT: no sharing
        other_server.bind(("127.0.0.1", 0))
        other_server.listen()
        with pytest.raises(RuntimeError, match="Failed to bind"):
            asyncio.run(_serve_once(other_server.getsockname()[1]))


def test_pagedray_serve_refuses_a_listened_port_up_front(tiny_llama: str, tmp_path: Path) -> None:
    serve_cli._check_port_free(_port_in_time_wait(), "--port", "127.0.0.1")  # as free as any
    pagedray = str(Path(sys.executable).with_name("pagedray"))
    with socket.socket() as other_server:
        other_server.bind(("127.0.0.1", 0))
        other_server.listen()
        port = other_server.getsockname()[1]
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            metrics_port = probe.getsockname()[1]
        command = [pagedray, "serve", tiny_llama, "--port", str(port)]
        command += ["--metrics-export-port", str(metrics_port)]
        env = {**os.environ, "RAY_TMPDIR": str(tmp_path)}  # were a Ray started, it would be here
        result = subprocess.run(
            command, capture_output=True, text=True, timeout=REFUSAL_TIMEOUT_S, env=env
        )
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr == f"pagedray: --port {port} is not free (Address already in use)\n"
