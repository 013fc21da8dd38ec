"""Errors on Anthropic's routes in Anthropic's shape: `{"type": "error", "error": {"type",
"message"}}`, the error type told by the status, as the `anthropic` SDK reads them.

Every layer of the ingress answers errors in OpenAI's shape (the guard's 401 and 413, a body's
400, the engine's 503, an unknown route's 404). Rather than teach each of them a second shape,
one middleware rewrites the error answers of the paths under `/v1/messages`, whoever made them.
Errors inside a stream are events, written by the stream itself (`error_event`).
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel
from starlette.types import ASGIApp, Message, Receive, Scope, Send

ANTHROPIC_PATH_PREFIX = "/v1/messages"
# Anthropic's error types by HTTP status (docs.anthropic.com, "Errors"); 503 is its overload.
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    504: "timeout_error",
}


class AnthropicErrorInfo(BaseModel):
    type: str
    message: str


class AnthropicErrorResponse(BaseModel):
    """An error answer on Anthropic's routes (declared in /openapi.json)."""

    type: str = "error"
    error: AnthropicErrorInfo


def anthropic_error_type(status: int) -> str:
    if status in _ERROR_TYPES:
        return _ERROR_TYPES[status]
    return "api_error" if status >= 500 else "invalid_request_error"


def anthropic_error(status: int, message: str) -> dict[str, Any]:
    """The error body (and a stream's `error` event's data) for `status`."""
    return {"type": "error", "error": {"type": anthropic_error_type(status), "message": message}}


def is_anthropic_path(path: str) -> bool:
    return path == ANTHROPIC_PATH_PREFIX or path.startswith(ANTHROPIC_PATH_PREFIX + "/")


class AnthropicErrors:
    """Rewrites OpenAI-shaped JSON error answers on Anthropic's paths; passes all else through.

    `path_of(scope)` is the path below the app's mount point. Only answers of status 400 and
    above with a JSON body are held (they are small); streams and successes pass untouched.
    """

    def __init__(self, app: ASGIApp, path_of: Any) -> None:
        self.app = app
        self.path_of = path_of

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not is_anthropic_path(self.path_of(scope)):
            await self.app(scope, receive, send)
            return
        start: Message | None = None
        body = bytearray()

        async def rewriting_send(message: Message) -> None:
            nonlocal start
            if message["type"] == "http.response.start" and _is_json_error(message):
                start = message
                return
            if start is None or message["type"] != "http.response.body":
                await send(message)
                return
            body.extend(message.get("body", b""))
            if not message.get("more_body", False):
                await _send_rewritten(send, start, bytes(body))

        await self.app(scope, receive, rewriting_send)


def _is_json_error(start: Message) -> bool:
    headers = dict(start.get("headers", []))
    content_type = headers.get(b"content-type", b"").split(b";")[0].strip()
    return start["status"] >= 400 and content_type == b"application/json"


async def _send_rewritten(send: Send, start: Message, body: bytes) -> None:
    status = start["status"]
    try:
        message = str(json.loads(body)["error"]["message"])
    except (ValueError, KeyError, TypeError):  # not OpenAI's shape: left as it is
        message = None
    if message is not None:
        body = json.dumps(anthropic_error(status, message)).encode()
    headers = [
        (key, str(len(body)).encode() if key.lower() == b"content-length" else value)
        for key, value in start.get("headers", [])
    ]
    await send({**start, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})
