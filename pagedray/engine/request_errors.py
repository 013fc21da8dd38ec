"""How an engine request can end other than by finishing: an exception type for each, raised in
the engine loop, and `failure_of`, the one place one becomes the `RequestFailure` a client is
told of (its kind; the OpenAI layer picks the HTTP status). Messages name no internals: a dead
engine's or an internal error's cause is logged under the request's id instead.
"""

from __future__ import annotations

import logging

from pagedray.scheduler.request_failure import FailureKind, RequestFailure, RequestRefused

logger = logging.getLogger(__name__)
# Seconds a refused, displaced or orphaned request is told to wait before it retries (the
# Retry-After of its 503).
RETRY_AFTER_S = 1.0


# Failures of an engine, not of its request: the replica or its engine died, or the engine
# aborted the request from outside (its output channel closed). Such a request may move to
# another engine (cluster/serve_engine_client.py), and its move is counted by this kind.
MIGRATED_FAILURES = (FailureKind.DEAD, FailureKind.ABORTED)


class EngineOverloadedError(RuntimeError):
    """The waiting queue is full: the request was refused (or gave way), try again later."""


class RequestTimeoutError(RuntimeError):
    """The request outlived its deadline (`request_timeout_s`); it was aborted, blocks freed."""


class RequestAbortedError(RuntimeError):
    """The request was aborted from outside its own stream (its output channel closed, or an
    `abort` call); its blocks were freed."""


class EngineDeadError(RuntimeError):
    """The engine loop has stopped (a step raised); no request can be served by this engine."""


class RequestFailedError(RuntimeError):
    """The engine ended this request alone (e.g. its sampling failed), for `failure`."""

    def __init__(self, failure: RequestFailure) -> None:
        super().__init__(failure.message)
        self.failure = failure


def failure_of(exc: BaseException, request_id: str) -> RequestFailure:
    """What an exception that ended a request tells its client."""
    if isinstance(exc, EngineOverloadedError):
        return RequestFailure(FailureKind.OVERLOADED, str(exc), retry_after_s=RETRY_AFTER_S)
    if isinstance(exc, EngineDeadError):
        logger.error("request %s: %s", request_id, exc)
        message = f"the engine is unavailable (request {request_id}); retry later"
        return RequestFailure(FailureKind.DEAD, message, retry_after_s=RETRY_AFTER_S)
    if isinstance(exc, RequestTimeoutError):
        return RequestFailure(FailureKind.TIMEOUT, str(exc))
    if isinstance(exc, RequestAbortedError):
        return RequestFailure(FailureKind.ABORTED, str(exc), retry_after_s=RETRY_AFTER_S)
    if isinstance(exc, RequestFailedError):
        return exc.failure
    if isinstance(exc, RequestRefused):
        return exc.failure()
    if isinstance(exc, ValueError):  # a refusal that names no field
        return RequestFailure(FailureKind.INVALID, str(exc))
    logger.error("request %s failed", request_id, exc_info=exc)
    return RequestFailure(FailureKind.INTERNAL, f"internal error (request {request_id})")
