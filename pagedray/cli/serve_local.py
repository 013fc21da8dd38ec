"""`pagedray serve --no-ray`: the same OpenAI server, routes and middleware, in this one process
over an engine it steps itself (openai/local_app.py). Nothing to start but the model: no Ray
daemons, no token, a first answer in seconds. For one engine at TP = 1 on this machine; what a
cluster is for (several engines or ingress replicas, TP > 1, joining a cluster, Ray's metrics
export and dashboard) needs the default, Ray-served mode, and is refused here by name.
"""

from __future__ import annotations

import argparse
import signal
from pathlib import Path

from pagedray.cli.console import say
from pagedray.cluster.replica_logging import REQUEST_LOG_NAME, STATS_LOG_NAME, on_console
from pagedray.cluster.server_config import ServerConfig
from pagedray.openai.ingress_guard import GuardSettings
from pagedray.openai.response_store import ResponseStore
from pagedray.workers.cpu_threads import serving_thread_counts


def run_local_serve(args: argparse.Namespace, settings: ServerConfig, model_given: bool) -> int:
    """Serve until Ctrl-C or SIGTERM (uvicorn's: the requests in flight finish first).
    Without `model_given`, the default model (built once, into the cache)."""
    refused = _needs_ray(args, settings)
    if refused:
        raise SystemExit(f"pagedray: --no-ray serves one engine in this process; {refused}")
    import uvicorn

    from pagedray.openai.local_app import local_openai_app
    from pagedray.tools.default_model import default_model_built, default_model_path

    if not model_given:
        if not default_model_built():
            say("building the default model (once, into the cache)")
        settings = settings.model_copy(update={"model": str(default_model_path())})
    config = settings.engine_config()
    if config.enable_log_requests:
        on_console(REQUEST_LOG_NAME)
    if not config.disable_log_stats:
        on_console(STATS_LOG_NAME)
    if config.num_threads is None and config.device != "cuda":
        # The machine's cores but one while a request streams: the HTTP side needs one.
        config = config.model_copy(update=serving_thread_counts(1))
    say(f"loading {Path(config.model).name}: one engine in this process, no Ray")
    app = local_openai_app(
        config,
        GuardSettings(settings.api_key_digest(), settings.max_request_body_bytes),
        settings.cors(),
        ResponseStore(max_responses=settings.responses_max_stored, ttl_s=settings.responses_ttl_s),
        **({"stuck_after_s": settings.stuck_after_s} if settings.stuck_after_s else {}),
    )
    names = ", ".join(repr(name) for name in config.served_names())
    host = f"[{args.host}]" if ":" in args.host else args.host
    say(f"serving the OpenAI API at http://{host}:{args.port}/v1 (model {names})")
    # NOTE: uvicorn stops gracefully on SIGINT or SIGTERM, then raises the signal again for the
    # handler it found: ours, so that a requested stop exits with 0, as with Ray.
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: None)
    access_log = not settings.disable_uvicorn_access_log
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", access_log=access_log)
    say("stopped")
    return 0


def _needs_ray(args: argparse.Namespace, settings: ServerConfig) -> str | None:
    """Why these settings need Ray, if they do."""
    if args.address is not None:
        return "--address joins a Ray cluster"
    if settings.tensor_parallel_size > 1:
        return "--tensor-parallel-size above 1 runs its ranks as Ray actors"
    if settings.max_engines > 1:
        return "several engines (--num-replicas, --max-replicas) are Serve replicas"
    if settings.num_ingress_replicas > 1:
        return "--num-ingress-replicas above 1 are Serve replicas"
    return None
