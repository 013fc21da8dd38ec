"""The Serve application: the OpenAI ingress bound to its engine replicas, built from Python
(`build_openai_app`) or from Serve's builder arguments (`build_app`, which `serve run`, Serve
config files and the Helm chart reach as `pagedray.cluster.openai_app:build_app`).
"""

from __future__ import annotations

import os
from dataclasses import astuple
from typing import Any, Callable, cast

from ray.serve import Application, Deployment

from pagedray.cluster.engine_autoscaling import engine_autoscaling_config
from pagedray.cluster.engine_deployment import DRAIN_POLL_S, drain_timeout_s, engine_deployment
from pagedray.cluster.ingress_deployment import OpenAIIngress
from pagedray.cluster.response_store_deployment import ResponseStoreDeployment
from pagedray.cluster.server_config import ServerConfig
from pagedray.engine.config import EngineConfig, validated
from pagedray.openai.ingress_guard import GuardSettings

# A call to an engine whose connection broke fails at once, as KubeRay sets for every RayService:
# Ray would otherwise hold it up to two seconds waiting for the GCS to report the actor dead,
# which for a lost node comes only after the GCS's health checks give up (tens of seconds). The
# ingress then moves the call's requests (cluster/migration.py); a live engine that lost one
# connection costs a move, token-exact, and no more.
DEATH_INFO_WAIT_ENV = "RAY_timeout_ms_task_wait_for_death_info"


def ingress_runtime_env() -> dict[str, Any]:
    """The ingress's runtime env: the job's (what Serve gives a deployment that names none of its
    own: its pip, py_modules, env_vars), with no wait for death reports. A wait the job's env or
    the environment of the process building the app sets is kept."""
    import ray

    job = dict(ray.get_runtime_context().runtime_env) if ray.is_initialized() else {}
    env_vars = {DEATH_INFO_WAIT_ENV: os.environ.get(DEATH_INFO_WAIT_ENV, "0")}
    return {**job, "env_vars": {**env_vars, **(job.get("env_vars") or {})}}


EngineBuilder = Callable[[EngineConfig], tuple[Any, Any, Any, Any]]


def build_openai_app(
    config: EngineConfig,
    engine_builder: EngineBuilder | None = None,
    autoscaling_config: dict[str, Any] | None = None,
    **settings: Any,
) -> Application:
    """The ingress bound to its engines: `config` (an `EngineConfig`, or a whole
    `ServerConfig`), with `settings` (more `ServerConfig` fields) on top.

    `engine_builder` replaces `build_engine` in every engine replica (tests inject faults), and
    `autoscaling_config` Serve's own autoscaling options for the engines (else they come from
    `min_replicas`/`max_replicas`, on the engines' own load). Only the API key's SHA-256 reaches
    the ingress, and the engines an `EngineConfig`, which holds no key.
    """
    if autoscaling_config is not None:
        settings.setdefault("min_replicas", autoscaling_config["min_replicas"])
        settings.setdefault("max_replicas", autoscaling_config["max_replicas"])
    server = validated(ServerConfig, {**config.model_dump(), **settings})
    engine_config = server.engine_config()
    if autoscaling_config is None and server.autoscaled:
        # On the engines' own load: sequences and KV cache (cluster/engine_autoscaling.py).
        autoscaling_config = engine_autoscaling_config(
            server.min_engines, server.max_engines, server.max_num_seqs
        )
    options: dict[str, Any] = {"num_replicas": server.num_replicas}
    if autoscaling_config is not None:
        options = {"autoscaling_config": autoscaling_config}
    if server.health_check_period_s is not None:
        options["health_check_period_s"] = server.health_check_period_s
    if server.routing_load_threshold is not None:
        options["routing_load_threshold"] = server.routing_load_threshold
    if server.routing_tier_weight is not None:
        options["routing_tier_weight"] = server.routing_tier_weight
    if server.routing_disk_weight is not None:
        options["routing_disk_weight"] = server.routing_disk_weight
    if server.routing_pull_min_blocks is not None:
        options["routing_pull_min_blocks"] = server.routing_pull_min_blocks
    engine_kwargs: dict[str, Any] = {"engine_builder": engine_builder}
    if server.stuck_after_s is not None:
        engine_kwargs["stuck_after_s"] = server.stuck_after_s
    engine = engine_deployment(engine_config, **options).bind(
        engine_config.model_dump(), **engine_kwargs
    )
    # NOTE: `serve.deployment` made these classes Deployments, which mypy cannot see.
    ingress = cast(Deployment, OpenAIIngress).options(
        num_replicas=server.num_ingress_replicas,
        ray_actor_options={
            "num_cpus": server.ingress_num_cpus,
            "runtime_env": ingress_runtime_env(),
        },
        # An ingress replica being replaced drains as the engines do: its streams run through it.
        graceful_shutdown_timeout_s=drain_timeout_s(engine_config),
        graceful_shutdown_wait_loop_s=DRAIN_POLL_S,
    )
    if server.disable_uvicorn_access_log:
        # NOTE: only when asked: a deployment's own logging_config hides the application's.
        ingress = ingress.options(logging_config={"enable_access_log": False})
    store = cast(Deployment, ResponseStoreDeployment).bind(
        max_responses=server.responses_max_stored, ttl_s=server.responses_ttl_s
    )
    guard = GuardSettings(server.api_key_digest(), server.max_request_body_bytes)
    return ingress.bind(
        engine,
        engine_config.model_dump(),
        *astuple(guard),
        response_store=store,
        cors=server.cors(),
    )


def build_app(args: dict[str, Any]) -> Application:
    """Serve's app builder: `serve run pagedray.cluster.openai_app:build_app model=... key=value`.

    `args` are `ServerConfig` fields (strings as Serve's command line gives them are read as the
    fields' types); without `model`, the default model is built and served. The API key is
    `api_key`, or the stripped content of `api_key_file`, or given only as its hex SHA-256
    (`api_key_sha256`), so a config file need not hold the key itself. At TP=1 the rank runs
    inside the engine replica; `use_ray_workers=true` makes it an actor of its own.
    """
    args = {key: value for key, value in args.items() if value is not None}
    if "model" not in args:
        from pagedray.tools.default_model import default_model_path

        args["model"] = str(default_model_path())
    return build_openai_app(validated(ServerConfig, args))
