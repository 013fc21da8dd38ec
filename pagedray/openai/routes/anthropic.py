"""Anthropic's Messages API: `POST /v1/messages` and `POST /v1/messages/count_tokens`.

A Messages request becomes a chat request and goes through the chat path
(`OpenAIServer.start_chat`): admission, routing, tool constraints and metrics apply unchanged.
Its errors are put in Anthropic's shape by `AnthropicErrors` (openai/anthropic_errors.py).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

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
from pagedray.openai.server import OpenAIServer, openai_server
from pagedray.openai.serving import bad_request, engine_error_response, renamed_fields
from pagedray.scheduler.request_failure import RequestFailure

router = APIRouter()


@router.post(
    "/v1/messages",
    openapi_extra=request_body(MessagesRequest),
    responses=responses(None, stream=True, error_model=AnthropicErrorResponse),
)
async def create_message(raw: Request, server: OpenAIServer = Depends(openai_server)) -> Response:
    """A Message, whole or streamed as Anthropic's events (`stream: true`)."""
    message_id = new_message_id()
    body = await server.generation_body(raw, MessagesRequest, message_id)
    if isinstance(body, Response):
        return body
    chat = _chat_request(to_chat_body(body), body.stream)
    if isinstance(chat, Response):
        return chat
    if not server.keeps_thinking_budgets:  # a client's budget is no error where none is kept
        chat.thinking_token_budget = None
    started = await server.start_chat(message_id, chat, split_reasoning=True)
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
async def count_message_tokens(
    raw: Request, server: OpenAIServer = Depends(openai_server)
) -> Response:
    """`{"input_tokens": N}`: the conversation, system prompt and tools as the chat template
    renders them, counted by the model's tokenizer."""
    body = await server.parse(raw, CountTokensRequest)
    if isinstance(body, Response):
        return body
    chat = _chat_request(to_chat_body(body))
    if isinstance(chat, Response):
        return chat
    await server.learn_limits()
    try:
        count = await server.in_thread(count_chat_tokens, server.validator, chat)
    except ValueError as exc:
        return renamed_fields(bad_request(exc), CHAT_TO_ANTHROPIC_FIELDS)
    return JSONResponse({"input_tokens": count})


def _chat_request(body: dict[str, Any], stream: bool = False) -> ChatCompletionRequest | Response:
    try:
        return ChatCompletionRequest.model_validate({**body, "stream": stream})
    except ValidationError as exc:
        return renamed_fields(bad_request(exc), CHAT_TO_ANTHROPIC_FIELDS)
