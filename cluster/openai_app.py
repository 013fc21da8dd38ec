"""The Serve application: the OpenAI ingress bound to its engine replicas, built from Python
(`build_openai_app`) or from Serve's builder arguments (`build_app`, which `serve run`, Serve
config files and the Helm chart reach as `pagedray.cluster.openai_app:build_app`).
"""

from __future__ import annotations

from dataclasses import astuple
from typing import Any, cast

from ray.serve import Application, Deployment

from pagedray.cluster.engine_autoscaling import engine_autoscaling_config
from pagedray.cluster.engine_deployment import DRAIN_POLL_S, drain_timeout_s, engine_deployment
from pagedray.cluster.ingress_deployment import OpenAIIngress
from pagedray.cluster.response_store_deployment import (
    DEFAULT_MAX_RESPONSES,
    DEFAULT_TTL_S,
    ResponseStoreDeployment,
)
from pagedray.engine.config import EngineConfig
from pagedray.openai.cors import CORSSettings, cors_settings_of
from pagedray.openai.ingress_guard import (
    DEFAULT_MAX_REQUEST_BODY_BYTES,
    GuardSettings,
    api_key_sha256_of,
)

# `build_app` arguments that configure the deployments rather than the engine.
APP_ARGS = (
    "num_replicas",
    "num_ingress_replicas",
    "min_replicas",
    "max_replicas",
    "api_key",
    "api_key_file",
    "api_key_sha256",
    "max_request_body_bytes",
    "stuck_after_s",
    "health_check_period_s",
    "ingress_num_cpus",
    "routing",
    "routing_load_threshold",
    "responses_max_stored",
    "responses_ttl_s",
    "allowed_origins",
    "allowed_methods",
    "allowed_headers",
    "allow_credentials",
)
ROUTINGS = ("cache-aware", "power-of-two")


def build_openai_app(
    config: EngineConfig,
    num_replicas: int = 1,
    api_key: str | None = None,
    autoscaling_config: dict[str, Any] | None = None,
    stuck_after_s: float | None = None,
    health_check_period_s: float | None = None,
    ingress_num_cpus: float = 0.0,
    engine_builder: Any = None,
    num_ingress_replicas: int = 1,
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES,
    api_key_sha256: str | None = None,
    routing: str | None = None,
    routing_load_threshold: int | None = None,
    responses_max_stored: int = DEFAULT_MAX_RESPONSES,
    responses_ttl_s: float = DEFAULT_TTL_S,
    cors: CORSSettings | None = None,
) -> Application:
    """The ingress bound to `num_replicas` engines (or an autoscaled range of them).

    `engine_builder` replaces `build_engine` in every engine replica (tests inject faults).
    The ingress waits on I/O and tokenizes, so like Serve's proxy it reserves no CPU by default.
    Only the API key's SHA-256 (`api_key_sha256`, or computed from `api_key`) is passed on.
    `routing` (default cache-aware when there may be several engines caching prefixes, else
    power-of-two):
    cache-aware has the engines publish their prefix caches and the ingress follow them;
    `routing_load_threshold` (default `DEFAULT_LOAD_THRESHOLD`) is how many more ongoing
    requests than the lightest replica's the best-matching one may have and still be chosen.
    The Responses API keeps up to `responses_max_stored` responses for `responses_ttl_s`
    seconds each, in one `ResponseStore` replica every ingress replica shares. `cors` (default:
    vLLM's, any origin) is what browsers on other origins may do.
    """
    max_engines = (autoscaling_config or {}).get("max_replicas", num_replicas)
    several = max_engines > 1 and config.enable_prefix_caching
    routing = routing or ("cache-aware" if several else "power-of-two")
    if routing not in ROUTINGS:
        raise ValueError(f"routing: must be one of {', '.join(ROUTINGS)}, got {routing!r}")
    if routing == "cache-aware" and not config.enable_prefix_caching:
        raise ValueError("routing: cache-aware needs prefix caching, which is off")
    # The ingress routes cache-aware exactly when the engines publish their caches.
    config = config.model_copy(update={"enable_kv_cache_events": routing == "cache-aware"})
    guard = GuardSettings(
        api_key_sha256_of({"api_key": api_key, "api_key_sha256": api_key_sha256}),
        max_request_body_bytes,
    )
    options: dict[str, Any] = {"num_replicas": num_replicas}
    if autoscaling_config is not None:
        options = {"autoscaling_config": autoscaling_config}
    if health_check_period_s is not None:
        options["health_check_period_s"] = health_check_period_s
    if routing_load_threshold is not None:
        if routing_load_threshold < 0:
            raise ValueError(f"routing_load_threshold: must be >= 0, got {routing_load_threshold}")
        options["routing_load_threshold"] = routing_load_threshold
    engine_kwargs: dict[str, Any] = {"engine_builder": engine_builder}
    if stuck_after_s is not None:
        engine_kwargs["stuck_after_s"] = stuck_after_s
    engine = engine_deployment(config, **options).bind(config.model_dump(), **engine_kwargs)
    # NOTE: `serve.deployment` made these classes Deployments, which mypy cannot see.
    ingress = cast(Deployment, OpenAIIngress).options(
        num_replicas=num_ingress_replicas,
        ray_actor_options={"num_cpus": ingress_num_cpus},
        # An ingress replica being replaced drains as the engines do: its streams run through it.
        graceful_shutdown_timeout_s=drain_timeout_s(config),
        graceful_shutdown_wait_loop_s=DRAIN_POLL_S,
    )
    store = cast(Deployment, ResponseStoreDeployment).bind(
        max_responses=responses_max_stored, ttl_s=responses_ttl_s
    )
    cors = cors or CORSSettings()
    return ingress.bind(
        engine, config.model_dump(), *astuple(guard), response_store=store, cors=cors
    )


def build_app(args: dict[str, Any]) -> Application:
    """Serve's app builder: `serve run pagedray.cluster.openai_app:build_app model=... key=value`.

    Keys are `EngineConfig` fields (strings are coerced) plus `APP_ARGS`; `min_replicas` and
    `max_replicas` turn on autoscaling, on the engines' running and waiting sequences and KV cache
    usage (`EngineAutoscalingPolicy`). Without `model`, the default model is built and served.
    The API key is `api_key`, or the stripped content of `api_key_file`, or given only as its
    hex SHA-256 (`api_key_sha256`), so a config file need not hold the key itself.
    """
    args = {key: value for key, value in args.items() if value is not None}
    app_args = {key: args.pop(key) for key in APP_ARGS if key in args}
    if "model" not in args:
        from pagedray.tools.default_model import default_model_path

        args["model"] = str(default_model_path())
    # NOTE: at TP=1 the rank runs inside the engine replica (no worker actor, no pipe hop);
    # `use_ray_workers=true` makes it an actor of its own, as every rank is at TP > 1.
    config = EngineConfig.model_validate(args)
    autoscaling_config = None
    if "min_replicas" in app_args or "max_replicas" in app_args:
        low = int(app_args.pop("min_replicas", 1))
        high = int(app_args.pop("max_replicas", max(low, 1)))
        # On the engines' own load: sequences and KV cache (cluster/engine_autoscaling.py).
        autoscaling_config = engine_autoscaling_config(low, high, config.max_num_seqs)
    return build_openai_app(
        config,
        num_replicas=int(app_args.get("num_replicas", 1)),
        api_key_sha256=api_key_sha256_of(app_args),
        autoscaling_config=autoscaling_config,
        stuck_after_s=_float_or_none(app_args.get("stuck_after_s")),
        health_check_period_s=_float_or_none(app_args.get("health_check_period_s")),
        ingress_num_cpus=float(app_args.get("ingress_num_cpus", 0.0)),
        num_ingress_replicas=int(app_args.get("num_ingress_replicas", 1)),
        max_request_body_bytes=int(
            app_args.get("max_request_body_bytes", DEFAULT_MAX_REQUEST_BODY_BYTES)
        ),
        routing=app_args.get("routing"),
        routing_load_threshold=_int_or_none(app_args.get("routing_load_threshold")),
        responses_max_stored=int(app_args.get("responses_max_stored", DEFAULT_MAX_RESPONSES)),
        responses_ttl_s=float(app_args.get("responses_ttl_s", DEFAULT_TTL_S)),
        cors=cors_settings_of(app_args),
    )


def _float_or_none(value: Any) -> float | None:
    return None if value is None else float(value)


def _int_or_none(value: Any) -> int | None:
    return None if value is None else int(value)
