"""`POST /tokenize` and `POST /detokenize` (vLLM's): the model's tokenizer, bounded by the
engines' context length."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from pagedray.openai.answer_models import DetokenizeResponse, TokenizeResponse
from pagedray.openai.prompts import detokenize, tokenize
from pagedray.openai.protocol import DetokenizeRequest, TokenizeRequest
from pagedray.openai.routes.answer_responses import json_answer
from pagedray.openai.schema import request_body, responses
from pagedray.openai.server import OpenAIServer, openai_server
from pagedray.openai.serving import bad_request

router = APIRouter()


@router.post(
    "/tokenize",
    openapi_extra=request_body(TokenizeRequest),
    responses=responses(TokenizeResponse, errors=(400, 401, 404, 413, 500)),
)
async def tokenize_text(raw: Request, server: OpenAIServer = Depends(openai_server)) -> Response:
    body = await server.parse(raw, TokenizeRequest)
    if isinstance(body, Response):
        return body
    max_model_len = await server.learn_limits()
    try:
        tokens = await server.in_thread(tokenize, server.validator, body)
    except ValueError as exc:
        return bad_request(exc)
    return json_answer(
        TokenizeResponse(tokens=tokens, count=len(tokens), max_model_len=max_model_len)
    )


@router.post(
    "/detokenize",
    openapi_extra=request_body(DetokenizeRequest),
    responses=responses(DetokenizeResponse, errors=(400, 401, 404, 413, 500)),
)
async def detokenize_tokens(
    raw: Request, server: OpenAIServer = Depends(openai_server)
) -> Response:
    body = await server.parse(raw, DetokenizeRequest)
    if isinstance(body, Response):
        return body
    try:
        text = await server.in_thread(detokenize, server.validator, body)
    except ValueError as exc:
        return bad_request(exc)
    return json_answer(DetokenizeResponse(prompt=text))
