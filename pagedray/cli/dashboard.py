"""`pagedray dashboard write|push`: the Grafana dashboard to a file, or to Grafana's HTTP API.

Pushing goes through `grafana-client` (the maintained fork of `grafana-api`), as
POST /api/dashboards/db with overwrite on, so pushing again updates the dashboard in place.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from pagedray.observability.grafana_dashboard import build_dashboard, dashboard_json

TOKEN_ENV = "GRAFANA_TOKEN"


def push_dashboard(
    grafana_url: str,
    token: str,
    folder_uid: str | None = None,
    dashboard: dict[str, Any] | None = None,
    timeout_s: float = 30.0,
) -> dict[str, Any]:
    """Create or overwrite the dashboard (same uid) and return Grafana's answer.

    Args:
        grafana_url: Grafana's base URL, e.g. "http://grafana:3000" (a sub-path is kept).
        token: a service-account token (or API key) allowed to write dashboards.
        folder_uid: the folder to put it in; None keeps Grafana's default (General).
        dashboard: the dashboard model; default: `build_dashboard()`.

    Raises:
        grafana_client.client.GrafanaException: Grafana refused it or could not be reached.
    """
    from grafana_client import GrafanaApi

    payload: dict[str, Any] = {
        "dashboard": dashboard if dashboard is not None else build_dashboard(),
        "overwrite": True,
        "message": "pushed by pagedray dashboard push",
    }
    if folder_uid:
        payload["folderUid"] = folder_uid
    grafana = GrafanaApi.from_url(grafana_url, credential=token, timeout=timeout_s)
    return grafana.dashboard.update_dashboard(payload)


def add_dashboard_parser(subparsers: Any) -> None:
    """Adds `dashboard write` and `dashboard push` to a CLI's subparsers."""
    parser = subparsers.add_parser("dashboard", help="the Grafana dashboard: write or push it")
    actions = parser.add_subparsers(dest="dashboard_command", required=True)

    write = actions.add_parser("write", help="write the dashboard JSON to a file")
    write.add_argument("--out", required=True, type=Path, help="output file ('-' for stdout)")
    write.set_defaults(func=_run_write)

    push = actions.add_parser("push", help="upload the dashboard through Grafana's HTTP API")
    push.add_argument("--grafana-url", required=True, help="e.g. http://127.0.0.1:3000")
    push.add_argument(
        "--token",
        default=os.environ.get(TOKEN_ENV),
        help=f"service-account token (default: ${TOKEN_ENV}, which keeps it out of `ps`)",
    )
    push.add_argument("--folder", default=None, help="folder UID (default: General)")
    push.add_argument("--timeout", type=float, default=30.0, help="seconds per HTTP call")
    push.set_defaults(func=_run_push)


def _run_write(args: argparse.Namespace) -> int:
    text = dashboard_json()
    if str(args.out) == "-":
        sys.stdout.write(text)
        return 0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(args.out)
    return 0


def _run_push(args: argparse.Namespace) -> int:
    if not args.token:
        print(f"error: --token (or ${TOKEN_ENV}) is required", file=sys.stderr)
        return 2
    try:
        from grafana_client.client import GrafanaException
    except ImportError:
        print("error: `dashboard push` needs `pip install grafana-client`", file=sys.stderr)
        return 2

    try:
        answer = push_dashboard(args.grafana_url, args.token, args.folder, timeout_s=args.timeout)
    except GrafanaException as error:
        detail = error.response.get("message") if isinstance(error.response, dict) else None
        status = f"HTTP {error.status_code}" if error.status_code else "no answer"
        message = f"error: Grafana refused the dashboard ({status}): {detail or error}"
        print(message, file=sys.stderr)
        return 1
    except OSError as error:  # connection refused, DNS, TLS
        print(f"error: cannot reach {args.grafana_url}: {error}", file=sys.stderr)
        return 1
    print(json.dumps(answer))
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m pagedray.cli.dashboard write|push ...`, without the rest of the CLI."""
    parser = argparse.ArgumentParser(prog="pagedray", description=__doc__)
    add_dashboard_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["dashboard", *(sys.argv[1:] if argv is None else argv)])
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
