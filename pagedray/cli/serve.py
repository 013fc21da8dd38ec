"""`pagedray serve`: the OpenAI-compatible server on a local Ray, or on a running Ray cluster.

Kept apart from `cli.py` so offline use never imports Ray Serve.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
import threading
import typing
from pathlib import Path
from typing import Any

from pagedray.cli.console import quiet_ray_console, say
from pagedray.cli.engine_args import add_engine_args, engine_kwargs
from pagedray.cli.serve_runtime import (
    QuietReconnect,
    StartupFailed,
    app_state,
    lean_serve_env,
    proxy_port,
    wait_until_ready,
)
from pagedray.cli.vllm_flags import CORS_ARGS, add_cors_args
from pagedray.workers.cpu_scheduling import serve_under_batch_policy
from pagedray.workers.cpu_threads import serving_thread_counts

APP_NAME = "pagedray"
API_KEY_ENV = "PAGEDRAY_API_KEY"
# As `ingress_guard.DEFAULT_MAX_REQUEST_BODY_BYTES` (not imported: it would import Starlette).
DEFAULT_MAX_REQUEST_BODY_BYTES = 4 * 1024 * 1024
# As deploy/ (`ray start --metrics-export-port=8080`), so deploy/prometheus/ scrapes either.
DEFAULT_METRICS_EXPORT_PORT = 8080
RAY_CLUSTER_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
RAY_AUTH_MODE_ENV = "RAY_AUTH_MODE"


def add_serve_parser(commands: Any) -> None:
    """Register the `serve` subcommand (called by `cli.main`)."""
    from pagedray.engine.config import EngineConfig

    dispatch = EngineConfig.model_fields["dispatch"]

    parser = commands.add_parser("serve", help="serve the OpenAI API over HTTP with Ray Serve")
    add_engine_args(parser)
    parser.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="the names clients may send as `model`, the first one reported (default: the model "
        "dir name)",
    )
    parser.add_argument("--num-replicas", type=int, default=1, help="engines (each a TP group)")
    parser.add_argument(
        "--num-ingress-replicas",
        type=int,
        default=1,
        help="HTTP ingress replicas (tokenize, detokenize, stream); 1 listens on --port itself, "
        "more share it through Serve's proxy",
    )
    parser.add_argument("--min-replicas", type=int, default=None, help="autoscale from this")
    parser.add_argument("--max-replicas", type=int, default=None, help="autoscale up to this")
    parser.add_argument(
        "--routing",
        choices=["cache-aware", "power-of-two"],
        default=None,
        help="how requests pick an engine: by its cached prefix (default with several) or load",
    )
    parser.add_argument(
        "--routing-load-threshold",
        type=int,
        default=None,
        help="cache-aware: ongoing requests by which the best-matching engine may exceed the "
        "least loaded and still be chosen (default 32)",
    )
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
    parser.add_argument(
        "--num-threads",
        type=int,
        default=None,
        help="torch threads per rank on a CPU, for every step (default: the cores but one, split "
        "among ranks, while a request streams; all of them while none does)",
    )
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
    parser.add_argument(
        "--tool-call-parser",
        default=None,
        choices=["auto", "hermes", "llama3_json"],
        help="how tool_choice=auto reads calls from the text (default auto: by chat template)",
    )
    parser.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help="accepted for vLLM command lines: tool_choice=auto is always on here",
    )
    parser.add_argument("--host", default="127.0.0.1", help="the API's address")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--api-key",
        nargs="+",
        default=None,
        help=f"required of clients on every route but /health (default: ${API_KEY_ENV}); one key",
    )
    parser.add_argument(
        "--api-key-file", default=None, help="read the API key from this file (stripped)"
    )
    add_cors_args(parser)
    parser.add_argument(
        "--max-request-body-bytes",
        type=int,
        default=None,
        help=f"413 for larger bodies (default {DEFAULT_MAX_REQUEST_BODY_BYTES})",
    )
    parser.add_argument(
        "--address", default=None, help="Ray cluster to join ('auto'); default: start a local one"
    )
    parser.add_argument(
        "--metrics-export-port",
        type=int,
        default=DEFAULT_METRICS_EXPORT_PORT,
        help="the local Ray's Prometheus endpoint (a joined cluster keeps its `ray start` port)",
    )
    parser.add_argument(
        "--metrics-host",
        default=None,
        help="where the local Ray's metrics port and dashboard listen (default: --host); "
        "a loopback address keeps every Ray port on loopback",
    )
    parser.add_argument(
        "--dashboard-host",
        default=None,
        help="the local Ray dashboard's address (default: --metrics-host)",
    )
    parser.add_argument(
        "--dashboard-port",
        type=int,
        default=None,
        help="the local Ray dashboard's port (default: Ray's, 8265, or the next free one)",
    )
    parser.add_argument(
        "--startup-timeout", type=float, default=600.0, help="seconds to wait for the API"
    )
    parser.set_defaults(func=run_serve)


def serve_app_args(args: argparse.Namespace) -> dict[str, Any]:
    """The `build_app` arguments for parsed `serve` flags (None = the default)."""

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
        "tool_call_parser": args.tool_call_parser,
        "num_replicas": args.num_replicas,
        "num_ingress_replicas": args.num_ingress_replicas,
        "min_replicas": args.min_replicas,
        "max_replicas": args.max_replicas,
        "routing": args.routing,
        "routing_load_threshold": args.routing_load_threshold,
        "max_request_body_bytes": args.max_request_body_bytes,
        **{name: getattr(args, name) for name in CORS_ARGS},
        **_api_key_args(args),
    }
    return {key: value for key, value in app_args.items() if value is not None}


def local_thread_counts(args: argparse.Namespace) -> dict[str, int]:
    """Torch threads per rank when every engine runs on this machine and the flags leave them
    to us: all its cores but one while a request streams, all while none does, split among all
    the engines' ranks (an engine replica alone would count only its own ranks). Empty with
    --device cuda or --num-threads."""
    if args.num_threads is not None or args.device == "cuda":
        return {}
    return serving_thread_counts(_max_engines(args) * args.tensor_parallel_size)


def _max_engines(args: argparse.Namespace) -> int:
    """The most engines the flags may run: autoscaling's bound, else the fixed count."""
    if args.max_replicas is not None:
        return int(args.max_replicas)
    return max(args.min_replicas or 0, args.num_replicas)


def _api_key_args(args: argparse.Namespace) -> dict[str, Any]:
    """--api-key or --api-key-file, else $PAGEDRAY_API_KEY: the file or the environment keep the
    key out of the process's command line."""
    if args.api_key is not None and args.api_key_file is not None:
        raise SystemExit("pagedray: give --api-key or --api-key-file, not both")
    if args.api_key is not None and len(args.api_key) > 1:  # vLLM takes several
        raise SystemExit("pagedray: give one --api-key; several keys are not supported")
    if args.api_key_file is not None:
        return {"api_key_file": args.api_key_file}
    key = args.api_key[0] if args.api_key is not None else os.environ.get(API_KEY_ENV)
    return {"api_key": key} if key else {}


def run_serve(args: argparse.Namespace) -> int:
    """Start (or join) Ray, deploy, print the URL, and serve until Ctrl-C or SIGTERM."""
    app_args = serve_app_args(args)
    local = args.address is None and not os.environ.get("RAY_ADDRESS")
    if local:
        # Refused before anything changes: this process's environment included.
        _check_port_free(args.metrics_export_port, "--metrics-export-port")
        _check_port_free(args.port, "--port", args.host)
    if local and _is_loopback(args.metrics_host or args.host):
        _keep_ray_on_loopback()
    if local:
        # NOTE: before Ray is imported: Serve reads these when its modules load.
        os.environ.update(lean_serve_env(args.port, args.num_ingress_replicas))
    if local:
        app_args.update(local_thread_counts(args))
    if local and args.device != "cuda":
        # NOTE: before Ray starts: its processes inherit the policy (workers/cpu_scheduling.py).
        serve_under_batch_policy()
    if local:
        # Ray's own default for a local cluster (token auth on), said outright: Ray then does not
        # print its notice that it chose it. A user's setting is kept.
        os.environ.setdefault(RAY_AUTH_MODE_ENV, "token")
    import ray
    from ray import serve
    from ray.serve.api import _run

    from pagedray.cluster.openai_app import build_app
    from pagedray.observability.ray_grafana import provision_for_this_ray_session
    from pagedray.tools.default_model import default_model_built, default_model_path

    if "model" not in app_args:
        if not default_model_built():
            say("building the default model (once, into the cache)")
        app_args["model"] = str(default_model_path())
    # The names clients may send as `model` (also listed by GET /v1/models).
    model_names = app_args.get("served_model_name") or [Path(app_args["model"]).name]
    stop = threading.Event()
    serving = failed = False

    def on_signal(*_: Any) -> None:
        # Still starting: interrupt that. Serving: the first signal stops gracefully (the
        # engines drain their requests), a second one at once.
        if not serving or stop.is_set():
            stop.set()
            raise KeyboardInterrupt
        stop.set()
        say("stopping once the requests in flight finish (again to stop now)")

    try:
        _start_ray(ray, args, local)
        quiet_ray_console()
        # NOTE: right after Ray starts (it installs its own SIGTERM handler, which aborts the
        # process), and before deploying: a signal then stops the deployment and cleans up.
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, on_signal)
        port = proxy_port(args.port, args.host) if local else args.port
        serve.start(http_options={"host": args.host, "port": port})
        logging.getLogger("ray.serve").addFilter(QuietReconnect())
        engines = _max_engines(args) if args.max_replicas else args.num_replicas
        say(
            f"deploying {Path(app_args['model']).name}: {engines} engine replica(s) of "
            f"tensor parallel size {args.tensor_parallel_size}, each loading the model"
        )
        _run(build_app(app_args), _blocking=False, name=APP_NAME, route_prefix="/")
        poll_host = "127.0.0.1" if args.host in ("", "0.0.0.0", "::") else args.host
        wait_until_ready(
            f"http://{_url_host(poll_host)}:{args.port}/health",
            lambda: app_state(serve.status(), APP_NAME),
            args.startup_timeout,
        )
        serving = True
        url = f"http://{_url_host(args.host)}:{args.port}/v1"
        names = ", ".join(repr(name) for name in model_names)
        say(f"serving the OpenAI API at {url} (model {names})")
        # The ingress writes it where it runs; this covers a head that holds no ingress.
        if (dashboard := provision_for_this_ray_session()) is not None:
            say(f"Grafana dashboard for Ray's Grafana: {dashboard}")
        while not stop.wait(1.0):
            pass
    except KeyboardInterrupt:
        say("interrupted while starting")
    except (StartupFailed, TimeoutError) as exc:  # why, in a line: the Serve logs hold the rest
        say(f"the server did not start: {exc}")
        failed = True
    finally:
        try:
            _shut_down(local)
        except KeyboardInterrupt:  # the second signal: Ray is shut down, the replicas with it
            say("stopped without waiting")
    return 1 if failed else 0


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _start_ray(ray: Any, args: argparse.Namespace, local: bool) -> None:
    """A local single-node Ray listening where --metrics-host says, or the cluster to join."""
    if not local:
        say(f"joining the Ray cluster at {args.address or os.environ.get('RAY_ADDRESS')}")
        ray.init(address=args.address, logging_level=logging.WARNING)
        return
    num_cpus = _max_engines(args) * (1 + args.tensor_parallel_size) + 1  # + the ingress
    metrics_host = args.metrics_host or args.host
    say("starting a local Ray")
    context = ray.init(
        logging_level=logging.WARNING,  # its INFO lines: what `say` tells, and the dashboard
        address="local",
        num_cpus=max(os.cpu_count() or 1, num_cpus),
        include_dashboard=True,
        dashboard_host=args.dashboard_host or metrics_host,
        **({"dashboard_port": args.dashboard_port} if args.dashboard_port else {}),
        _metrics_export_port=args.metrics_export_port,
        **_bind_ray_to(metrics_host),
    )
    dashboard = getattr(context, "dashboard_url", None)
    say(f"Ray is up (its dashboard at http://{dashboard})" if dashboard else "Ray is up")


def _is_loopback(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.")


def _keep_ray_on_loopback() -> None:
    """Make the local Ray take 127.0.0.1 as its node address, so its metrics export port (and
    its GCS, raylet and worker ports) listen on loopback only.

    NOTE: Ray 2.60 binds the metrics export port to loopback only when the node address is a
    loopback one, and turns a loopback `_node_ip_address` into the machine's address unless
    `RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER` is off (a single-node Ray: what a local one is). The
    variable is read when Ray is imported, and children inherit it; a Ray imported already
    (tests) has its module constant set to match.
    """
    os.environ[RAY_CLUSTER_ENV] = "0"
    constants = sys.modules.get("ray._private.ray_constants")
    if constants is not None:
        setattr(constants, "ENABLE_RAY_CLUSTER", False)  # noqa: B010 - a module's constant


def _bind_ray_to(host: str) -> dict[str, Any]:
    """`ray.init` arguments for a node address of `host` (its metrics port then listens on all
    interfaces: Ray binds it either to loopback or to every address, never to one given)."""
    if _is_loopback(host) or host in ("", "0.0.0.0", "::"):
        return {}
    return {"_node_ip_address": host}


def _check_port_free(port: int, flag: str, host: str = "") -> None:
    """Fail fast: Ray given a busy metrics port only times out starting, 30 s later, and Serve
    given a busy API port retries its ingress replica. With SO_REUSEADDR, as the ingress binds
    (cluster/serve_bind_fix.py): the connections a stopped server left in TIME_WAIT are no
    obstacle, something listening is."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            raise SystemExit(f"pagedray: {flag} {port} is not free ({exc.strerror})") from None


def _shut_down(local: bool) -> None:
    """Remove our app; stop Serve unless other apps still run there; disconnect from Ray."""
    import ray
    from ray import serve

    if not ray.is_initialized():  # interrupted before Ray started: nothing to stop
        say("stopped")
        return
    try:
        if serve.status().applications.get(APP_NAME) is not None:
            serve.delete(APP_NAME)
        if local or not serve.status().applications:
            serve.shutdown()
    except Exception as exc:  # noqa: BLE001 - still disconnect from Ray below
        say(f"shutting down Serve failed: {exc}")
    finally:
        ray.shutdown()
    say("stopped")
