"""`pagedray serve`: the OpenAI-compatible server on a local Ray, on a running Ray cluster, or
(`--no-ray`, cli/serve_local.py) in this one process.

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
from pathlib import Path
from typing import Any

from pagedray.cli.config_flags import add_config_flags, config_values
from pagedray.cli.console import quiet_ray_console, say
from pagedray.cli.serve_runtime import (
    QuietReconnect,
    StartupFailed,
    app_state,
    lean_serve_env,
    proxy_port,
    wait_until_ready,
)
from pagedray.cluster.server_config import ServerConfig
from pagedray.cluster.shared_api_port import SETUP_HOOK
from pagedray.engine.config import validated
from pagedray.workers.cpu_scheduling import serve_under_batch_policy
from pagedray.workers.cpu_threads import serving_thread_counts

APP_NAME = "pagedray"
API_KEY_ENV = "PAGEDRAY_API_KEY"
# What holds the model's place while the flags are checked, when none is given: `run_serve`
# builds the default one only once Ray is coming.
DEFAULT_MODEL_PLACEHOLDER = "(the built default model)"
# As deploy/ (`ray start --metrics-export-port=8080`), so deploy/prometheus/ scrapes either.
DEFAULT_METRICS_EXPORT_PORT = 8080
RAY_CLUSTER_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
RAY_AUTH_MODE_ENV = "RAY_AUTH_MODE"


def add_serve_parser(commands: Any) -> None:
    """Register the `serve` subcommand (called by `cli.main`)."""
    parser = commands.add_parser("serve", help="serve the OpenAI API over HTTP with Ray Serve")
    # The application's settings: one flag per field of its schema (vLLM's names and values).
    add_config_flags(parser, ServerConfig)
    # Accepted for vLLM command lines, each what pagedray always does.
    for flag, always in (
        ("--enable-auto-tool-choice", "tool_choice=auto is always on"),
        ("--enable-chunked-prefill", "prompts are always prefilled in chunks"),
        ("--enforce-eager", "the model always runs eagerly (no CUDA graphs)"),
        ("--disable-log-requests", "requests are logged only with --enable-log-requests"),
        ("--enable-prompt-tokens-details", "usage always has prompt_tokens_details"),
    ):
        parser.add_argument(flag, action="store_true", help=f"accepted for vLLM: {always} here")
    # And those whose one value is what pagedray always does (any other is refused).
    for names, value, always in (
        (["--kv-cache-dtype"], "auto", "the KV cache takes the model's dtype"),
        (["--pipeline-parallel-size", "-pp"], "1", "one pipeline stage"),
        (["--distributed-executor-backend"], "ray", "ranks of TP > 1 are Ray actors"),
    ):
        help_text = f"accepted for vLLM as {value}: {always} here"
        parser.add_argument(*names, choices=[value], help=help_text)
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
    parser.add_argument(
        "--no-ray",
        action="store_true",
        help="serve from this one process, over one engine it steps itself: no Ray to start "
        "(TP 1, one engine; no Ray dashboard or metrics export)",
    )
    parser.set_defaults(func=run_serve)


def serve_settings(args: argparse.Namespace) -> ServerConfig:
    """The application's settings from the flags, checked; SystemExit naming a bad one. Without
    a model, the default one's place is held (`run_serve` builds it only once Ray is coming)."""
    values = {"model": DEFAULT_MODEL_PLACEHOLDER, **config_values(args, ServerConfig)}
    try:
        return validated(ServerConfig, values)
    except ValueError as exc:
        raise SystemExit(f"pagedray: {exc}") from None


def serve_app_args(args: argparse.Namespace) -> dict[str, Any]:
    """The `build_app` arguments the flags set (as the schema reads them), and the API key's."""
    settings = serve_settings(args)
    given = config_values(args, ServerConfig)
    app_args = {name: getattr(settings, name) for name in given}
    app_args.update(_api_key_args(args))
    return {key: value for key, value in app_args.items() if value is not None}


def local_thread_counts(settings: ServerConfig) -> dict[str, int]:
    """Torch threads per rank when every engine runs on this machine and the settings leave
    them to us: all its cores but one while a request streams, all while none does, split among
    all the engines' ranks (an engine replica alone would count only its own ranks). Empty on
    CUDA or with `num_threads`."""
    if settings.num_threads is not None or settings.device == "cuda":
        return {}
    return serving_thread_counts(settings.max_engines * settings.tensor_parallel_size)


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
    settings = serve_settings(args)
    if args.no_ray:
        from pagedray.cli.serve_local import run_local_serve

        _check_port_free(args.port, "--port", args.host)
        with_key = validated(ServerConfig, {"model": settings.model, **app_args})
        return run_local_serve(args, with_key, model_given="model" in app_args)
    local = args.address is None and not os.environ.get("RAY_ADDRESS")
    if local:
        # Refused before anything changes: this process's environment included.
        _check_port_free(args.metrics_export_port, "--metrics-export-port")
        _check_port_free(args.port, "--port", args.host)
    if local and _is_loopback(args.metrics_host or args.host):
        _keep_ray_on_loopback()
    if local:
        # NOTE: before Ray is imported: Serve reads these when its modules load.
        os.environ.update(lean_serve_env(args.port, settings.num_ingress_replicas))
    if local:
        app_args.update(local_thread_counts(settings))
    if local and settings.device != "cuda":
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
        _start_ray(ray, args, settings, local)
        quiet_ray_console()
        # NOTE: right after Ray starts (it installs its own SIGTERM handler, which aborts the
        # process), and before deploying: a signal then stops the deployment and cleans up.
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, on_signal)
        port = proxy_port(args.port, args.host) if local else args.port
        serve.start(http_options={"host": args.host, "port": port})
        logging.getLogger("ray.serve").addFilter(QuietReconnect())
        engines = settings.max_engines
        say(
            f"deploying {Path(app_args['model']).name}: {engines} engine replica(s) of "
            f"tensor parallel size {settings.tensor_parallel_size}, each loading the model"
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


def _start_ray(ray: Any, args: argparse.Namespace, settings: ServerConfig, local: bool) -> None:
    """A local single-node Ray listening where --metrics-host says, or the cluster to join."""
    if not local:
        say(f"joining the Ray cluster at {args.address or os.environ.get('RAY_ADDRESS')}")
        ray.init(address=args.address, logging_level=logging.WARNING)
        return
    num_cpus = settings.max_engines * (1 + settings.tensor_parallel_size) + 1  # + the ingress
    metrics_host = args.metrics_host or args.host
    say("starting a local Ray")
    # NOTE: several ingress replicas share the API port through a patch of Serve's controller,
    # installed as it starts by this job's worker setup hook (cluster/shared_api_port.py).
    hook = {"worker_process_setup_hook": SETUP_HOOK} if settings.num_ingress_replicas > 1 else {}
    context = ray.init(
        logging_level=logging.WARNING,  # its INFO lines: what `say` tells, and the dashboard
        address="local",
        **({"runtime_env": hook} if hook else {}),
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
