"""The OpenAI server as a Ray Serve deployment: each replica an `OpenAIServer` over the engine
deployment (`ServeEngineClient`), answering the app of openai/http_app.py.

It validates, applies the chat template and tokenizes (in a thread pool, off the event loop), then
calls the engine deployment through a DeploymentHandle; it holds no KV state, so it scales out
freely. Bad requests never reach a scheduler. The application around it is built in
openai_app.py (`build_app`, the import path Serve configs name).
"""

from __future__ import annotations

from typing import Any

from ray import serve
from ray.serve.handle import DeploymentHandle

from pagedray.cluster import kv_views
from pagedray.cluster.client_disconnect import ClientDisconnect
from pagedray.cluster.engine_control import EngineControl, config_max_model_len
from pagedray.cluster.engine_deployment import MAX_ONGOING_REQUESTS
from pagedray.cluster.ingress_metrics import IngressMetrics
from pagedray.cluster.metrics_endpoint import export_urls, fetch_exports, merge_pagedray_families
from pagedray.cluster.replica_logging import (
    REQUEST_LOG_NAME,
    log_through_serve,
    on_console,
    serve_logs_to_stderr,
)
from pagedray.cluster.response_store_deployment import ServeResponseStore
from pagedray.cluster.serve_bind_fix import install_serve_bind_fix
from pagedray.cluster.serve_cancel_fix import install_serve_cancel_fix
from pagedray.cluster.serve_engine_client import ServeEngineClient
from pagedray.engine.config import EngineConfig
from pagedray.observability.ray_grafana import provision_for_this_ray_session
from pagedray.openai.cors import CORSSettings
from pagedray.openai.http_app import openai_fastapi_app
from pagedray.openai.ingress_guard import DEFAULT_MAX_REQUEST_BODY_BYTES, GuardSettings
from pagedray.openai.server import OpenAIServer


def _replica() -> Any:
    # NOTE: the app's routes and middleware find this replica's `OpenAIIngress` the way Serve's
    # class-based routes do: in the replica context.
    return serve.get_replica_context().servable_object


def _replica_server() -> OpenAIServer:
    return _replica().server


def _replica_metrics() -> IngressMetrics:
    return _replica().metrics


app = openai_fastapi_app(_replica_server, _replica_metrics, behind_serve=True)
# Outermost, so every reader of the body (the guard included) sees a hang-up as a disconnect.
app.add_middleware(ClientDisconnect)


# NOTE: Serve learns that a replica's process died only from its next health check, sent this
# long after the last one (10 s by default): with one ingress replica the API stayed down for
# up to that long before the replacement even started (7-15 s after a SIGKILL, issue P14). The
# check is one actor call that runs nothing of ours.
HEALTH_CHECK_PERIOD_S = 0.5


@serve.deployment(
    name="OpenAIIngress",
    max_ongoing_requests=MAX_ONGOING_REQUESTS,
    health_check_period_s=HEALTH_CHECK_PERIOD_S,
)
@serve.ingress(app)
class OpenAIIngress:
    """One ingress replica: its `OpenAIServer` and its metrics.

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
        # In the replica: transformers comes with it; the app's builder needs none of it.
        from pagedray.engine.tokenizer_loading import load_tokenizer, make_validator

        log_through_serve()
        install_serve_cancel_fix()  # before any request: hung-up ones must keep their log line
        install_serve_bind_fix()  # before the replica listens on the API port (after this)
        engine_config = EngineConfig.model_validate(config)
        if engine_config.enable_log_requests and not serve_logs_to_stderr():
            on_console(REQUEST_LOG_NAME)
        tokenizer = load_tokenizer(engine_config)
        control = EngineControl(engine, config_max_model_len(engine_config))
        if engine_config.enable_kv_cache_events:  # cache-aware routing: follow engines' caches
            kv_views.KV_VIEWS.attach(engine, engine_config.block_size)
        self.metrics = IngressMetrics(engine_config.served_name())
        self.client = client = ServeEngineClient(
            engine,
            control,
            engine_config.migration_limit,
            self.metrics.record_migration,
            engine_config.migration_max_seq_len,
        )
        self.server = OpenAIServer(
            client,
            engine_config,
            tokenizer,
            make_validator(engine_config, tokenizer, control.max_model_len),
            ServeResponseStore(response_store) if response_store is not None else None,
            GuardSettings(api_key_sha256, max_request_body_bytes),
            cors,
            self._prometheus_text,
        )
        provision_for_this_ray_session()  # on the head: our dashboard beside Ray's in Grafana

    def __del__(self) -> None:
        """Serve's shutdown hook, once this replica's requests drained: the engines' streams it
        follows (output channels, KV views) end now, so that an engine stopping beside it (a
        redeploy, a shutdown) need not wait seconds for them to go idle."""
        client = getattr(self, "client", None)
        if client is not None:
            client.close()
        kv_views.KV_VIEWS.close()

    async def _prometheus_text(self) -> str | None:
        """The pagedray series of every node's Ray metrics export; None if none answered."""
        texts = await fetch_exports(await self.server.in_thread(export_urls))
        if not texts:
            return None
        return await self.server.in_thread(merge_pagedray_families, texts, self.server.model_name)


__all__ = ["OpenAIIngress", "app"]
