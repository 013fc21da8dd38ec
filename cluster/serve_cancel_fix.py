"""A fix for Ray Serve 2.60 losing a hung-up request's access line, metrics and child cancels.

When a client hangs up, Serve's replica cancels the request's child calls (our engine calls) by
iterating the dicts that track them (`Replica._on_request_cancelled`). Cancelling a gRPC call
(Serve's transport under direct ingress, `pagedray serve`'s default) can run its done callback
at once, and that callback removes the call from the same dict: `RuntimeError: dictionary
changed size during iteration`. The error escapes Serve's request wrapper, so that request gets
no access log line and no request metrics, and its other children are not cancelled. It hit
about one dropped stream in 30 here. Behind Serve's proxy the router's thread can change the
other dict (calls still being routed) mid-iteration in the same way. Iterating copies fixes both.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import ray.serve._private.replica as serve_replica
import ray.serve.context as serve_context

logger = logging.getLogger(__name__)
_INSTALLED = "_pagedray_iterates_a_copy"
# (module, name) of each lookup `_on_request_cancelled` iterates the result of.
_LOOKUPS = (
    (serve_replica, "_get_in_flight_requests"),
    (serve_context, "_get_requests_pending_assignment"),
)


def install_serve_cancel_fix() -> None:
    """Make the replica cancel copies of the children's dicts (idempotent, per process)."""
    for module, name in _LOOKUPS:
        lookup = getattr(module, name, None)
        if lookup is None:  # another Ray than the pinned one: nothing to fix here, or not so
            logger.warning("Serve has no %s.%s: cancel fix not installed", module.__name__, name)
            continue
        if not getattr(lookup, _INSTALLED, False):
            setattr(module, name, _copying(lookup))


def _copying(lookup: Callable[[str], dict[str, Any]]) -> Callable[[str], dict[str, Any]]:
    def copy_of(parent_request_id: str) -> dict[str, Any]:
        return dict(lookup(parent_request_id))

    setattr(copy_of, _INSTALLED, True)
    copy_of.__wrapped__ = lookup  # type: ignore[attr-defined]
    return copy_of
