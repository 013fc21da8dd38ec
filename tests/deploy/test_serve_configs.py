"""The Serve config files in deploy/serve/: Ray Serve's schema accepts them, their import path
imports, and pagedray's app builder accepts their args and builds the deployments they describe
(without starting Ray)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from ray.serve.schema import ServeApplicationSchema, ServeDeploySchema

ROOT = Path(__file__).resolve().parents[2]
IMPORT_PATH = "pagedray.cluster.openai_app:build_app"
CONFIGS = ["deploy/serve/pagedray.yaml", "deploy/serve/pagedray-cpu.yaml"]


def _application(path: str) -> ServeApplicationSchema:
    config = ServeDeploySchema.model_validate(yaml.safe_load((ROOT / path).read_text()))
    (application,) = config.applications
    return application


def _app_builder() -> Any:
    try:
        from ray._common.utils import import_attr
    except ImportError:  # older Ray
        from ray._private.utils import import_attr
    try:
        return import_attr(IMPORT_PATH)
    except ModuleNotFoundError as error:
        if error.name == "pagedray.cluster.openai_app":
            pytest.skip("cluster/openai_app.py does not exist yet: the import path cannot import")
        raise


def _build(args: dict[str, Any]) -> dict[str, Any]:
    """Deployment name -> its Serve options, as `serve deploy` would build them."""
    from ray.serve._private.build_app import build_app as serve_build_app

    application = _app_builder()(args)
    built = serve_build_app(application, name="pagedray")
    return {
        deployment.name: {
            "bundles": deployment._replica_config.placement_group_bundles,
            "strategy": deployment._replica_config.placement_group_strategy,
            "num_replicas": deployment._deployment_config.num_replicas,
            "autoscaling": deployment._deployment_config.autoscaling_config,
            "actor_options": deployment._replica_config.ray_actor_options,
        }
        for deployment in built.deployments
    }


@pytest.mark.parametrize("path", CONFIGS)
def test_config_parses_as_serve_deploy_schema(path: str) -> None:
    application = _application(path)
    assert application.import_path == IMPORT_PATH
    assert application.route_prefix == "/"
    # The standalone single-application schema accepts it too (`serve run` of one app).
    ServeApplicationSchema.model_validate(application.model_dump(exclude_unset=True))


@pytest.mark.parametrize("path", CONFIGS)
def test_import_path_imports(path: str) -> None:
    assert callable(_app_builder())


def test_gpu_config_builds_tensor_parallel_engines_on_gpus() -> None:
    args = dict(_application(CONFIGS[0]).args)
    assert args["device"] == "cuda"  # "auto" would see no GPU in a cluster still scaling up
    deployments = _build(args)
    engine = deployments["PagedRayEngine"]
    tensor_parallel_size = args["tensor_parallel_size"]
    assert engine["strategy"] == "STRICT_PACK"
    assert engine["bundles"] == [{"CPU": 1}] + [{"GPU": 1, "CPU": 1}] * tensor_parallel_size
    assert engine["num_replicas"] == args["num_replicas"]
    assert "GPU" not in str(deployments["OpenAIIngress"]["bundles"])


def test_gpu_config_autoscaling_args() -> None:
    args = dict(_application(CONFIGS[0]).args)
    del args["num_replicas"]
    engine = _build({**args, "min_replicas": 1, "max_replicas": 3})["PagedRayEngine"]
    assert (engine["autoscaling"].min_replicas, engine["autoscaling"].max_replicas) == (1, 3)


def test_cpu_config_builds_a_cpu_engine(tmp_path: Path) -> None:
    args = dict(_application(CONFIGS[1]).args)
    assert "model" not in args  # the built-in default model
    # NOTE: a model path keeps build_app from building the default model here; it is not read.
    deployments = _build({**args, "model": str(tmp_path)})
    engine = deployments["PagedRayEngine"]
    # TP=1: the rank runs in the engine replica, which holds one rank's CPU.
    assert engine["bundles"] == [{"CPU": 1}]
    total_cpus = sum(bundle["CPU"] for bundle in engine["bundles"])
    total_cpus += deployments["OpenAIIngress"]["actor_options"]["num_cpus"]
    assert total_cpus <= 2, "the CPU config should fit a 2-CPU machine"


def test_the_ingress_fails_a_call_to_a_broken_engine_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its process does not wait for the GCS's word on an engine whose connection broke (for a
    lost node, the GCS's health checks take tens of seconds): the call fails, its requests move
    (issue P14). A value the operator set is kept."""
    from pagedray.cluster.openai_app import DEATH_INFO_WAIT_ENV

    monkeypatch.delenv(DEATH_INFO_WAIT_ENV, raising=False)
    args = {**_application(CONFIGS[1]).args, "model": str(tmp_path)}
    env = _build(args)["OpenAIIngress"]["actor_options"]["runtime_env"]["env_vars"]
    assert env["RAY_timeout_ms_task_wait_for_death_info"] == "0"
    monkeypatch.setenv(DEATH_INFO_WAIT_ENV, "250")
    env = _build(args)["OpenAIIngress"]["actor_options"]["runtime_env"]["env_vars"]
    assert env[DEATH_INFO_WAIT_ENV] == "250"


def test_the_ingress_keeps_the_jobs_runtime_env(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Naming a runtime env of its own, the ingress would lose the one Serve gives deployments
    that name none (the job's): it carries the job's over, its env_vars merged."""
    import ray

    from pagedray.cluster.openai_app import DEATH_INFO_WAIT_ENV

    monkeypatch.delenv(DEATH_INFO_WAIT_ENV, raising=False)
    job = {"pip": ["example-package"], "env_vars": {"TOKENIZERS_PARALLELISM": "false"}}

    class Context:
        runtime_env = job

    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray, "get_runtime_context", Context)
    args = {**_application(CONFIGS[1]).args, "model": str(tmp_path)}
    runtime_env = _build(args)["OpenAIIngress"]["actor_options"]["runtime_env"]
    assert runtime_env == {
        "pip": ["example-package"],
        "env_vars": {"TOKENIZERS_PARALLELISM": "false", DEATH_INFO_WAIT_ENV: "0"},
    }
