"""Serving helpers: usage, logprob formats, SSE framing, error JSON, and the middleware that
records the ingress's metrics. The engine streams themselves are in `engine_streams.py`.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Protocol

from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pagedray.engine.output_processor import ChoiceDelta
from pagedray.engine.wire import RequestStepOutput
from pagedray.openai.answer_models import (
    ChatTokenLogprob,
    CompletionLogprobs,
    CompletionTokensDetails,
    PromptLogprob,
    PromptTokensDetails,
    TopLogprob,
    UsageInfo,
)
from pagedray.scheduler.request_failure import FailureKind, RequestFailure, RequestRefused


class IngressMetrics(Protocol):
    """What the middleware records into: Ray's metrics in the served ingress
    (cluster/ingress_metrics.py, whose `IngressMetrics` this describes), injected, so this layer
    imports no Ray."""

    def record(self, route: str, status: int, latency: float) -> None: ...


logger = logging.getLogger(__name__)
# Seconds a client is told to wait after a 503 that names no time of its own.
DEFAULT_RETRY_AFTER_S = 1


@dataclass
class UsageCounter:
    """Usage summed over a request's prompts, from each one's last output."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    num_finished: int = 0
    reasoning_tokens: int | None = None  # counted by the answer, with a --reasoning-parser

    def add(self, output: RequestStepOutput) -> None:
        if output.usage is None:
            return
        self.num_finished += 1
        self.prompt_tokens += output.usage["prompt_tokens"]
        self.completion_tokens += output.usage["completion_tokens"]
        self.cached_tokens += output.usage["cached_tokens"]

    def info(self) -> UsageInfo:
        return UsageInfo(
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion_tokens,
            total_tokens=self.prompt_tokens + self.completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=self.cached_tokens),
            completion_tokens_details=(
                None
                if self.reasoning_tokens is None
                else CompletionTokensDetails(reasoning_tokens=self.reasoning_tokens)
            ),
        )


class LogprobFormatter:
    """Token logprobs in the completions and chat formats (token strings decoded one by one).

    A token that is only part of a UTF-8 character decodes to U+FFFD on its own, so several such
    tokens would share one string and collide as keys of a completions `top_logprobs` dict.
    As OpenAI does, they are named by their bytes instead (`bytes:\\xe2\\x80`), and chat's
    `bytes` field carries the token's real bytes.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._token_strs: dict[int, str] = {}
        self._token_bytes: dict[int, bytes] = {}
        self.by_id = False  # tokens named "token_id:<id>" (vLLM's return_tokens_as_token_ids)

    def named_by_id(self) -> LogprobFormatter:
        """The same formatter (and caches), its tokens named "token_id:<id>", as vLLM's
        `return_tokens_as_token_ids` names them: ids any client can map back, where a token's
        text may not survive JSON."""
        named = copy.copy(self)
        named.by_id = True
        return named

    def name(self, token_id: int) -> str:
        return f"token_id:{token_id}" if self.by_id else self.token_str(token_id)

    def token_str(self, token_id: int) -> str:
        text = self._token_strs.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id])
            if "\ufffd" in text:
                raw = self.token_bytes(token_id)
                try:
                    raw.decode("utf-8")
                except UnicodeDecodeError:  # part of a character: named by its bytes
                    text = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
            self._token_strs[token_id] = text
        return text

    def token_bytes(self, token_id: int) -> bytes:
        raw = self._token_bytes.get(token_id)
        if raw is None:
            raw = _token_bytes(self.tokenizer, token_id)
            self._token_bytes[token_id] = raw
        return raw

    def completion(self, delta: ChoiceDelta, text_offset: int) -> CompletionLogprobs:
        result = CompletionLogprobs()
        for token_id, entries in zip(delta.token_ids, map(_finite, delta.logprobs or [])):
            result.tokens.append(self.name(token_id))
            result.token_logprobs.append(entries.get(token_id))
            result.top_logprobs.append({self.name(t): lp for t, lp in entries.items()})
            result.text_offset.append(text_offset)
            text_offset += _text_length(self.token_str(token_id))
        return result

    def prompt(
        self, token_ids: list[int], prompt_logprobs: list[dict[int, float] | None]
    ) -> CompletionLogprobs:
        """An echoed prompt's tokens: the first has no logprob (nothing precedes it)."""
        result = CompletionLogprobs()
        text_offset = 0
        finite = [None if entries is None else _finite(entries) for entries in prompt_logprobs]
        for token_id, entries in zip(token_ids, finite):
            result.tokens.append(self.name(token_id))
            result.token_logprobs.append(None if entries is None else entries.get(token_id))
            result.top_logprobs.append(
                None if entries is None else {self.name(t): lp for t, lp in entries.items()}
            )
            result.text_offset.append(text_offset)
            text_offset += _text_length(self.token_str(token_id))
        return result

    def chat(self, delta: ChoiceDelta, num_top: int) -> list[ChatTokenLogprob]:
        result = []
        for token_id, entries in zip(delta.token_ids, map(_finite, delta.logprobs or [])):
            # The entries hold the sampled token and the top k: the best k of them are the top k.
            top = sorted(entries.items(), key=lambda item: -item[1])[:num_top]
            result.append(
                ChatTokenLogprob(
                    **self._top(token_id, entries.get(token_id, float("-inf"))).model_dump(),
                    top_logprobs=[self._top(t, lp) for t, lp in top],
                )
            )
        return result

    def prompt_entries(self, delta: ChoiceDelta) -> list[dict[str, PromptLogprob] | None] | None:
        """vLLM's `prompt_logprobs` of a delta that carries the prompt's: per prompt token
        (None for the first), the token's own entry (with its rank) and the top ones' (ranked
        by logprob), keyed by token id."""
        if not delta.prompt_logprobs:
            return None
        ranks = delta.prompt_ranks or [None] * len(delta.prompt_logprobs)
        result: list[dict[str, PromptLogprob] | None] = []
        for entries, rank in zip(delta.prompt_logprobs, ranks):
            if entries is None:
                result.append(None)
                continue
            token_id, *_ = entries  # the prompt token's own entry comes first
            ranked = sorted(entries.items(), key=lambda item: -item[1])
            result.append(
                {
                    str(t): PromptLogprob(
                        logprob=max(lp, MIN_LOGPROB),
                        rank=rank if t == token_id else position,
                        decoded_token=self.tokenizer.decode([t]),  # as vLLM's: as it decodes
                    )
                    for position, (t, lp) in enumerate(ranked, start=1)
                }
            )
        return result

    def _top(self, token_id: int, logprob: float) -> TopLogprob:
        token = self.name(token_id)
        return TopLogprob(token=token, logprob=logprob, bytes=list(self.token_bytes(token_id)))


# A token the grammar (or logit_bias) ruled out has logprob -inf, which JSON cannot carry (it
# would go out as null): vLLM's floor instead.
MIN_LOGPROB = -9999.0


def _finite(entries: dict[int, float]) -> dict[int, float]:
    return {token_id: max(logprob, MIN_LOGPROB) for token_id, logprob in entries.items()}


def _text_length(token: str) -> int:
    """Characters a token adds to the text: a `bytes:` name stands for one U+FFFD there."""
    return 1 if token.startswith("bytes:") else len(token)


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet, character -> byte (the inverse of bytes_to_unicode)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


_BYTE_LEVEL = _byte_level_alphabet()


def _token_bytes(tokenizer: Any, token_id: int) -> bytes:
    """The bytes one token stands for: its decoded text where that is whole characters; else
    read from its piece, SentencePiece byte fallback (`<0xA1>`) or byte-level BPE (GPT-2,
    Llama 3, Qwen)."""
    text = tokenizer.decode([token_id])
    if "\ufffd" not in text:
        return text.encode("utf-8")
    piece = tokenizer.convert_ids_to_tokens(token_id)
    if isinstance(piece, str):
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            with contextlib.suppress(ValueError):
                return bytes([int(piece[3:5], 16)])
        if piece and all(c in _BYTE_LEVEL for c in piece):
            return bytes(_BYTE_LEVEL[c] for c in piece)
    return text.encode("utf-8")


# Characters JSON leaves unescaped that many clients' line readers (httpx's `iter_lines`, any
# `str.splitlines`) take for line breaks: raw in a streamed text, they cut the event's JSON in
# two. Escaped, the JSON decodes to the same text and every event stays one line.
LINE_BREAKS_IN_JSON = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def sse(payload: BaseModel | dict[str, Any]) -> str:
    """One server-sent event, as OpenAI frames them, on one line for any line reader."""
    if isinstance(payload, BaseModel):
        data = payload.model_dump_json()
    else:
        data = json.dumps(payload)
    return f"data: {data.translate(LINE_BREAKS_IN_JSON)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def error_response(
    status: int, message: str, error_type: str = "BadRequestError", param: str | None = None
) -> JSONResponse:
    """OpenAI's error shape: {"error": {"message", "type", "param", "code"}}."""
    error = {"message": message, "type": error_type, "param": param, "code": status}
    return JSONResponse({"error": error}, status_code=status)


def bad_request(exc: Exception) -> JSONResponse:
    """400 from a pydantic error or a `RequestRefused`, naming the field as param (the
    top-level field: the message keeps the full location)."""
    if isinstance(exc, ValidationError):
        first = exc.errors()[0]
        refused = first.get("ctx", {}).get("error")
        if isinstance(refused, RequestRefused):  # raised by one of the model's validators
            return error_response(400, str(refused), param=refused.param)
        message = str(first["msg"]).removeprefix("Value error, ")
        loc = ".".join(str(part) for part in first["loc"])
        if loc:
            return error_response(400, f"{loc}: {message}", param=str(first["loc"][0]))
        return error_response(400, message)
    if isinstance(exc, RequestRefused):
        return error_response(400, str(exc), param=exc.param)
    return error_response(400, str(exc))


def renamed_fields(response: Response, fields: dict[str, str]) -> Response:
    """A chat route's 400, for an API that reaches the chat path under other field names
    (`fields`: chat's name -> that API's): its `param` and message name the client's field."""
    if response.status_code != 400:
        return response
    error = json.loads(bytes(response.body))["error"]
    field = fields.get(error.get("param") or "")
    if field is None:
        return response
    message = error["message"].replace("'max_tokens' or 'max_completion_tokens'", f"'{field}'")
    for chat_field in fields:
        if message.startswith(f"{chat_field}:") or message.startswith(f"{chat_field}."):
            message = field + message[len(chat_field) :]
    return error_response(400, message, error["type"], param=field)


# The one table from a request's failure to HTTP: its status and OpenAI's error type.
HTTP_OF_FAILURE: dict[FailureKind, tuple[int, str]] = {
    FailureKind.INVALID: (400, "BadRequestError"),
    FailureKind.TOO_LONG: (400, "BadRequestError"),
    FailureKind.OVERLOADED: (503, "ServiceUnavailableError"),
    FailureKind.TIMEOUT: (504, "TimeoutError"),
    FailureKind.ABORTED: (503, "ServiceUnavailableError"),
    FailureKind.DEAD: (503, "ServiceUnavailableError"),
    FailureKind.INTERNAL: (500, "InternalServerError"),
}


def failure_status(failure: RequestFailure) -> int:
    return HTTP_OF_FAILURE[failure.kind][0]


def failure_error(failure: RequestFailure) -> dict[str, Any]:
    """OpenAI's error object for a failure (an error body's, or a stream's error event's)."""
    status, error_type = HTTP_OF_FAILURE[failure.kind]
    return {"message": failure.message, "type": error_type, "param": failure.param, "code": status}


def engine_error_response(failure: RequestFailure) -> JSONResponse:
    """A request's failure as HTTP; a 503, or one that says when, tells the client when to
    retry (Retry-After)."""
    status, error_type = HTTP_OF_FAILURE[failure.kind]
    response = error_response(status, failure.message, error_type, failure.param)
    retry_after = failure.retry_after_s
    if retry_after is None and status == 503:
        retry_after = DEFAULT_RETRY_AFTER_S
    if retry_after is not None:
        response.headers["Retry-After"] = str(max(0, int(retry_after)))
    return response


class HTTPMetricsMiddleware:
    """Counts and times every request a route answers, into `metrics_of()`'s `IngressMetrics`.

    Plain ASGI rather than a route wrapper: it sees the status of every answer (errors included),
    a stream ends when its last chunk is sent, and an exception is Starlette's 500. Requests no
    route matches (unknown paths) are not counted: their paths would be unbounded label values.
    """

    def __init__(self, app: ASGIApp, metrics_of: Callable[[], IngressMetrics]) -> None:
        self.app = app
        self.metrics_of = metrics_of

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500  # until a response starts
        recorded = False

        def record() -> None:
            nonlocal recorded
            route = getattr(scope.get("route"), "path", None)  # the router sets it on a match
            if route is not None and not recorded:
                self.metrics_of().record(route, status, time.perf_counter() - start)
            recorded = True

        async def send_and_record(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                record()

        try:
            await self.app(scope, receive, send_and_record)
        except Exception:
            # NOTE: before the response started, Starlette answers 500; after, the client keeps
            # the status it was sent (a stream cut short). A cancelled request is not answered.
            record()
            raise
