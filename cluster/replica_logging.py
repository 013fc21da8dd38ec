"""pagedray's own log lines in a Serve replica's log file, beside Serve's, at Serve's level.

Ray Serve writes a replica's log file through the handlers of its `ray.serve` logger only, and
turns the replica's stdout and stderr into INFO lines of that logger. Every module outside the
Serve layer logs to a `pagedray.*` logger, which had no handler in a replica: its INFO lines
(the host KV tier's size and path, the thread counts a rank chose, blocks saved at exit) were
dropped, and its warnings and errors came through Python's last-resort stderr handler as
INFO lines of Serve's, their level lost.
"""

from __future__ import annotations

import logging

SERVE_LOGGER_NAME = "ray.serve"  # ray/serve/_private/constants.py
PAGEDRAY_LOGGER_NAME = "pagedray"


def log_through_serve() -> None:
    """Has the `pagedray` logger write through this replica's Serve handlers (its log file, and
    stderr where RAY_SERVE_LOG_TO_STDERR asks), at the level the deployment's `logging_config`
    gives Serve's logger. Idempotent; called in a replica's constructor, after Serve has set its
    logger up for the replica."""
    serve_logger = logging.getLogger(SERVE_LOGGER_NAME)
    pagedray_logger = logging.getLogger(PAGEDRAY_LOGGER_NAME)
    pagedray_logger.handlers = list(serve_logger.handlers)
    pagedray_logger.setLevel(serve_logger.getEffectiveLevel())
    pagedray_logger.propagate = False  # as Serve's own: no second copy through the root logger
