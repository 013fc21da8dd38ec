"""Where pagedray's own log lines go in the processes Serve and Ray start for it.

Ray Serve writes a replica's log file through the handlers of its `ray.serve` logger only, and
turns the replica's stdout and stderr into INFO lines of that logger. Every module logs to a
`pagedray.*` logger, which had no handler in a replica: its INFO lines (the host KV tier's path
and size, the thread counts a rank chose, blocks saved at exit) were dropped, and its warnings
and errors came through Python's last-resort stderr handler as INFO lines of Serve's, their
level lost. A rank in an actor of its own (TP > 1) is no replica: its lines go to the actor's
stderr, which Ray keeps in the actor's log (the dashboard's Actors page) and streams to the
driver.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable

SERVE_LOGGER_NAME = "ray.serve"  # ray/serve/_private/constants.py
PAGEDRAY_LOGGER_NAME = "pagedray"
RANK_LOG_FORMAT = "%(levelname)s %(asctime)s %(name)s -- %(message)s"
REQUEST_LOG_NAME = "pagedray.openai.request_log"  # openai/request_log.py
STATS_LOG_NAME = "pagedray.engine.stats_log"  # engine/stats_log.py
ROUTE_MARK = "pagedray_route"  # an attribute on the handler this module added


class _ToServe(logging.Handler):
    """Hands each record to Serve's logger: to whatever handlers it has at the time (Serve
    replaces them when a deployment's `logging_config` changes), with its filters (the
    replica's and the request's context)."""

    def emit(self, record: logging.LogRecord) -> None:
        logging.getLogger(SERVE_LOGGER_NAME).handle(record)


def log_through_serve() -> None:
    """Has the `pagedray` logger write through this replica's Serve logger, at the level the
    deployment's `logging_config` gives it (its log file, and stderr where
    RAY_SERVE_LOG_TO_STDERR asks). Idempotent; called in a replica's constructor, after Serve
    has set its logger up. Outside a replica (no Serve handlers), nothing changes."""
    serve_logger = logging.getLogger(SERVE_LOGGER_NAME)
    if not serve_logger.handlers:
        return
    _route(_ToServe, serve_logger.getEffectiveLevel())


def log_to_stderr() -> None:
    """Has the `pagedray` logger write INFO and above to this process's stderr: a rank's
    actor, whose stderr Ray keeps in its log. Idempotent."""

    def stderr_handler() -> logging.Handler:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(RANK_LOG_FORMAT))
        return handler

    _route(stderr_handler, logging.INFO)


def on_console(logger_name: str) -> None:
    """A logger's lines (the request log, the stats line) on this process's stderr too, as
    vLLM prints them on its console: Ray brings a replica's stderr to `pagedray serve`'s
    console, where Serve's throughput mode (pagedray's default) writes its logger to the log
    file only, and a `--no-ray` server has no handler for INFO lines. At INFO unless a lower
    level is set. Idempotent."""
    chosen = logging.getLogger(logger_name)
    if any(getattr(h, ROUTE_MARK, False) for h in chosen.handlers):
        return
    # NOTE: the process's own stderr: a replica's `sys.stderr` is Serve's, into its log file.
    handler = logging.StreamHandler(sys.__stderr__)
    handler.setFormatter(logging.Formatter(RANK_LOG_FORMAT))
    setattr(handler, ROUTE_MARK, True)
    chosen.addHandler(handler)
    if chosen.getEffectiveLevel() > logging.INFO:
        chosen.setLevel(logging.INFO)


def serve_logs_to_stderr() -> bool:
    """Whether Serve writes a replica's log lines to stderr itself (then `on_console` would
    show them twice)."""
    from ray.serve._private import constants

    return bool(constants.RAY_SERVE_LOG_TO_STDERR)


def _route(make_handler: Callable[[], logging.Handler], level: int) -> None:
    pagedray_logger = logging.getLogger(PAGEDRAY_LOGGER_NAME)
    if not any(getattr(h, ROUTE_MARK, False) for h in pagedray_logger.handlers):
        handler = make_handler()
        setattr(handler, ROUTE_MARK, True)  # ours, among any a user added
        pagedray_logger.addHandler(handler)
    pagedray_logger.setLevel(level)
    pagedray_logger.propagate = False  # one copy: not again through the root logger
