"""`POST /v1/completions`: one engine request per prompt of a batch, answered whole or streamed."""

from __future__ import annotations

import uuid

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from pagedray.openai.answer_models import CompletionResponse
from pagedray.openai.answers import AnswerContext, completion_chunks, completion_response
from pagedray.openai.prompts import completion_prompts
from pagedray.openai.protocol import CompletionRequest
from pagedray.openai.request_ids import answer_id_and_engine_suffix
from pagedray.openai.routes.answer_responses import event_stream, json_answer
from pagedray.openai.schema import request_body, responses
from pagedray.openai.server import OpenAIServer, openai_server
from pagedray.openai.serving import bad_request, error_response

router = APIRouter()


@router.post(
    "/v1/completions",
    openapi_extra=request_body(CompletionRequest),
    responses=responses(CompletionResponse, stream=True),
)
async def completions(raw: Request, server: OpenAIServer = Depends(openai_server)) -> Response:
    request_id = f"cmpl-{uuid.uuid4().hex}"
    body = await server.generation_body(raw, CompletionRequest, request_id)
    if isinstance(body, Response):
        return body
    try:
        answer_id, suffix = answer_id_and_engine_suffix(raw.headers, body.request_id, request_id)
    except ValueError as exc:
        return bad_request(exc)
    await server.learn_limits()
    num_prompts, queue = len(body.prompts()), await server.max_num_waiting()
    if queue is not None and num_prompts > queue:  # its requests could never all queue
        message = f"prompt: a batch of {num_prompts} prompts is over the engine's queue of {queue}"
        return error_response(400, message, param="prompt")
    try:
        params, prompts, echo = await server.in_thread(completion_prompts, server.validator, body)
    except ValueError as exc:
        return bad_request(exc)
    ctx = AnswerContext(
        request_id=answer_id,
        model=server.answer_model(body.model),
        n=body.n,
        num_prompts=len(prompts),
        logprobs=server.logprob_formatter(body),
        num_logprobs=body.logprobs,
        include_usage=body.include_usage or server.config.enable_force_include_usage,
        echo=echo,
        echo_token_ids=[p.token_ids for p in prompts] if body.echo else None,
        prompt_token_ids=[p.token_ids for p in prompts] if body.return_token_ids else None,
    )
    try:
        thinking_ends = server.thinking_ends(prompts, params[0])
    except ValueError as exc:
        return bad_request(exc)
    streams = await server.open(
        answer_id,
        prompts,
        params,
        body.priority,
        body.stream,
        thinking_ends,
        suffix,
        server.lora_name(body.model),
    )
    if isinstance(streams, Response):
        return streams
    if body.stream:
        return event_stream(completion_chunks(ctx, streams))
    return json_answer(await completion_response(ctx, streams))
