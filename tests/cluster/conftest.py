"""Fixtures shared by the HTTP tests: one Serve instance per module, on a free port."""

from __future__ import annotations

import socket
from typing import Any, Iterator

import pytest


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def serve_url(ray_cluster: Any) -> Iterator[str]:
    """Serve's HTTP address; each test module deploys its apps under their own route prefix."""
    from ray import serve
    from ray.serve.context import _get_global_client

    serve.start(http_options={"host": "127.0.0.1", "port": _free_port()})
    # NOTE: a Serve already running in this Ray session keeps its own port.
    port = _get_global_client().http_config.port
    yield f"http://127.0.0.1:{port}"
