"""The OpenAI server's FastAPI app: its routers, one per API family, behind the middleware every
answer passes (the guard, Anthropic's error shape, metrics, CORS, X-Request-Id), with its
`OpenAIServer` named by `server_of`.

Serve's ingress builds it once, at import, with `server_of` finding the replica's server
(cluster/ingress_deployment.py); `local_openai_app` builds one over an in-process engine.
"""

from __future__ import annotations

from typing import Callable

from fastapi import FastAPI
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedray.openai.anthropic_api import CountTokensRequest, MessagesRequest
from pagedray.openai.anthropic_errors import AnthropicErrors
from pagedray.openai.cors import ReplicaCORS
from pagedray.openai.ingress_guard import IngressGuard, http_error, route_path
from pagedray.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from pagedray.openai.request_ids import RequestIdHeaders
from pagedray.openai.responses_api import ResponsesRequest
from pagedray.openai.routes import (
    anthropic,
    chat,
    completions,
    lora_adapters,
    operations,
    responses,
    tokenizer,
)
from pagedray.openai.routes.lora_adapters import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest
from pagedray.openai.schema import declare_request_models
from pagedray.openai.server import OpenAIServer, openai_server
from pagedray.openai.serving import HTTPMetricsMiddleware, IngressMetrics

ROUTERS = (
    completions.router,
    chat.router,
    responses.router,
    anthropic.router,
    tokenizer.router,
    operations.router,
    lora_adapters.router,
)


def openai_fastapi_app(
    server_of: Callable[[], OpenAIServer],
    metrics_of: Callable[[], IngressMetrics] | None = None,
    behind_serve: bool = False,
) -> FastAPI:
    """The app, its routes answered by `server_of()`'s server; with `metrics_of`, every answer
    is counted and timed into it. `behind_serve`: Serve's proxy answers, and it puts an
    X-Request-Id header on every answer itself (vLLM's `--enable-request-id-headers`, always)."""
    app = FastAPI(title="pagedray", description="OpenAI-compatible LLM serving on Ray")
    for router in ROUTERS:
        app.include_router(router)
    app.dependency_overrides[openai_server] = server_of
    # First, so it runs inside the metrics middleware, which then sees its answers.
    guard_of = lambda: server_of().guard  # noqa: E731
    app.add_middleware(IngressGuard, settings_of=guard_of, routes=app.router.routes)
    # Around the guard, so its refusals on Anthropic's routes are in Anthropic's shape too.
    app.add_middleware(AnthropicErrors, path_of=route_path)
    if metrics_of is not None:
        app.add_middleware(HTTPMetricsMiddleware, metrics_of=metrics_of)
    # Outside the guard and the metrics: it answers a browser's preflight itself (which carries
    # no API key, and is no request of the route it asks about) and adds its headers to every
    # answer.
    app.add_middleware(ReplicaCORS, settings_of=lambda: server_of().cors)
    # Outermost: every answer, a CORS preflight's too, carries the header (vLLM's).
    if not behind_serve:
        request_id_headers = lambda: server_of().config.enable_request_id_headers  # noqa: E731
        app.add_middleware(RequestIdHeaders, enabled_of=request_id_headers)
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
            LoadLoRAAdapterRequest,
            UnloadLoRAAdapterRequest,
        ],
    )
    # Unknown paths and methods answer in OpenAI's error shape too.
    app.add_exception_handler(StarletteHTTPException, http_error)
    return app
