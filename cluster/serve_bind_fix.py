"""A fix for Ray Serve 2.60's direct ingress failing to listen on a port in TIME_WAIT.

Under direct ingress (`pagedray serve`'s default) the ingress replica listens on the API port
itself, on a socket Serve makes and binds without SO_REUSEADDR (`http_util.start_asgi_http_server`,
called by `Replica._maybe_start_direct_ingress_servers`). A server that stopped while a client
held a keep-alive connection leaves that connection in TIME_WAIT for a minute, and until then such
a bind fails with EADDRINUSE: the replica then blocks the port in the controller's allocator, and
with the one-port range `pagedray serve` gives it every later replica fails too
(`NoAvailablePortError`). A restart soon after a stop never served. With SO_REUSEADDR the bind
succeeds through TIME_WAIT (Linux asks it of both sockets: the new one and the stopped server's,
which had it too, being this fix's) and still fails while another socket listens there;
SO_REUSEPORT, which lets several servers share the port, is set only where the ingress replicas
share the API port on purpose (cluster/shared_api_port.py). The replica starts its
server after our constructor has run, so the constructor installs this in time.
"""

from __future__ import annotations

import logging
import socket
from typing import Any, Callable

import ray.serve._private.http_util as serve_http_util
import ray.serve._private.replica as serve_replica

from pagedray.cluster.shared_api_port import sharing

logger = logging.getLogger(__name__)
_INSTALLED = "_pagedray_reuses_address"
_NAME = "start_asgi_http_server"  # as replica.py imports it from http_util


class _AddressReusingSockets:
    """The `socket` module as `http_util` sees it while it starts the replica's server: the
    same, but each socket it makes has SO_REUSEADDR set before it is bound."""

    def __getattr__(self, name: str) -> Any:
        return getattr(socket, name)

    @staticmethod
    def socket(*args: Any, **kwargs: Any) -> socket.socket:
        sock = socket.socket(*args, **kwargs)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if sharing():  # every ingress replica listens on the API port (shared_api_port.py)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        return sock


def install_serve_bind_fix() -> None:
    """Make this replica's direct-ingress server reuse its address (idempotent, per process)."""
    start = getattr(serve_replica, _NAME, None)
    if start is None or getattr(serve_http_util, "socket", None) is not socket:
        logger.warning("Serve has no %s to patch: bind fix not installed", _NAME)
        return
    if not getattr(start, _INSTALLED, False):
        setattr(serve_replica, _NAME, _reusing_address(start))


def _reusing_address(start: Callable[..., Any]) -> Callable[..., Any]:
    async def start_reusing_address(*args: Any, **kwargs: Any) -> Any:
        # NOTE: Serve's function makes and binds its socket before its first await, so no other
        # coroutine runs while `http_util` sees the substitute, and nothing else there makes one.
        serve_http_util.socket = _AddressReusingSockets()  # type: ignore[assignment]
        try:
            return await start(*args, **kwargs)
        finally:
            serve_http_util.socket = socket

    setattr(start_reusing_address, _INSTALLED, True)
    start_reusing_address.__wrapped__ = start  # type: ignore[attr-defined]
    return start_reusing_address
