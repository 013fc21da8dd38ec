"""What operators and clients ask of the server itself: the served models, health (and vLLM's
`/ping`), the version, the engines' statistics and Prometheus metrics."""

from __future__ import annotations

import uuid
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as package_version

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse, Response

from pagedray.openai.answer_models import ModelCard, ModelList
from pagedray.openai.routes.answer_responses import json_answer
from pagedray.openai.schema import responses
from pagedray.openai.server import OpenAIServer, openai_server
from pagedray.openai.serving import engine_error_response, error_response
from pagedray.scheduler.request_failure import RequestFailure

router = APIRouter()


def pagedray_version() -> str:
    """The installed package's version ("unknown" from a source tree never installed)."""
    try:
        return package_version("pagedray")
    except PackageNotFoundError:
        return "unknown"


# vLLM's Prometheus content type.
PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


@router.get("/v1/models", responses=responses(ModelList, errors=(401, 503)))
async def models(server: OpenAIServer = Depends(openai_server)) -> Response:
    """Every served name, with the engine's real max_model_len; 503 until the engine serves
    (clients take a 200 here to mean they may send requests)."""
    cards = await server.model_cards(f"models-{uuid.uuid4().hex}")
    return cards if isinstance(cards, Response) else json_answer(ModelList(data=cards))


@router.get("/v1/models/{model_id:path}", responses=responses(ModelCard, errors=(401, 404, 503)))
async def retrieve_model(model_id: str, server: OpenAIServer = Depends(openai_server)) -> Response:
    """One served name's card (the SDK's `models.retrieve`), else OpenAI's 404."""
    cards = await server.model_cards(f"models-{uuid.uuid4().hex}")
    if isinstance(cards, Response):
        return cards
    card = next((card for card in cards if card.id == model_id), None)
    if card is None:
        message = f"model: {model_id!r} does not exist"
        return error_response(404, message, "NotFoundError", param="model")
    return json_answer(card)


@router.get("/health", responses=responses(None, errors=(503,)))
# vLLM's SageMaker ping: the health check, by both methods (one operation id each).
@router.get("/ping", responses=responses(None, errors=(503,)), operation_id="ping_get")
@router.post("/ping", responses=responses(None, errors=(503,)), operation_id="ping_post")
async def health(server: OpenAIServer = Depends(openai_server)) -> Response:
    """200 ok (or degraded: saturated, still serving) while every engine steps; 503 when one
    cannot. The details are for the log and /stats, not for this answer."""
    state = await server.client.health(f"health-{uuid.uuid4().hex}")
    if isinstance(state, RequestFailure):
        return engine_error_response(state)
    return JSONResponse({"status": state})


@router.get("/version", responses=responses(None))
async def version() -> Response:
    """The server's version, as vLLM's `/version` gives its own."""
    return JSONResponse({"version": pagedray_version()})


@router.get("/stats", responses=responses(None, errors=(401, 503)))
async def stats(server: OpenAIServer = Depends(openai_server)) -> Response:
    """Each engine's scheduler statistics (KV blocks, queue lengths, steps)."""
    replicas = await server.client.stats(f"stats-{uuid.uuid4().hex}")
    if isinstance(replicas, RequestFailure):
        return engine_error_response(replicas)
    return JSONResponse({"model": server.model_name, "replicas": replicas})


@router.get("/metrics", include_in_schema=False)
async def prometheus_metrics(server: OpenAIServer = Depends(openai_server)) -> Response:
    """Prometheus text (vLLM serves its metrics here too, without the API key)."""
    if server.prometheus_text is None:
        message = "metrics unavailable: this server exports none (Ray's metrics export does)"
        return error_response(503, message, "ServiceUnavailableError")
    text = await server.prometheus_text()
    if text is None:
        message = "metrics unavailable: no Ray metrics export answered"
        return error_response(503, message, "ServiceUnavailableError")
    return Response(text, media_type=PROMETHEUS_CONTENT_TYPE)
