"""How a request can end other than by finishing, as a typed value that crosses every boundary
as itself: from the worker or scheduler that found it, through the engine, to the ingress, where
its kind becomes an HTTP status in one table (pagedray/openai/serving.py). Nothing below the
OpenAI layer chooses a status.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class FailureKind(str, Enum):
    """What kind of failure, as the client must act on it."""

    INVALID = "invalid"  # a field's value is bad: fix the request
    TOO_LONG = "too_long"  # the prompt, or prompt and max_tokens, past the context
    OVERLOADED = "overloaded"  # the engine's queue is full: retry later
    TIMEOUT = "timeout"  # past its deadline: aborted, its blocks freed
    ABORTED = "aborted"  # aborted from outside its own stream (an output channel closed)
    DEAD = "dead"  # the engine cannot serve (a dead rank, a failed step, the replica gone)
    INTERNAL = "internal"  # a fault of ours: the log has it under the request's id


@dataclass(frozen=True)
class RequestFailure:
    """One request's failure: its kind, the message a client sees (no internals), the field at
    fault (for INVALID and TOO_LONG), and when to retry (seconds, for a passing failure)."""

    kind: FailureKind
    message: str
    param: str | None = None
    retry_after_s: float | None = None


class RequestRefused(ValueError):
    """A request refused before it runs, naming the field at fault (`param`, the top-level field
    the client sent): a ValueError, so callers that catch those (the offline API, tests) see it
    as one. `detail` is the message without the field's name."""

    def __init__(
        self,
        message: str,
        param: str | None,
        kind: FailureKind = FailureKind.INVALID,
        detail: str | None = None,
    ):
        super().__init__(message)
        self.param = param
        self.kind = kind
        self.detail = message if detail is None else detail

    def failure(self) -> RequestFailure:
        return RequestFailure(self.kind, str(self), self.param)


def refusal(field: str, detail: str, kind: FailureKind = FailureKind.INVALID) -> RequestRefused:
    """The refusal "field: detail" of the field at `field` (a path such as
    "structured_outputs.json" or "messages.0.content"), whose param is its top-level field."""
    top = field.split(".", 1)[0]
    return RequestRefused(f"{field}: {detail}", top if top.isidentifier() else None, kind, detail)
