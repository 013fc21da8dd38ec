"""The OpenAI-compatible HTTP ingress: a Serve deployment wrapping a FastAPI app.

It validates, applies the chat template and tokenizes (in a thread pool, off the event loop),
then calls the engine deployment through a DeploymentHandle; it holds no KV state, so it scales
out freely. Bad requests are answered here and never reach a scheduler; `IngressGuard` wraps
every route (API key, body limit, opaque 500s). `serve run
pagedray.cluster.openai_app:build_app model=...` works.
"""

# NOTE: no `from __future__ import annotations` here: Serve pickles the route functions by value,
# with only the globals their bodies use, so FastAPI could not resolve string annotations such
# as "Request" in the replica and would treat those parameters as query strings.
import asyncio
import functools
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from ray import serve
from ray.serve.handle import DeploymentHandle
from starlette.exceptions import HTTPException as StarletteHTTPException

# NOTE: the module, not its `KV_VIEWS` (see the NOTE above): by value, the name would carry a
# copy of the views, not this process's, which the engine router reads.
from pagedray.cluster import kv_views
from pagedray.cluster.client_disconnect import ClientDisconnect
from pagedray.cluster.engine_control import EngineControl, config_max_model_len
from pagedray.cluster.engine_deployment import MAX_ONGOING_REQUESTS
from pagedray.cluster.kv_views import ROUTING_HASHES_KEY
from pagedray.cluster.metrics import IngressMetrics
from pagedray.cluster.metrics_endpoint import (
    CONTENT_TYPE,
    export_urls,
    fetch_exports,
    merge_pagedray_families,
)
from pagedray.cluster.serve_cancel_fix import install_serve_cancel_fix
from pagedray.engine.config import EngineConfig
from pagedray.engine.engine_factory import load_tokenizer, make_validator
from pagedray.engine.prompts import ValidatedPrompt
from pagedray.observability.ray_grafana import provision_for_this_ray_session
from pagedray.openai.engine_streams import EngineStreams
from pagedray.openai.ingress_guard import (
    DEFAULT_MAX_REQUEST_BODY_BYTES,
    GuardSettings,
    IngressGuard,
    http_error,
)
from pagedray.openai.output_subscriber import OutputSubscriber
from pagedray.openai.prompts import (
    RequestT,
    chat_prompt,
    completion_prompts,
    decode_body,
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
from pagedray.openai.request_body import BodyError
from pagedray.openai.responses import (
    ResponseContext,
    chat_chunks,
    chat_response,
    completion_chunks,
    completion_response,
    with_error_event,
)
from pagedray.openai.schema import declare_request_models, request_body, responses
from pagedray.openai.serving import (
    HTTPMetricsMiddleware,
    LogprobFormatter,
    bad_request,
    engine_error_response,
    error_response,
)
from pagedray.scheduler.sampling_params import SamplingParams

# Threads per ingress replica that parse bodies and (de)tokenize, off the event loop: a huge
# prompt then delays only the requests queued behind it here, never /health or a stream.
TOKENIZER_THREADS = 4
# Tokens per engine message of a non-streamed request with stop strings: the ingress finds them,
# so it needs the tokens before the end, but not one message per token.
STOP_CHECK_INTERVAL = 8

app = FastAPI(title="pagedray", description="OpenAI-compatible LLM serving on Ray")


def _replica() -> Any:
    # NOTE: middleware runs outside the routes, so it finds this replica's `OpenAIIngress` the
    # way Serve's class-based routes do: in the replica context.
    return serve.get_replica_context().servable_object


def _replica_metrics() -> IngressMetrics:
    return _replica().metrics


def _replica_guard() -> GuardSettings:
    return _replica().guard


# Added first, so it runs inside the metrics middleware, which then sees its answers.
app.add_middleware(IngressGuard, settings_of=_replica_guard, routes=app.router.routes)
app.add_middleware(HTTPMetricsMiddleware, metrics_of=_replica_metrics)
# Outermost, so every reader of the body (the guard included) sees a hang-up as a disconnect.
app.add_middleware(ClientDisconnect)
declare_request_models(
    app, [CompletionRequest, ChatCompletionRequest, TokenizeRequest, DetokenizeRequest]
)


# Unknown paths and methods answer in OpenAI's error shape too.
app.add_exception_handler(StarletteHTTPException, http_error)


def _json(payload: Any) -> Response:
    if isinstance(payload, dict):  # an engine error met before any output
        return engine_error_response(payload)
    return Response(payload.model_dump_json(), media_type="application/json")


def _event_stream(chunks: Any) -> StreamingResponse:
    return StreamingResponse(with_error_event(chunks), media_type="text/event-stream")


# NOTE: `serve.ingress` pickles the app (and so the routes) when the class is decorated: every
# global a route uses must already be defined above this point.
@serve.deployment(name="OpenAIIngress", max_ongoing_requests=MAX_ONGOING_REQUESTS)
@serve.ingress(app)
class OpenAIIngress:
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
    ) -> None:
        install_serve_cancel_fix()  # before any request: hung-up ones must keep their log line
        self.engine = engine
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
        ctx = ResponseContext(
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
        await self._learn_limits()
        try:
            params, prompt = await self._in_thread(chat_prompt, self.validator, body)
        except ValueError as exc:
            return bad_request(exc)
        ctx = ResponseContext(
            request_id=request_id,
            model=self.model_name,
            n=params.n,
            num_prompts=1,
            logprobs=self.logprobs,
            num_logprobs=params.logprobs,
            include_usage=body.include_usage,
        )
        streams = await self._open(ctx.request_id, [prompt], params, body.priority, body.stream)
        if isinstance(streams, Response):
            return streams
        if body.stream:
            return _event_stream(chat_chunks(ctx, streams))
        return _json(await chat_response(ctx, streams))

    # ---- models, tokenizer ------------------------------------------------------------------

    @app.get("/v1/models", responses=responses(ModelList, errors=(401, 503)))
    async def models(self) -> Response:
        """The served model, with the engine's real max_model_len; 503 until the engine serves
        (clients take a 200 here to mean they may send requests)."""
        not_ready = await self.control.not_ready(f"models-{uuid.uuid4().hex}")
        if not_ready is not None:
            return not_ready
        card = ModelCard(
            id=self.model_name,
            root=self.config.model,
            max_model_len=await self._learn_limits(),
        )
        return _json(ModelList(data=[card]))

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
        body = await self._in_thread(merge_pagedray_families, texts)
        return Response(body, media_type=CONTENT_TYPE)

    # ---- helpers ---------------------------------------------------------------------------

    async def _learn_limits(self) -> int:
        await self.control.learn_limits()
        self.validator.max_model_len = self.control.max_model_len
        return self.validator.max_model_len

    async def _in_thread(self, fn: Callable[..., Any], *args: Any) -> Any:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.executor, functools.partial(fn, *args))

    async def _parse(self, raw: Request, model: type[RequestT]) -> RequestT | Response:
        """Decode and validate a body (the guard has bounded it); the error response if bad."""
        try:
            body = await self._in_thread(decode_body, await raw.body(), model)
        except BodyError as exc:
            return error_response(400, str(exc), param=exc.param)
        except ValidationError as exc:
            return bad_request(exc)
        requested = getattr(body, "model", None)
        if requested is not None and requested != self.model_name:
            message = f"model: {requested!r} does not exist; this server has {self.model_name!r}"
            return error_response(404, message, "NotFoundError", param="model")
        return body

    def _stream_interval(self, stream: bool, params: SamplingParams) -> int | None:
        """How often the engine sends this request's tokens: every `--stream-interval` tokens to
        a streaming client; once, at the end, to one that does not stream, unless the ingress
        must watch for stop strings (then every `STOP_CHECK_INTERVAL` tokens, so that little is
        generated past one)."""
        if stream:
            return self.config.stream_interval
        return STOP_CHECK_INTERVAL if params.stop else None

    async def _open(
        self,
        request_id: str,
        prompts: list[ValidatedPrompt],
        params: SamplingParams,
        priority: int,
        stream: bool,
    ) -> EngineStreams | Response:
        """Submit one engine request per prompt; an error response if any is refused."""
        requests = [
            {
                "request_id": request_id if len(prompts) == 1 else f"{request_id}-{i}",
                "prompt_token_ids": prompt.token_ids,
                "sampling_params": params,
                "priority": priority,
                "cache_salt": prompt.cache_salt,
                "stream_interval": self._stream_interval(stream, params),
            }
            for i, prompt in enumerate(prompts)
        ]
        views = kv_views.KV_VIEWS
        views.follow_live_replicas()  # also lets the router's news reach this loop
        if views.attached and len(views.live_replica_ids) > 1:  # else nothing to choose
            for request, prompt in zip(requests, prompts):
                hashes = views.routing_hashes(prompt.token_ids, prompt.cache_salt)
                request[ROUTING_HASHES_KEY] = hashes
        streams = EngineStreams(self.engine, requests, self.tokenizer, self.subscriber)
        error = await streams.open()
        return engine_error_response(error) if error is not None else streams


# NOTE: at the end, as the builders bind `OpenAIIngress` (imported there when called); Serve
# configs, the Helm chart and `pagedray serve` name `pagedray.cluster.openai_app:build_app`.
from pagedray.cluster.serve_app import APP_ARGS, build_app, build_openai_app  # noqa: E402

__all__ = ["APP_ARGS", "OpenAIIngress", "app", "build_app", "build_openai_app"]
