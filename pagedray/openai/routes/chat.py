"""`POST /v1/chat/completions`: a conversation through the chat template, answered whole or
streamed, with tool calls parsed from the text."""

from __future__ import annotations

import uuid

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from pagedray.openai.answer_models import ChatCompletionResponse
from pagedray.openai.answers import chat_chunks, chat_response
from pagedray.openai.protocol import ChatCompletionRequest
from pagedray.openai.request_ids import answer_id_and_engine_suffix
from pagedray.openai.routes.answer_responses import event_stream, json_answer
from pagedray.openai.schema import request_body, responses
from pagedray.openai.server import OpenAIServer, openai_server
from pagedray.openai.serving import bad_request

router = APIRouter()


@router.post(
    "/v1/chat/completions",
    openapi_extra=request_body(ChatCompletionRequest),
    responses=responses(ChatCompletionResponse, stream=True),
)
async def chat_completions(raw: Request, server: OpenAIServer = Depends(openai_server)) -> Response:
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    body = await server.generation_body(raw, ChatCompletionRequest, request_id)
    if isinstance(body, Response):
        return body
    try:
        answer_id, suffix = answer_id_and_engine_suffix(raw.headers, body.request_id, request_id)
    except ValueError as exc:
        return bad_request(exc)
    started = await server.start_chat(answer_id, body, split_reasoning=True, engine_suffix=suffix)
    if isinstance(started, Response):
        return started
    ctx, streams = started
    if body.stream:
        return event_stream(chat_chunks(ctx, streams))
    return json_answer(await chat_response(ctx, streams))
