"""OpenAI's Responses API (`/v1/responses`), served through the chat path; stored responses
(`previous_response_id`, retrieve, delete) live in the server's response store, which every
replica of a Serve deployment shares."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from pagedray.openai.protocol import ChatCompletionRequest
from pagedray.openai.response_objects import new_response_id
from pagedray.openai.responses_api import ResponsesRequest, to_chat_body
from pagedray.openai.responses_flow import (
    ResponseJob,
    in_responses_terms,
    response_events,
    whole_response,
)
from pagedray.openai.schema import request_body, responses
from pagedray.openai.server import OpenAIServer, openai_server
from pagedray.openai.serving import bad_request, engine_error_response, error_response
from pagedray.scheduler.request_failure import RequestFailure

router = APIRouter()


@router.post(
    "/v1/responses",
    openapi_extra=request_body(ResponsesRequest),
    responses=responses(None, stream=True),
)
async def create_response(raw: Request, server: OpenAIServer = Depends(openai_server)) -> Response:
    """A response, whole or streamed as the Responses API's events; `previous_response_id`
    continues a stored one, whichever replicas served it."""
    response_id = new_response_id()
    body = await server.generation_body(raw, ResponsesRequest, response_id)
    if isinstance(body, Response):
        return body
    history = None
    if body.previous_response_id is not None:
        record = await _stored(server, body.previous_response_id, "previous_response_id")
        if isinstance(record, Response):
            return record
        history = record["conversation"]
    chat_body = to_chat_body(body, history)
    try:
        chat = ChatCompletionRequest.model_validate({**chat_body, "stream": body.stream})
    except ValidationError as exc:
        return in_responses_terms(bad_request(exc))
    started = await server.start_chat(response_id, chat, split_reasoning=True)
    if isinstance(started, Response):
        return in_responses_terms(started)
    # The Response echoes the sampling the request got: the model's defaults where it set none,
    # and the output limit it ran with (a default, a cap, or the room left in the context), as
    # vLLM's does.
    defaults = server.validator.sampling_defaults
    unset = {name: defaults[name] for name in ("temperature", "top_p") if name in defaults}
    update: dict[str, Any] = {k: v for k, v in unset.items() if getattr(body, k) is None}
    ctx, streams = started
    limit = streams.params[0].max_tokens
    room = server.validator.max_model_len - ctx.num_prompt_tokens
    update["max_output_tokens"] = limit if limit is not None else room
    body = body.model_copy(update=update)
    job = ResponseJob(response_id, body, chat_body, ctx.model)
    save = server.save if body.store else None
    if body.stream:
        events = response_events(job, *started, save)
        return StreamingResponse(events, media_type="text/event-stream")
    result = await whole_response(job, *started, save)
    if isinstance(result, RequestFailure):
        return in_responses_terms(engine_error_response(result))
    return JSONResponse(result)


@router.get("/v1/responses/{response_id}", responses=responses(None, errors=(401, 404, 503)))
async def retrieve_response(
    response_id: str, server: OpenAIServer = Depends(openai_server)
) -> Response:
    record = await _stored(server, response_id, "response_id")
    return record if isinstance(record, Response) else JSONResponse(record["response"])


@router.delete("/v1/responses/{response_id}", responses=responses(None, errors=(401, 404, 503)))
async def delete_response(
    response_id: str, server: OpenAIServer = Depends(openai_server)
) -> Response:
    if not await server.delete_stored(response_id):
        return _not_found(response_id, "response_id")
    return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})


async def _stored(server: OpenAIServer, response_id: str, param: str) -> dict[str, Any] | Response:
    """A stored response's record, or the 404 that names `param`."""
    record = await server.stored(response_id)
    return record if record is not None else _not_found(response_id, param)


def _not_found(response_id: str, param: str) -> Response:
    message = f"{param}: no stored response {response_id!r} (never stored, expired or evicted)"
    return error_response(404, message, "NotFoundError", param=param)
