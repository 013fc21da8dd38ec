"""The OpenAI-compatible HTTP ingress: a Serve deployment wrapping a FastAPI app.

It validates, applies the chat template and tokenizes, then calls the engine deployment through
a DeploymentHandle; it holds no KV state, so it scales out freely. Bad requests are answered here
and never reach a scheduler. `serve run pagedray.cluster.openai_app:build_app model=...` works.
"""

# NOTE: no `from __future__ import annotations` here: Serve pickles the route functions by value,
# with only the globals their bodies use, so FastAPI could not resolve string annotations such
# as "Request" in the replica and would treat those parameters as query strings.
import json
import secrets
import uuid
from pathlib import Path
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from ray import serve
from ray.serve import Application
from ray.serve.handle import DeploymentHandle

from pagedray.cluster.config import EngineConfig
from pagedray.cluster.engine_deployment import MAX_ONGOING_REQUESTS, engine_deployment
from pagedray.cluster.engine_factory import load_tokenizer, make_validator
from pagedray.cluster.metrics import IngressMetrics
from pagedray.cluster.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)
from pagedray.cluster.openai_responses import (
    ResponseContext,
    chat_chunks,
    chat_response,
    completion_chunks,
    completion_response,
    with_error_event,
)
from pagedray.cluster.openai_serving import (
    EngineStreams,
    HTTPMetricsMiddleware,
    LogprobFormatter,
    bad_request,
    engine_error_response,
    error_response,
)
from pagedray.cluster.prompts import ValidatedPrompt
from pagedray.scheduler.sampling_params import SamplingParams

RequestT = TypeVar("RequestT", bound=BaseModel)
# Seconds the ingress waits for every engine replica to answer a health or stats call.
CONTROL_TIMEOUT_S = 10.0

app = FastAPI(title="pagedray", description="OpenAI-compatible LLM serving on Ray")


def _replica_metrics() -> IngressMetrics:
    # NOTE: middleware runs outside the routes, so it finds this replica's `OpenAIIngress` the
    # way Serve's class-based routes do: in the replica context.
    return serve.get_replica_context().servable_object.metrics


app.add_middleware(HTTPMetricsMiddleware, metrics_of=_replica_metrics)


def _json(payload: BaseModel | dict[str, Any]) -> Response:
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
    """Tokenizer-side work and protocol; generation goes to the engine deployment."""

    def __init__(
        self, engine: DeploymentHandle, config: dict[str, Any], api_key: str | None = None
    ) -> None:
        self.engine = engine
        self.config = EngineConfig.model_validate(config)
        self.model_name = self.config.served_model_name or Path(self.config.model).name
        self.tokenizer = load_tokenizer(self.config)
        self.max_model_len = self.config.resolved_max_model_len()
        self.validator = make_validator(self.config, self.tokenizer, self.max_model_len)
        self.logprobs = LogprobFormatter(self.tokenizer)
        self.api_key = api_key
        self.metrics = IngressMetrics(self.model_name)

    # ---- generation ------------------------------------------------------------------------

    @app.post("/v1/completions")
    async def completions(self, raw: Request) -> Response:
        body = await self._parse(raw, CompletionRequest)
        if isinstance(body, Response):
            return body
        try:
            params = body.to_sampling_params()
            prompts = [self._validate(p, params, body.cache_salt) for p in body.prompts()]
        except ValueError as exc:
            return bad_request(exc)
        ctx = ResponseContext(
            request_id=f"cmpl-{uuid.uuid4().hex}",
            model=self.model_name,
            n=params.n,
            num_prompts=len(prompts),
            logprobs=self.logprobs,
            num_logprobs=body.logprobs,
            include_usage=body.include_usage,
            echo=[self._prompt_text(p) for p in prompts] if body.echo else None,
            echo_token_ids=[p.token_ids for p in prompts] if body.echo else None,
        )
        streams = await self._open(ctx.request_id, prompts, params, body.priority, body.stream)
        if isinstance(streams, Response):
            return streams
        if body.stream:
            return _event_stream(completion_chunks(ctx, streams))
        return _json(await completion_response(ctx, streams))

    @app.post("/v1/chat/completions")
    async def chat_completions(self, raw: Request) -> Response:
        body = await self._parse(raw, ChatCompletionRequest)
        if isinstance(body, Response):
            return body
        try:
            params = body.to_sampling_params()
            messages = [message.as_template_input() for message in body.messages]
            token_ids = self.validator.chat_prompt_token_ids(messages)
            self.validator.check_token_ids(token_ids)
        except ValueError as exc:
            return bad_request(exc)
        prompt = ValidatedPrompt(None, token_ids, body.cache_salt)
        ctx = ResponseContext(
            request_id=f"chatcmpl-{uuid.uuid4().hex}",
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

    @app.get("/v1/models")
    async def models(self, raw: Request) -> Response:
        if (denied := self._authorize(raw)) is not None:
            return denied
        card = ModelCard(
            id=self.model_name, root=self.config.model, max_model_len=self.max_model_len
        )
        return _json(ModelList(data=[card]))

    @app.post("/tokenize")
    async def tokenize(self, raw: Request) -> Response:
        body = await self._parse(raw, TokenizeRequest)
        if isinstance(body, Response):
            return body
        try:
            if body.messages is not None:
                messages = [message.as_template_input() for message in body.messages]
                tokens = self.validator.chat_prompt_token_ids(messages)
            else:
                tokens = self.tokenizer.encode(
                    body.prompt, add_special_tokens=body.add_special_tokens
                )
        except ValueError as exc:
            return bad_request(exc)
        response = TokenizeResponse(
            tokens=tokens, count=len(tokens), max_model_len=self.max_model_len
        )
        return _json(response)

    @app.post("/detokenize")
    async def detokenize(self, raw: Request) -> Response:
        body = await self._parse(raw, DetokenizeRequest)
        if isinstance(body, Response):
            return body
        vocab_size = self.validator.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab_size]
        if bad:
            return error_response(
                400, f"tokens: {bad[0]} is outside the vocabulary [0, {vocab_size})", param="tokens"
            )
        return _json(DetokenizeResponse(prompt=self.tokenizer.decode(body.tokens)))

    # ---- operations -------------------------------------------------------------------------

    @app.get("/health")
    async def health(self) -> Response:
        """200 only while every engine replica's loop is alive and stepping (not stuck)."""
        replicas = await self._broadcast("health")
        if isinstance(replicas, Response):
            return replicas
        unhealthy = [r for r in replicas if not r.get("healthy")]
        if unhealthy or not replicas:
            detail = "; ".join(str(r.get("error")) for r in unhealthy) or "no engine replicas"
            return error_response(503, f"engine unhealthy: {detail}", "ServiceUnavailableError")
        return JSONResponse({"status": "ok", "replicas": replicas})

    @app.get("/stats")
    async def stats(self, raw: Request) -> Response:
        """Each engine replica's scheduler statistics (KV blocks, queue lengths, steps)."""
        if (denied := self._authorize(raw)) is not None:
            return denied
        replicas = await self._broadcast("stats")
        if isinstance(replicas, Response):
            return replicas
        return JSONResponse({"model": self.model_name, "replicas": replicas})

    # ---- helpers ---------------------------------------------------------------------------

    def _authorize(self, raw: Request) -> Response | None:
        if self.api_key is None:
            return None
        header = raw.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() == "bearer" and secrets.compare_digest(token.strip(), self.api_key):
            return None
        return error_response(401, "invalid API key", "AuthenticationError")

    async def _parse(self, raw: Request, model: type[RequestT]) -> RequestT | Response:
        """Authorize, decode and validate a body; the error response if any step fails."""
        if (denied := self._authorize(raw)) is not None:
            return denied
        try:
            body = model.model_validate(await raw.json())
        except json.JSONDecodeError as exc:
            return error_response(400, f"body: invalid JSON ({exc.msg})", param="body")
        except ValidationError as exc:
            return bad_request(exc)
        requested = getattr(body, "model", None)
        if requested is not None and requested != self.model_name:
            message = f"model: {requested!r} does not exist; this server has {self.model_name!r}"
            return error_response(404, message, "NotFoundError", param="model")
        return body

    def _validate(
        self, prompt: str | list[int], params: SamplingParams, cache_salt: str | None
    ) -> ValidatedPrompt:
        if isinstance(prompt, list):
            return self.validator.validate(
                {"prompt_token_ids": prompt, "cache_salt": cache_salt}, params
            )
        validated = self.validator.validate(prompt, params)
        return ValidatedPrompt(validated.text, validated.token_ids, cache_salt)

    def _prompt_text(self, prompt: ValidatedPrompt) -> str:
        return prompt.text if prompt.text is not None else self.tokenizer.decode(prompt.token_ids)

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
                "prompt": prompt.text,
                "sampling_params": params,
                "priority": priority,
                "cache_salt": prompt.cache_salt,
                "stream": stream,
            }
            for i, prompt in enumerate(prompts)
        ]
        streams = EngineStreams(self.engine, requests)
        error = await streams.open()
        return engine_error_response(error) if error is not None else streams

    async def _broadcast(self, method: str) -> list[dict[str, Any]] | Response:
        try:
            response = self.engine.broadcast(method)
            results = await response.results_async(
                timeout_s=CONTROL_TIMEOUT_S, return_exceptions=True
            )
        except Exception as exc:  # noqa: BLE001 - no replica is up
            return error_response(503, f"engine unavailable: {exc}", "ServiceUnavailableError")
        return [
            r if isinstance(r, dict) else {"healthy": False, "error": f"{type(r).__name__}: {r}"}
            for r in results
        ]


# ---- the application ---------------------------------------------------------------------------

# `build_app` arguments that configure the deployments rather than the engine.
APP_ARGS = (
    "num_replicas",
    "min_replicas",
    "max_replicas",
    "api_key",
    "stuck_after_s",
    "health_check_period_s",
    "ingress_num_cpus",
)


def build_openai_app(
    config: EngineConfig,
    num_replicas: int = 1,
    api_key: str | None = None,
    autoscaling_config: dict[str, Any] | None = None,
    stuck_after_s: float | None = None,
    health_check_period_s: float | None = None,
    ingress_num_cpus: float = 0.0,
    engine_builder: Any = None,
) -> Application:
    """The ingress bound to `num_replicas` engines (or an autoscaled range of them).

    `engine_builder` replaces `build_engine` in every engine replica (tests inject faults).
    The ingress waits on I/O and tokenizes, so like Serve's proxy it reserves no CPU by default.
    """
    options: dict[str, Any] = {"num_replicas": num_replicas}
    if autoscaling_config is not None:
        options = {"autoscaling_config": autoscaling_config}
    if health_check_period_s is not None:
        options["health_check_period_s"] = health_check_period_s
    engine_kwargs: dict[str, Any] = {"engine_builder": engine_builder}
    if stuck_after_s is not None:
        engine_kwargs["stuck_after_s"] = stuck_after_s
    engine = engine_deployment(config, **options).bind(config.model_dump(), **engine_kwargs)
    ingress = OpenAIIngress.options(ray_actor_options={"num_cpus": ingress_num_cpus})
    return ingress.bind(engine, config.model_dump(), api_key)


def build_app(args: dict[str, Any]) -> Application:
    """Serve's app builder: `serve run pagedray.cluster.openai_app:build_app model=... key=value`.

    Keys are `EngineConfig` fields (strings are coerced) plus `APP_ARGS`; `min_replicas` and
    `max_replicas` turn on autoscaling. Without `model`, the default model is built and served.
    """
    args = {key: value for key, value in args.items() if value is not None}
    app_args = {key: args.pop(key) for key in APP_ARGS if key in args}
    if "model" not in args:
        from pagedray.cluster.default_model import default_model_path

        args["model"] = str(default_model_path())
    # Serving runs every rank as a Ray actor in the replica's placement group.
    args.setdefault("use_ray_workers", True)
    config = EngineConfig.model_validate(args)
    autoscaling_config = None
    if "min_replicas" in app_args or "max_replicas" in app_args:
        low = int(app_args.pop("min_replicas", 1))
        high = int(app_args.pop("max_replicas", max(low, 1)))
        autoscaling_config = {"min_replicas": low, "max_replicas": high}
    return build_openai_app(
        config,
        num_replicas=int(app_args.get("num_replicas", 1)),
        api_key=app_args.get("api_key"),
        autoscaling_config=autoscaling_config,
        stuck_after_s=_float_or_none(app_args.get("stuck_after_s")),
        health_check_period_s=_float_or_none(app_args.get("health_check_period_s")),
        ingress_num_cpus=float(app_args.get("ingress_num_cpus", 0.0)),
    )


def _float_or_none(value: Any) -> float | None:
    return None if value is None else float(value)
