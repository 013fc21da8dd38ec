"""`pagedray serve`: the OpenAI-compatible server on a local Ray, or on a running Ray cluster.

Kept apart from `cli.py` so offline use never imports Ray Serve.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import threading
import typing
from pathlib import Path
from typing import Any

APP_NAME = "pagedray"
# As deploy/ (`ray start --metrics-export-port=8080`), so deploy/prometheus/ scrapes either.
DEFAULT_METRICS_EXPORT_PORT = 8080


def add_serve_parser(commands: Any) -> None:
    """Register the `serve` subcommand (called by `cli.main`)."""
    from pagedray.cluster.cli import add_engine_args
    from pagedray.cluster.config import EngineConfig

    dispatch = EngineConfig.model_fields["dispatch"]

    parser = commands.add_parser("serve", help="serve the OpenAI API over HTTP with Ray Serve")
    add_engine_args(parser)
    parser.add_argument("--served-model-name", default=None, help="default: the model dir name")
    parser.add_argument("--num-replicas", type=int, default=1, help="engines (each a TP group)")
    parser.add_argument("--min-replicas", type=int, default=None, help="autoscale from this")
    parser.add_argument("--max-replicas", type=int, default=None, help="autoscale up to this")
    parser.add_argument(
        "--max-num-waiting",
        type=int,
        default=None,
        help="waiting requests beyond which new ones get 503 (default: 2 x max-num-seqs, "
        "at most the KV blocks)",
    )
    parser.add_argument(
        "--request-timeout",
        type=float,
        default=None,
        help="seconds a request may take before it is aborted with 504 (default 600; 0: none)",
    )
    parser.add_argument("--num-threads", type=int, default=None, help="torch threads per rank")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument(
        "--dispatch",
        default=dispatch.default,
        choices=list(typing.get_args(dispatch.annotation)),
        help="how each step reaches the worker actors",
    )
    parser.add_argument(
        "--stream-interval",
        type=int,
        default=None,
        help="streamed responses send a chunk every N tokens (default 1: every token)",
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", default=os.environ.get("PAGEDRAY_API_KEY"))
    parser.add_argument(
        "--address", default=None, help="Ray cluster to join ('auto'); default: start a local one"
    )
    parser.add_argument(
        "--metrics-export-port",
        type=int,
        default=DEFAULT_METRICS_EXPORT_PORT,
        help="the local Ray's Prometheus endpoint (a joined cluster keeps its `ray start` port)",
    )
    parser.set_defaults(func=run_serve)


def serve_app_args(args: argparse.Namespace) -> dict[str, Any]:
    """The `build_app` arguments for parsed `serve` flags (None = the default)."""
    from pagedray.cluster.cli import engine_kwargs

    app_args: dict[str, Any] = {
        "model": args.model,
        **engine_kwargs(args),
        "served_model_name": args.served_model_name,
        "max_num_waiting": args.max_num_waiting,
        "request_timeout_s": args.request_timeout,
        "num_threads": args.num_threads,
        "device": args.device,
        "dispatch": args.dispatch,
        "stream_interval": args.stream_interval,
        "num_replicas": args.num_replicas,
        "min_replicas": args.min_replicas,
        "max_replicas": args.max_replicas,
        "api_key": args.api_key,
    }
    return {key: value for key, value in app_args.items() if value is not None}


def run_serve(args: argparse.Namespace) -> int:
    """Start (or join) Ray, deploy, print the URL, and serve until Ctrl-C or SIGTERM."""
    import ray
    from ray import serve

    from pagedray.cluster.default_model import default_model_path
    from pagedray.cluster.openai_app import build_app

    app_args = serve_app_args(args)
    app_args.setdefault("model", str(default_model_path()))
    # The name clients must send as `model` (also listed by GET /v1/models).
    model_name = app_args.get("served_model_name") or Path(app_args["model"]).name
    local = args.address is None and not os.environ.get("RAY_ADDRESS")
    if local:
        engines = args.max_replicas or args.num_replicas
        num_cpus = engines * (1 + args.tensor_parallel_size) + 1  # + the ingress
        _check_port_free(args.metrics_export_port, "--metrics-export-port")
        ray.init(
            address="local",
            num_cpus=max(os.cpu_count() or 1, num_cpus),
            include_dashboard=True,
            _metrics_export_port=args.metrics_export_port,
        )
    else:
        ray.init(address=args.address)
    stop = threading.Event()
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        serve.run(build_app(app_args), name=APP_NAME, route_prefix="/")
        url = f"http://{args.host}:{args.port}/v1"
        print(f"pagedray: serving the OpenAI API at {url} (model {model_name!r})", flush=True)
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, lambda *_: stop.set())
        while not stop.wait(1.0):
            pass
    finally:
        _shut_down(local)
    return 0


def _check_port_free(port: int, flag: str) -> None:
    """Fail fast: Ray given a busy metrics port only times out starting, 30 s later."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("", port))
        except OSError as exc:
            raise SystemExit(f"pagedray: {flag} {port} is not free ({exc.strerror})") from None


def _shut_down(local: bool) -> None:
    """Remove our app; stop Serve unless other apps still run there; disconnect from Ray."""
    import ray
    from ray import serve

    try:
        if serve.status().applications.get(APP_NAME) is not None:
            serve.delete(APP_NAME)
        if local or not serve.status().applications:
            serve.shutdown()
    except Exception as exc:  # noqa: BLE001 - still disconnect from Ray below
        print(f"pagedray: shutting down Serve failed: {exc}", flush=True)
    finally:
        ray.shutdown()
    print("pagedray: stopped", flush=True)
