"""Request ids a client chooses, as vLLM's server takes them: the body's `request_id` (vLLM's
extension of chat and completions), else the `X-Request-Id` header, names the answer
(`chatcmpl-<id>`, `cmpl-<id>`), so a client or the proxy in front can find a request in the logs
by an id of its own. (vLLM reads the header first; behind Serve every request has one, Serve's
proxy's, so the body's, always the client's own, comes first here.) With
`--enable-request-id-headers`, every answer carries an `X-Request-Id` header too: the one its
request sent, else a new one; behind Serve, its proxy sends that header on every answer.

Two requests may send the same id (a retry, a client's bug; Serve's proxy sends its own, unique,
with every request): the engine's own ids, which must be unique, add a random suffix to a
client's. The request log shows the client's (as vLLM's), so that its lines and the answer
share an id.
"""

from __future__ import annotations

import re
import uuid
from typing import Callable

from starlette.datastructures import Headers, MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pagedray.scheduler.request_failure import refusal

HEADER = "X-Request-Id"
MAX_LENGTH = 256
# Visible ASCII only: an id goes into log lines, where a newline or a control character would
# forge or hide one.
PATTERN = r"^[\x21-\x7e]+$"


def answer_id_and_engine_suffix(
    headers: Headers, body_id: str | None, own_id: str
) -> tuple[str, str]:
    """(the answer's id, what the engine's ids add to it) for a request: a client's id, after
    `own_id`'s prefix (up to its "-"), and a random suffix; else `own_id`, and nothing. Raises
    ValueError for a header id past `MAX_LENGTH` or `PATTERN` (the body's is held to them by its
    schema)."""
    chosen = body_id or headers.get(HEADER) or None  # an empty header is none
    if chosen is None:
        return own_id, ""
    prefix = own_id.split("-", 1)[0] + "-"
    if len(chosen) > MAX_LENGTH or not re.match(PATTERN, chosen):
        raise refusal(HEADER, f"1 to {MAX_LENGTH} visible ASCII characters")
    return f"{prefix}{chosen}", f"-{uuid.uuid4().hex[:8]}"


class RequestIdHeaders:
    """ASGI middleware: the `X-Request-Id` header on every answer, while `enabled_of()`."""

    def __init__(self, app: ASGIApp, enabled_of: Callable[[], bool]) -> None:
        self.app = app
        self.enabled_of = enabled_of

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.enabled_of():
            await self.app(scope, receive, send)
            return
        request_id = Headers(scope=scope).get(HEADER) or uuid.uuid4().hex

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message).append(HEADER, request_id)
            await send(message)

        await self.app(scope, receive, send_with_id)
