"""The OpenAI server over an engine in this process, without Ray: the same routes and middleware
as the Serve ingress, with `LocalEngineClient` behind them. For HTTP tests, and for a server on
one machine that needs none of Ray's replicas, routing or dashboard (`pagedray serve --no-ray`).
"""

from __future__ import annotations

import contextlib
from typing import AsyncIterator

from fastapi import FastAPI

from pagedray.engine.async_engine import DEFAULT_STUCK_AFTER_S, AsyncEngine
from pagedray.engine.config import EngineConfig
from pagedray.engine.engine_factory import build_engine
from pagedray.engine.local_engine_client import LocalEngineClient
from pagedray.engine.output_processor import OutputProcessor
from pagedray.engine.stats_log import stats_log_for
from pagedray.openai.cors import CORSSettings
from pagedray.openai.http_app import openai_fastapi_app
from pagedray.openai.ingress_guard import GuardSettings
from pagedray.openai.response_store import LocalResponseStore, ResponseStore
from pagedray.openai.server import OpenAIServer
from pagedray.workers.compute_thread import compute_thread
from pagedray.workers.worker import resolved_device


def local_openai_app(
    config: EngineConfig,
    guard: GuardSettings | None = None,
    cors: CORSSettings | None = None,
    response_store: ResponseStore | None = None,
    stuck_after_s: float = DEFAULT_STUCK_AFTER_S,
) -> FastAPI:
    """The app over a new engine for `config` (one rank, in this process), which stops with the
    app (a request still in flight then ends with a 503). Its server is `app.state.server`."""
    # Built on the thread that will step it (see workers/compute_thread.py).
    core, _, tokenizer, validator = compute_thread().run(build_engine, config, None)
    if core.scheduler.structured is not None:
        core.scheduler.structured.prepare()  # before the app serves
    engine = AsyncEngine(
        core,
        OutputProcessor(None),  # token ids only: the server makes the text
        stuck_after_s,
        request_timeout_s=config.request_timeout_s or None,
        stats_log=stats_log_for(config, resolved_device(config.device) == "cuda"),
    )
    server = OpenAIServer(
        LocalEngineClient(engine),
        config,
        tokenizer,
        validator,
        LocalResponseStore(response_store or ResponseStore()),
        guard,
        cors,
    )

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        await engine.shutdown()

    app = openai_fastapi_app(lambda: server)
    app.router.lifespan_context = lifespan
    app.state.server = server
    return app
