"""A client's hang-up as ASGI's `http.disconnect`, however Serve reports it.

Behind Serve's proxy (the in-process Serve of the tests, `serve run`, or `pagedray serve` with
`RAY_SERVE_THROUGHPUT_OPTIMIZED=0`), the replica reads request messages from the proxy with a
Ray call; when the client goes, the proxy cancels that call and the app's `receive()` raises
Ray's TaskCancelledError instead of returning `http.disconnect`. Starlette's streaming response
then fails with it, and the ingress guard logged some 50 lines of traceback per disconnected
stream. Serve's own reader treats the proxy no longer knowing the request as a disconnect
(ray-project/ray#43290); this does the same for the cancelled call. With direct ingress
(`pagedray serve`'s default) uvicorn reports `http.disconnect` itself.
"""

from __future__ import annotations

from ray.exceptions import TaskCancelledError
from starlette.types import ASGIApp, Message, Receive, Scope, Send

_DISCONNECT: Message = {"type": "http.disconnect"}


class ClientDisconnect:
    """ASGI middleware: `receive()` answers `http.disconnect` from the first cancelled read on
    (ASGI's contract after a disconnect), so the app stops its stream as for any hang-up."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        gone = False

        async def receive_or_disconnect() -> Message:
            nonlocal gone
            if gone:
                return _DISCONNECT
            try:
                return await receive()
            except TaskCancelledError:
                gone = True
                return _DISCONNECT

        await self.app(scope, receive_or_disconnect, send)
