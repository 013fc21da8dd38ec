"""The ingress's Anthropic routes: `POST /v1/messages` and `POST /v1/messages/count_tokens`.

A mixin of `OpenAIIngress` (Serve's class-based routes find methods of any base class), with its
own router, which the ingress's app includes. A Messages request becomes a chat request and goes
through the chat path (`IngressBase._start_chat`): admission, routing, tool constraints and
metrics apply unchanged. Its errors are put in Anthropic's shape by `AnthropicErrors`.
"""

# NOTE: no `from __future__ import annotations`, as in ingress_deployment.py: FastAPI must
# resolve the routes' annotations (`Request`) wherever Serve unpickles them.
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from pagedray.cluster.ingress_base import IngressBase
from pagedray.openai.anthropic_api import (
    CHAT_TO_ANTHROPIC_FIELDS,
    CountTokensRequest,
    MessagesRequest,
    to_chat_body,
)
from pagedray.openai.anthropic_errors import AnthropicErrorResponse
from pagedray.openai.anthropic_flow import message_events, new_message_id, whole_message
from pagedray.openai.prompts import count_chat_tokens
from pagedray.openai.protocol import ChatCompletionRequest
from pagedray.openai.schema import request_body, responses
from pagedray.openai.serving import bad_request, engine_error_response, renamed_fields
from pagedray.scheduler.request_failure import RequestFailure

router = APIRouter()


def _chat_request(body: dict[str, Any], stream: bool = False) -> ChatCompletionRequest | Response:
    try:
        return ChatCompletionRequest.model_validate({**body, "stream": stream})
    except ValidationError as exc:
        return renamed_fields(bad_request(exc), CHAT_TO_ANTHROPIC_FIELDS)


class AnthropicRoutes(IngressBase):
    """Anthropic's Messages API on the chat path (see `pagedray/openai/anthropic_api.py`)."""

    @router.post(
        "/v1/messages",
        openapi_extra=request_body(MessagesRequest),
        responses=responses(None, stream=True, error_model=AnthropicErrorResponse),
    )
    async def create_message(self, raw: Request) -> Response:
        """A Message, whole or streamed as Anthropic's events (`stream: true`)."""
        message_id = new_message_id()
        not_ready = await self.control.not_ready(message_id)
        if not_ready is not None:
            return not_ready
        body = await self._parse(raw, MessagesRequest)
        if isinstance(body, Response):
            return body
        chat = _chat_request(to_chat_body(body), body.stream)
        if isinstance(chat, Response):
            return chat
        started = await self._start_chat(message_id, chat)
        if isinstance(started, Response):
            return renamed_fields(started, CHAT_TO_ANTHROPIC_FIELDS)
        ctx, streams = started
        if body.stream:
            events = message_events(message_id, ctx, streams)
            return StreamingResponse(events, media_type="text/event-stream")
        message = await whole_message(message_id, ctx, streams)
        if isinstance(message, RequestFailure):
            return engine_error_response(message)
        return JSONResponse(message)

    @router.post(
        "/v1/messages/count_tokens",
        openapi_extra=request_body(CountTokensRequest),
        responses=responses(
            None, errors=(400, 401, 404, 413, 500, 503), error_model=AnthropicErrorResponse
        ),
    )
    async def count_message_tokens(self, raw: Request) -> Response:
        """`{"input_tokens": N}`: the conversation, system prompt and tools as the chat template
        renders them, counted by the model's tokenizer."""
        body = await self._parse(raw, CountTokensRequest)
        if isinstance(body, Response):
            return body
        chat = _chat_request(to_chat_body(body))
        if isinstance(chat, Response):
            return chat
        await self._learn_limits()
        try:
            count = await self._in_thread(count_chat_tokens, self.validator, chat)
        except ValueError as exc:
            return renamed_fields(bad_request(exc), CHAT_TO_ANTHROPIC_FIELDS)
        return JSONResponse({"input_tokens": count})
