"""How an engine request can end other than by finishing: each a type of its own, which the engine
deployment maps to an HTTP status (cluster/engine_deployment.py), so no failure reaches a client
as a generic 500 or, worse, as a 200 with an error inside.
"""

from __future__ import annotations


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
    """The engine ended this request alone with an error (e.g. its sampling failed)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
