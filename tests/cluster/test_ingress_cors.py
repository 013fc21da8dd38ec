"""CORS on the ingress's own middleware stack (cluster/ingress_deployment.py's `app`, its
replica stood in for): a browser's preflight is answered without the API key and never reaches
the metrics middleware (it is no request of a route); every other answer carries the
allow-origin header, a refusal by the guard included. Through Ray Serve over HTTP:
tests/cluster/test_openai_server.py.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from fastapi.testclient import TestClient
from starlette.types import Receive, Scope, Send

from pagedray.cluster import ingress_deployment
from pagedray.openai.cors import CORSSettings
from pagedray.openai.ingress_guard import GuardSettings, api_key_digest
from pagedray.openai.serving import HTTPMetricsMiddleware

ORIGIN = "https://app.example"
KEY = "sk-cors"
PREFLIGHT = {
    "Origin": ORIGIN,
    "Access-Control-Request-Method": "POST",
    "Access-Control-Request-Headers": "authorization, content-type",
}


def _client(monkeypatch: pytest.MonkeyPatch, cors: CORSSettings) -> tuple[TestClient, list[str]]:
    """A client of the app as a replica with `cors` and an API key runs it, and the paths of
    the requests that reached the metrics middleware."""
    config = SimpleNamespace(enable_request_id_headers=False)  # what the middleware reads
    server = SimpleNamespace(guard=GuardSettings(api_key_digest(KEY)), cors=cors, config=config)
    replica = SimpleNamespace(server=server, metrics=SimpleNamespace(record=lambda *_: None))
    monkeypatch.setattr(ingress_deployment, "_replica", lambda: replica)
    measured: list[str] = []
    measure = HTTPMetricsMiddleware.__call__

    async def seen(self: Any, scope: Scope, receive: Receive, send: Send) -> None:
        measured.append(scope["path"])
        await measure(self, scope, receive, send)

    monkeypatch.setattr(HTTPMetricsMiddleware, "__call__", seen)
    # A fresh middleware stack (and CORS middleware) for this replica; the app's is restored.
    monkeypatch.setattr(ingress_deployment.app, "middleware_stack", None)
    return TestClient(ingress_deployment.app), measured


def test_preflight_needs_no_key_and_counts_for_no_route(monkeypatch: pytest.MonkeyPatch) -> None:
    client, measured = _client(monkeypatch, CORSSettings())  # vLLM's defaults
    response = client.options("/v1/chat/completions", headers=PREFLIGHT)
    assert response.status_code == 200, response.text
    assert response.headers["access-control-allow-origin"] == "*"
    assert "POST" in response.headers["access-control-allow-methods"]
    assert "authorization" in response.headers["access-control-allow-headers"].lower()
    assert measured == []
    refused = client.get("/v1/models", headers={"Origin": ORIGIN})  # no key: the guard's 401
    assert refused.status_code == 401
    assert refused.headers["access-control-allow-origin"] == "*"  # the browser may read why
    assert measured == ["/v1/models"]


def test_the_replicas_settings_apply(monkeypatch: pytest.MonkeyPatch) -> None:
    cors = CORSSettings(allowed_origins=(ORIGIN,), allow_credentials=True)
    client, _ = _client(monkeypatch, cors)
    allowed = client.options("/v1/completions", headers=PREFLIGHT)
    assert allowed.status_code == 200
    assert allowed.headers["access-control-allow-origin"] == ORIGIN
    assert allowed.headers["access-control-allow-credentials"] == "true"
    other = client.options("/v1/completions", headers={**PREFLIGHT, "Origin": "https://evil"})
    assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
