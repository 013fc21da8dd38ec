"""`pagedray dashboard push|write`: a real HTTP round trip through grafana-client to a tiny
Grafana stand-in on 127.0.0.1 that records what it receives."""

from __future__ import annotations

import argparse
import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from pagedray.cli.dashboard import add_dashboard_parser, main
from pagedray.observability.grafana_dashboard import build_dashboard, dashboard_json

TOKEN = "glsa_test_token"


@dataclass
class FakeGrafana:
    """Answers POST /api/dashboards/db like Grafana; 401 unless the bearer token matches."""

    url: str
    requests: list[dict[str, Any]] = field(default_factory=list)


def _handler(grafana: FakeGrafana) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self) -> None:  # noqa: N802 - http.server's naming
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            grafana.requests.append(
                {"path": self.path, "headers": dict(self.headers), "body": json.loads(body)}
            )
            if self.headers.get("Authorization") != f"Bearer {TOKEN}":
                self._reply(401, {"message": "invalid API key"})
            elif self.path != "/api/dashboards/db":
                self._reply(404, {"message": "not found"})
            else:
                uid = json.loads(body)["dashboard"]["uid"]
                answer = {
                    "id": 7,
                    "uid": uid,
                    "url": f"/d/{uid}/pagedray",
                    "status": "success",
                    "version": 1,
                    "slug": "pagedray",
                }
                self._reply(200, answer)

        def _reply(self, status: int, payload: dict[str, Any]) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: Any) -> None:  # keep the test output quiet
            pass

    return Handler


@pytest.fixture
def grafana() -> Iterator[FakeGrafana]:
    fake = FakeGrafana(url="")
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(fake))
    fake.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield fake
    server.shutdown()
    server.server_close()
    thread.join(timeout=5)


def test_push_uploads_the_dashboard(
    grafana: FakeGrafana, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["push", "--grafana-url", grafana.url, "--token", TOKEN, "--folder", "llm"])
    assert code == 0
    (request,) = grafana.requests
    assert request["path"] == "/api/dashboards/db"
    assert request["headers"]["Authorization"] == f"Bearer {TOKEN}"
    body = request["body"]
    assert body["dashboard"] == build_dashboard()
    assert body["overwrite"] is True
    assert body["folderUid"] == "llm"
    assert json.loads(capsys.readouterr().out)["status"] == "success"


def test_push_without_folder_and_with_token_from_environment(
    grafana: FakeGrafana, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GRAFANA_TOKEN", TOKEN)
    assert main(["push", "--grafana-url", grafana.url + "/"]) == 0
    (request,) = grafana.requests
    assert "folderUid" not in request["body"]


def test_push_through_a_cli_parser(grafana: FakeGrafana) -> None:
    """As the `pagedray` CLI wires it: add_dashboard_parser on its subparsers."""
    parser = argparse.ArgumentParser(prog="pagedray")
    add_dashboard_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["dashboard", "push", "--grafana-url", grafana.url, "--token", TOKEN])
    assert args.func(args) == 0
    assert len(grafana.requests) == 1


def test_push_reports_a_refused_token(
    grafana: FakeGrafana, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["push", "--grafana-url", grafana.url, "--token", "wrong"]) == 1
    assert "invalid API key" in capsys.readouterr().err
    assert len(grafana.requests) == 1


def test_push_needs_a_token(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("GRAFANA_TOKEN", raising=False)
    assert main(["push", "--grafana-url", "http://127.0.0.1:9"]) == 2
    assert "--token" in capsys.readouterr().err


def test_write(tmp_path: Path) -> None:
    out = tmp_path / "dashboards" / "pagedray.json"
    assert main(["write", "--out", str(out)]) == 0
    assert out.read_text() == dashboard_json()


def test_pagedray_cli_dashboard_command(grafana: FakeGrafana) -> None:
    from pagedray.cli import main as cli

    try:
        code = cli.main(["dashboard", "push", "--grafana-url", grafana.url, "--token", TOKEN])
    except SystemExit:  # argparse: "invalid choice: 'dashboard'"
        pytest.skip("pagedray/cli/main.py does not add `dashboard` yet (add_dashboard_parser)")
    assert code == 0
    assert len(grafana.requests) == 1
