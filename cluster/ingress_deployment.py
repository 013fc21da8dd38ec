"""The OpenAI-compatible HTTP ingress: a Serve deployment wrapping a FastAPI app.

It validates, applies the chat template and tokenizes (in a thread pool, off the event loop), then
calls the engine deployment through a DeploymentHandle; it holds no KV state, so it scales out
freely. Bad requests never reach a scheduler; `IngressGuard` wraps every route (API key, body limit,
opaque 500s). The application around it is built in openai_app.py (`build_app`, the import path
Serve configs name).
"""

# NOTE: no `from __future__ import annotations` here: Serve pickles the route functions by value,
# with only the globals their bodies use, so FastAPI could not resolve string annotations such
# as "Request" in the replica and would treat those parameters as query strings.
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from ray import serve
from ray.serve.handle import DeploymentHandle
from starlette.exceptions import HTTPException as StarletteHTTPException

# NOTE: the module, not its `KV_VIEWS` (see the NOTE above): by value, the name would carry a
# copy of the views, not this process's, which the engine router reads.
from pagedray.cluster import kv_views
from pagedray.cluster.anthropic_routes import AnthropicRoutes
from pagedray.cluster.anthropic_routes import router as anthropic_router
from pagedray.cluster.client_disconnect import ClientDisconnect
from pagedray.cluster.engine_control import EngineControl, config_max_model_len
from pagedray.cluster.engine_deployment import MAX_ONGOING_REQUESTS
from pagedray.cluster.metrics import IngressMetrics
from pagedray.cluster.metrics_endpoint import (
    CONTENT_TYPE,
    export_urls,
    fetch_exports,
    merge_pagedray_families,
)
from pagedray.cluster.serve_bind_fix import install_serve_bind_fix
from pagedray.cluster.serve_cancel_fix import install_serve_cancel_fix
from pagedray.engine.config import EngineConfig
from pagedray.observability.ray_grafana import provision_for_this_ray_session
from pagedray.openai.answers import (
    AnswerContext,
    chat_chunks,
    chat_response,
    completion_chunks,
    completion_response,
    with_error_event,
)
from pagedray.openai.anthropic_api import CountTokensRequest, MessagesRequest
from pagedray.openai.anthropic_errors import AnthropicErrors
from pagedray.openai.cors import CORSSettings, ReplicaCORS
from pagedray.openai.ingress_guard import (
    DEFAULT_MAX_REQUEST_BODY_BYTES,
    GuardSettings,
    IngressGuard,
    http_error,
    route_path,
)
from pagedray.openai.output_subscriber import OutputSubscriber
from pagedray.openai.prompts import (
    completion_prompts,
    detokenize,
    tokenize,
)
from pagedray.openai.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)
from pagedray.openai.response_objects import new_response_id
from pagedray.openai.responses_api import ResponsesRequest, to_chat_body
from pagedray.openai.responses_flow import (
    ResponseJob,
    in_responses_terms,
    response_events,
    whole_response,
)
from pagedray.openai.schema import declare_request_models, request_body, responses
from pagedray.openai.serving import (
    HTTPMetricsMiddleware,
    LogprobFormatter,
    bad_request,
    engine_error_response,
    error_response,
    logger,
)
from pagedray.scheduler.request_failure import RequestFailure

# Threads per ingress replica that parse bodies and (de)tokenize, off the event loop: a huge
# prompt then delays only the requests queued behind it here, never /health or a stream.
TOKENIZER_THREADS = 4

app = FastAPI(title="pagedray", description="OpenAI-compatible LLM serving on Ray")


def _replica() -> Any:
    # NOTE: middleware runs outside the routes, so it finds this replica's `OpenAIIngress` the
    # way Serve's class-based routes do: in the replica context.
    return serve.get_replica_context().servable_object


def _replica_metrics() -> IngressMetrics:
    return _replica().metrics


def _replica_guard() -> GuardSettings:
    return _replica().guard


def _replica_cors() -> CORSSettings:
    return _replica().cors


# Anthropic's routes, from their own module (a base class of the ingress below).
app.include_router(anthropic_router)
# Added first, so it runs inside the metrics middleware, which then sees its answers.
app.add_middleware(IngressGuard, settings_of=_replica_guard, routes=app.router.routes)
# Around the guard, so its refusals on Anthropic's routes are in Anthropic's shape too.
app.add_middleware(AnthropicErrors, path_of=route_path)
app.add_middleware(HTTPMetricsMiddleware, metrics_of=_replica_metrics)
# Outside the guard and the metrics: it answers a browser's preflight itself (which carries no
# API key, and is no request of the route it asks about) and adds its headers to every answer.
app.add_middleware(ReplicaCORS, settings_of=_replica_cors)
# Outermost, so every reader of the body (the guard included) sees a hang-up as a disconnect.
app.add_middleware(ClientDisconnect)
declare_request_models(
    app,
    [
        CompletionRequest,
        ChatCompletionRequest,
        ResponsesRequest,
        TokenizeRequest,
        DetokenizeRequest,
        MessagesRequest,
        CountTokensRequest,
    ],
)


# Unknown paths and methods answer in OpenAI's error shape too.
app.add_exception_handler(StarletteHTTPException, http_error)


def _json(payload: Any) -> Response:
    if isinstance(payload, RequestFailure):  # met before any output
        return engine_error_response(payload)
    return Response(payload.model_dump_json(), media_type="application/json")


def _event_stream(chunks: Any) -> StreamingResponse:
    return StreamingResponse(with_error_event(chunks), media_type="text/event-stream")


def _response_not_found(response_id: str, param: str) -> Response:
    message = f"{param}: no stored response {response_id!r} (never stored, expired or evicted)"
    return error_response(404, message, "NotFoundError", param=param)


# NOTE: `serve.ingress` pickles the app (and so the routes) when the class is decorated: every
# global a route uses must already be defined above this point.
@serve.deployment(name="OpenAIIngress", max_ongoing_requests=MAX_ONGOING_REQUESTS)
@serve.ingress(app)
class OpenAIIngress(AnthropicRoutes):
    """Tokenizer-side work and protocol; generation goes to the engine deployment.

    `api_key_sha256` is the key's SHA-256 (the key itself never reaches Serve's deployment
    arguments or dashboard); every route but /health and /metrics requires the key when set.
    """

    def __init__(
        self,
        engine: DeploymentHandle,
        config: dict[str, Any],
        api_key_sha256: str | None = None,
        max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES,
        response_store: DeploymentHandle | None = None,
        cors: CORSSettings | None = None,
    ) -> None:
        # In the replica: transformers and torch come with it; the app's builder needs neither.
        from pagedray.engine.engine_factory import load_tokenizer, make_validator

        install_serve_cancel_fix()  # before any request: hung-up ones must keep their log line
        install_serve_bind_fix()  # before the replica listens on the API port (after this)
        self.engine = engine
        self.response_store = response_store  # the Responses API's, shared by every ingress
        self.config = EngineConfig.model_validate(config)
        self.model_name = self.config.served_name()
        self.tokenizer = load_tokenizer(self.config)
        self.control = EngineControl(engine, config_max_model_len(self.config))
        # Streamed outputs come through the engines' output channels, a message per step.
        self.subscriber = OutputSubscriber(engine)
        if self.config.enable_kv_cache_events:  # cache-aware routing: follow the engines' caches
            kv_views.KV_VIEWS.attach(engine, self.config.block_size)
        self.validator = make_validator(self.config, self.tokenizer, self.control.max_model_len)
        self.logprobs = LogprobFormatter(self.tokenizer)
        self.guard = GuardSettings(api_key_sha256, max_request_body_bytes)
        self.cors = cors or CORSSettings()
        self.metrics = IngressMetrics(self.model_name)
        self.executor = ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="pagedray-tok")
        provision_for_this_ray_session()  # on the head: our dashboard beside Ray's in Grafana

    # ---- generation ------------------------------------------------------------------------

    @app.post(
        "/v1/completions",
        openapi_extra=request_body(CompletionRequest),
        responses=responses(CompletionResponse, stream=True),
    )
    async def completions(self, raw: Request) -> Response:
        request_id = f"cmpl-{uuid.uuid4().hex}"
        not_ready = await self.control.not_ready(request_id)
        if not_ready is not None:
            return not_ready
        body = await self._parse(raw, CompletionRequest)
        if isinstance(body, Response):
            return body
        await self._learn_limits()
        num_prompts, queue = len(body.prompts()), self.control.max_num_waiting
        if queue is not None and num_prompts > queue:  # its requests could never all queue
            message = (
                f"prompt: a batch of {num_prompts} prompts is over the engine's queue of {queue}"
            )
            return error_response(400, message, param="prompt")
        try:
            params, prompts, echo = await self._in_thread(completion_prompts, self.validator, body)
        except ValueError as exc:
            return bad_request(exc)
        ctx = AnswerContext(
            request_id=request_id,
            model=self.model_name,
            n=params.n,
            num_prompts=len(prompts),
            logprobs=self.logprobs,
            num_logprobs=body.logprobs,
            include_usage=body.include_usage,
            echo=echo,
            echo_token_ids=[p.token_ids for p in prompts] if body.echo else None,
        )
        streams = await self._open(ctx.request_id, prompts, params, body.priority, body.stream)
        if isinstance(streams, Response):
            return streams
        if body.stream:
            return _event_stream(completion_chunks(ctx, streams))
        return _json(await completion_response(ctx, streams))

    @app.post(
        "/v1/chat/completions",
        openapi_extra=request_body(ChatCompletionRequest),
        responses=responses(ChatCompletionResponse, stream=True),
    )
    async def chat_completions(self, raw: Request) -> Response:
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        not_ready = await self.control.not_ready(request_id)
        if not_ready is not None:
            return not_ready
        body = await self._parse(raw, ChatCompletionRequest)
        if isinstance(body, Response):
            return body
        started = await self._start_chat(request_id, body)
        if isinstance(started, Response):
            return started
        ctx, streams = started
        if body.stream:
            return _event_stream(chat_chunks(ctx, streams))
        return _json(await chat_response(ctx, streams))

    # ---- the Responses API ------------------------------------------------------------------

    @app.post(
        "/v1/responses",
        openapi_extra=request_body(ResponsesRequest),
        responses=responses(None, stream=True),
    )
    async def create_response(self, raw: Request) -> Response:
        """OpenAI's Responses API, served through the chat path; `previous_response_id`
        continues a stored response from any ingress replica, on any engine replica."""
        response_id = new_response_id()
        not_ready = await self.control.not_ready(response_id)
        if not_ready is not None:
            return not_ready
        body = await self._parse(raw, ResponsesRequest)
        if isinstance(body, Response):
            return body
        history = None
        if body.previous_response_id is not None:
            record = await self._stored(body.previous_response_id, "previous_response_id")
            if isinstance(record, Response):
                return record
            history = record["conversation"]
        chat_body = to_chat_body(body, history)
        try:
            chat = ChatCompletionRequest.model_validate({**chat_body, "stream": body.stream})
        except ValidationError as exc:
            return in_responses_terms(bad_request(exc))
        started = await self._start_chat(response_id, chat)
        if isinstance(started, Response):
            return in_responses_terms(started)
        job = ResponseJob(response_id, body, chat_body, self.model_name)
        save = self._save if body.store else None
        if body.stream:
            events = response_events(job, *started, save)
            return StreamingResponse(events, media_type="text/event-stream")
        result = await whole_response(job, *started, save)
        if isinstance(result, RequestFailure):
            return in_responses_terms(engine_error_response(result))
        return JSONResponse(result)

    @app.get("/v1/responses/{response_id}", responses=responses(None, errors=(401, 404, 503)))
    async def retrieve_response(self, response_id: str) -> Response:
        record = await self._stored(response_id, "response_id")
        return record if isinstance(record, Response) else JSONResponse(record["response"])

    @app.delete("/v1/responses/{response_id}", responses=responses(None, errors=(401, 404, 503)))
    async def delete_response(self, response_id: str) -> Response:
        if self.response_store is None or not await self.response_store.delete.remote(response_id):
            return _response_not_found(response_id, "response_id")
        return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})

    # ---- models, tokenizer ------------------------------------------------------------------

    @app.get("/v1/models", responses=responses(ModelList, errors=(401, 503)))
    async def models(self) -> Response:
        """Every served name, with the engine's real max_model_len; 503 until the engine serves
        (clients take a 200 here to mean they may send requests)."""
        cards = await self._model_cards()
        return cards if isinstance(cards, Response) else _json(ModelList(data=cards))

    @app.get("/v1/models/{model_id:path}", responses=responses(ModelCard, errors=(401, 404, 503)))
    async def retrieve_model(self, model_id: str) -> Response:
        """One served name's card (the SDK's `models.retrieve`), else OpenAI's 404."""
        cards = await self._model_cards()
        if isinstance(cards, Response):
            return cards
        card = next((card for card in cards if card.id == model_id), None)
        if card is None:
            message = f"model: {model_id!r} does not exist"
            return error_response(404, message, "NotFoundError", param="model")
        return _json(card)

    @app.post(
        "/tokenize",
        openapi_extra=request_body(TokenizeRequest),
        responses=responses(TokenizeResponse, errors=(400, 401, 404, 413, 500)),
    )
    async def tokenize(self, raw: Request) -> Response:
        body = await self._parse(raw, TokenizeRequest)
        if isinstance(body, Response):
            return body
        max_model_len = await self._learn_limits()
        try:
            tokens = await self._in_thread(tokenize, self.validator, body)
        except ValueError as exc:
            return bad_request(exc)
        return _json(
            TokenizeResponse(tokens=tokens, count=len(tokens), max_model_len=max_model_len)
        )

    @app.post(
        "/detokenize",
        openapi_extra=request_body(DetokenizeRequest),
        responses=responses(DetokenizeResponse, errors=(400, 401, 404, 413, 500)),
    )
    async def detokenize(self, raw: Request) -> Response:
        body = await self._parse(raw, DetokenizeRequest)
        if isinstance(body, Response):
            return body
        try:
            text = await self._in_thread(detokenize, self.validator, body)
        except ValueError as exc:
            return bad_request(exc)
        return _json(DetokenizeResponse(prompt=text))

    # ---- operations -------------------------------------------------------------------------

    @app.get("/health", responses=responses(None, errors=(503,)))
    async def health(self) -> Response:
        """200 ok (or degraded: saturated, still serving) while every engine replica steps;
        503 when one cannot. The details are for the log and /stats, not for this answer."""
        return await self.control.health(f"health-{uuid.uuid4().hex}")

    @app.get("/stats", responses=responses(None, errors=(401, 503)))
    async def stats(self) -> Response:
        """Each engine replica's scheduler statistics (KV blocks, queue lengths, steps)."""
        replicas = await self.control.broadcast("stats", f"stats-{uuid.uuid4().hex}")
        if isinstance(replicas, Response):
            return replicas
        return JSONResponse({"model": self.model_name, "replicas": replicas})

    @app.get("/metrics", include_in_schema=False)
    async def prometheus_metrics(self) -> Response:
        """Prometheus text: the pagedray series of every node's Ray metrics export (vLLM serves
        its metrics here too, without the API key)."""
        texts = await fetch_exports(await self._in_thread(export_urls))
        if not texts:
            message = "metrics unavailable: no Ray metrics export answered"
            return error_response(503, message, "ServiceUnavailableError")
        body = await self._in_thread(merge_pagedray_families, texts, self.model_name)
        return Response(body, media_type=CONTENT_TYPE)

    # ---- helpers ---------------------------------------------------------------------------

    async def _stored(self, response_id: str, param: str) -> dict[str, Any] | Response:
        """A stored response's record, or the 404 that names `param`."""
        record = None
        if self.response_store is not None:
            record = await self.response_store.get.remote(response_id)
        return record if record is not None else _response_not_found(response_id, param)

    async def _save(self, response: dict[str, Any], record: dict[str, Any]) -> None:
        if self.response_store is None:
            return
        if not await self.response_store.put.remote(response["id"], record):
            logger.warning("response %s not stored: larger than the store", response["id"])


__all__ = ["OpenAIIngress", "app"]
