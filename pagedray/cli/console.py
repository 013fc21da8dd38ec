"""What `pagedray serve` shows on its console: what it is doing while it starts, and no more of
Ray's and Serve's own output than a user needs.

Left to themselves, Ray and Serve print a token-auth notice, Serve's 8-line banner of its
throughput mode, INFO lines of the driver's Serve client, and on every ordinary stop the
raylet's "Task ServeController.graceful_shutdown failed ... killed by `ray.kill`" (Serve kills its
controller once it has shut down, and the raylet reports the pending retry): nothing a user can
act on, and the last reads like a failure. Everything else a replica or the raylet prints (a
traceback, a warning) still reaches the console.
"""

from __future__ import annotations

import logging
import re
from typing import Any, Callable

# Lines of Ray's worker and raylet output that are dropped on the console (the log files keep
# them): Serve's banner, its bullet lines, and the stop's report of the killed controller.
_BANNER = "Throughput optimized Ray Serve enabled"
_BULLET = re.compile(r"^\s*(•.*)?$")
_NOISE = (re.compile(r"Task ServeController\.graceful_shutdown failed"),)
_HANDLER_NAME = "ray_print_logs"  # the driver's handler of worker output (ray._private.worker)
# What a user calls each of the application's deployments.
DEPLOYMENT_WORDS = {
    "PagedRayEngine": "engine",
    "OpenAIIngress": "HTTP ingress",
    "ResponseStore": "response store",
}


def say(line: str) -> None:
    """One line of `pagedray serve`'s own, flushed at once."""
    print(f"pagedray: {line}", flush=True)


def quiet_ray_console() -> None:
    """Drop Ray's and Serve's noise from this driver's console (call after `ray.init`)."""
    logging.getLogger("ray.serve").setLevel(logging.WARNING)  # the client's INFO lines
    import ray._private.worker as ray_worker
    from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher

    # Workers' output reaches the console through the dispatcher's handler; the raylet's error
    # messages through `print_to_stdstream` itself, which its listener looks up at each call.
    for name, handler in list(dispatcher.handlers):
        if name == _HANDLER_NAME:
            dispatcher.remove_handler(name)
            dispatcher.add_handler(name, _filtered(handler))
    ray_worker.print_to_stdstream = _filtered(ray_worker.print_to_stdstream)


def _filtered(handler: Callable[..., None]) -> Callable[..., None]:
    def print_what_matters(batch: dict[str, Any], *args: Any, **kwargs: Any) -> None:
        lines = quiet_lines(list(batch.get("lines", [])))
        if lines:
            handler({**batch, "lines": lines}, *args, **kwargs)

    return print_what_matters


def quiet_lines(lines: list[str]) -> list[str]:
    """`lines` of Ray's worker output without Serve's banner and the stop's noise."""
    kept: list[str] = []
    in_banner = False
    for line in lines:
        if _BANNER in line:
            in_banner = True
            continue
        if in_banner and _BULLET.match(line):
            continue
        in_banner = False
        if not any(pattern.search(line) for pattern in _NOISE):
            kept.append(line)
    return kept


def replica_progress(deployments: dict[str, Any]) -> str | None:
    """The deployments' running replicas as a line (`engine 0/1 running, ...`), from Serve's
    status overviews; None before any replica is planned."""
    parts = []
    for name, overview in deployments.items():
        states = {str(getattr(k, "value", k)): n for k, n in overview.replica_states.items()}
        total = sum(states.values())
        if total:
            word = DEPLOYMENT_WORDS.get(name, name)
            parts.append(f"{word} {states.get('RUNNING', 0)}/{total}")
    return f"replicas running: {', '.join(parts)}" if parts else None
