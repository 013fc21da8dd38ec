"""The ingress's perimeter: what every HTTP request passes before a route runs, and the net
under every route.

One ASGI middleware, so nothing reaches a route (the docs and the OpenAPI schema included)
without the API key, no body larger than the limit is ever held (413 from Content-Length, or
while a chunked body is read), and an exception no route handled is a 500 in OpenAI's error
shape carrying a request id, never a traceback (that goes to the log, under the same id).

A refusal that comes while the client is still sending its body is sent at once, and then the
rest of the body is read and dropped before the connection closes (nginx's lingering close,
bounded in bytes and time): a server that answered and closed at once would leave unread bytes
behind, which makes the kernel reset the connection, and a client that sends its whole body
before it reads (http.client, httpx, the SDKs) would see the reset, never the answer.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import secrets
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from starlette.routing import Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pagedray.openai.serving import error_response

logger = logging.getLogger(__name__)

DEFAULT_MAX_REQUEST_BODY_BYTES = 4 * 1024 * 1024
# How much of a refused body is read and dropped, and for how long, before the answer goes out
# anyway (and the connection is closed): enough for a client's honest mistake, bounded for abuse.
LINGER_MAX_BYTES = 64 * 1024 * 1024
LINGER_MAX_S = 10.0
# Answered without the API key: what a load balancer probes, and (as vLLM does) the metrics.
OPEN_PATHS = frozenset({"/health", "/ping", "/version", "/metrics"})
# What a body sent to an open path (a POST /ping) may hold: none of them reads one, and a client
# without the key must not make the ingress hold a generation's worth of body.
OPEN_PATH_MAX_BODY_BYTES = 4096
_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})


def api_key_digest(api_key: str) -> str:
    """What the ingress is given instead of the key: its SHA-256, hex."""
    return hashlib.sha256(api_key.encode("utf-8")).hexdigest()


def api_key_sha256_of(args: dict[str, Any]) -> str | None:
    """The key's digest from one of `api_key`, `api_key_file` (its stripped content) or
    `api_key_sha256` in `args`; None if none is given. Raises ValueError on two or an empty key."""
    given = [name for name in ("api_key", "api_key_file", "api_key_sha256") if args.get(name)]
    if len(given) > 1:
        raise ValueError(f"api_key: give one of {given}, not several")
    if "api_key_file" in given:
        key = Path(args["api_key_file"]).read_text(encoding="utf-8").strip()
        if not key:
            raise ValueError(f"api_key_file: {args['api_key_file']} is empty")
        return api_key_digest(key)
    if "api_key_sha256" in given:
        digest = str(args["api_key_sha256"]).lower()
        if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
            raise ValueError("api_key_sha256: must be 64 hex digits")
        return digest
    for name in ("api_key", "api_key_file", "api_key_sha256"):
        if name in args and args[name] is not None and not args[name]:
            raise ValueError(f"{name}: must not be empty")
    return api_key_digest(str(args["api_key"])) if given else None


@dataclass(frozen=True)
class GuardSettings:
    api_key_digest: str | None = None  # None: no key required
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES

    def __post_init__(self) -> None:
        if self.max_request_body_bytes < 1:
            raise ValueError(
                f"max_request_body_bytes: must be at least 1, got {self.max_request_body_bytes}"
            )


class IngressGuard:
    """API key, body size limit and the last-resort 500, for the app it wraps.

    `settings_of()` gives this replica's `GuardSettings` (read per request: the middleware is
    built before the replica). `routes` are the app's, to label a refused request with its
    route for the metrics middleware outside this one.
    """

    def __init__(
        self, app: ASGIApp, settings_of: Callable[[], GuardSettings], routes: list[Any]
    ) -> None:
        self.app = app
        self.settings_of = settings_of
        self.routes = routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        settings = self.settings_of()
        limit = settings.max_request_body_bytes
        if route_path(scope) in OPEN_PATHS:
            limit = min(limit, OPEN_PATH_MAX_BODY_BYTES)
        refusal = self._refusal(scope, settings, limit)
        body_pending = scope.get("method") in _BODY_METHODS
        if refusal is None and body_pending:
            body, refusal = await _read_body(receive, limit)
            if body is None and refusal is None:  # the client went away
                return
            body_pending = body is None
            receive = _replay(body or b"", receive)
        if refusal is not None:
            self._label_route(scope)
            lingering = body_pending and _header(scope, b"expect") != "100-continue"
            await _refuse(refusal, lingering, scope, receive, send)
            return
        await self._guarded(scope, receive, send)

    def _refusal(self, scope: Scope, settings: GuardSettings, limit: int) -> Any:
        digest = settings.api_key_digest
        open_path = route_path(scope) in OPEN_PATHS
        if digest is not None and not open_path and not _has_key(scope, digest):
            response = error_response(401, "invalid API key", "AuthenticationError")
            response.headers["WWW-Authenticate"] = "Bearer"
            return response
        declared = _header(scope, b"content-length")
        if declared is not None:
            if not declared.isdigit():
                return error_response(400, "body: invalid Content-Length", param="body")
            if int(declared) > limit:
                return _too_large(limit)
        return None

    async def _guarded(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception:
            request_id = f"req-{uuid.uuid4().hex}"
            logger.exception("request %s: %s %s failed", request_id, scope["method"], scope["path"])
            if not started:  # after the start, the client sees its stream cut short
                message = f"internal error (request {request_id})"
                response = error_response(500, message, "InternalServerError")
                await response(scope, receive, send)

    def _label_route(self, scope: Scope) -> None:
        """Set the route a refused request was for, as the router would have."""
        for route in self.routes:
            match, _ = route.matches(scope)
            if match == Match.FULL:
                scope["route"] = route
                return


async def http_error(request: Any, exc: Any) -> Any:
    """FastAPI's own HTTP errors (unknown path, wrong method) in OpenAI's error shape."""
    error_type = "NotFoundError" if exc.status_code == 404 else "BadRequestError"
    return error_response(exc.status_code, str(exc.detail), error_type)


def route_path(scope: Scope) -> str:
    """The path below the app's mount point (Serve mounts an app at its route prefix)."""
    path, root = scope.get("path", ""), scope.get("root_path", "")
    return path[len(root) :] if root and path.startswith(root) else path


async def _read_body(receive: Receive, limit: int) -> tuple[bytes | None, Any]:
    """The whole body, or (None, a 413) as soon as it passes `limit`; (None, None) on a
    disconnect. At most `limit` bytes plus one chunk are ever held."""
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None, None
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            return None, _too_large(limit)
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks), None


async def _refuse(
    refusal: Any, body_on_its_way: bool, scope: Scope, receive: Receive, send: Send
) -> None:
    """Send `refusal`; when the client may still be sending its body, read and drop the rest
    before the response ends (the connection then closes). A client that asked to be told
    before it sends (Expect: 100-continue) sends nothing once refused: nothing to wait for."""
    if not body_on_its_way:
        await refusal(scope, receive, send)
        return
    refusal.headers["Connection"] = "close"  # what is left of the body is not read as a request
    await send(
        {
            "type": "http.response.start",
            "status": refusal.status_code,
            "headers": refusal.raw_headers,
        }
    )
    # NOTE: the whole answer goes out now (its Content-Length says where it ends); the response
    # stays open only so that the server goes on reading the body, which it stops doing once a
    # response has ended.
    await send({"type": "http.response.body", "body": refusal.body, "more_body": True})
    await _drain(receive)
    await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _drain(receive: Receive) -> bool:
    """Read and drop the rest of a request body; True if it ended within `LINGER_MAX_BYTES`
    and `LINGER_MAX_S` (the connection is then clean), False if it did not or the client left.
    Only one chunk is held at a time."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + LINGER_MAX_S
    dropped = 0
    while dropped <= LINGER_MAX_BYTES:
        try:
            message = await asyncio.wait_for(receive(), deadline - loop.time())
        except asyncio.TimeoutError:
            return False
        if message["type"] == "http.disconnect":
            return False
        dropped += len(message.get("body", b""))
        if not message.get("more_body", False):
            return True
    return False


def _replay(body: bytes, receive: Receive) -> Receive:
    """A receive that gives the body read already, then the client's own messages."""
    delivered = False

    async def replay() -> Message:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


def _too_large(limit: int) -> Any:
    message = f"body: larger than the limit of {limit} bytes"
    return error_response(413, message, "RequestTooLargeError", param="body")


def _has_key(scope: Scope, digest: str) -> bool:
    """`Authorization: Bearer KEY` (OpenAI's clients) or `x-api-key: KEY` (Anthropic's)."""
    scheme, _, token = (_header(scope, b"authorization") or "").partition(" ")
    if scheme.lower() == "bearer":
        return secrets.compare_digest(api_key_digest(token.strip()), digest)
    key = _header(scope, b"x-api-key")
    return key is not None and secrets.compare_digest(api_key_digest(key.strip()), digest)


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", []):
        if key.lower() == name:
            return value.decode("latin-1")
    return None
