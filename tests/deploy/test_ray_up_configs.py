"""The `ray up` cluster configs in deploy/ray-up/, checked by Ray's own autoscaler code.

prepare_config fills in the provider's defaults (read from files shipped with Ray) and
validate_config checks the result against Ray's ray-schema.json, which refuses unknown fields.
Sockets are blocked throughout: nothing here may reach a cloud.
"""

from __future__ import annotations

import copy
import socket
from pathlib import Path
from typing import Any

import pytest
import yaml
from jsonschema import ValidationError
from ray.autoscaler._private.util import prepare_config, validate_config

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ["aws", "gcp", "local"]
SERVE_CONFIG = ROOT / "deploy/serve/pagedray.yaml"


@pytest.fixture(autouse=True)
def no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a network connection was attempted")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


def _load(name: str) -> dict[str, Any]:
    return yaml.safe_load((ROOT / f"deploy/ray-up/{name}.yaml").read_text())


def _prepared(config: dict[str, Any]) -> dict[str, Any]:
    prepared = prepare_config(copy.deepcopy(config))
    validate_config(prepared)
    return prepared


def _serve_tensor_parallel_size() -> int:
    serve_config = yaml.safe_load(SERVE_CONFIG.read_text())
    return int(serve_config["applications"][0]["args"]["tensor_parallel_size"])


@pytest.mark.parametrize("name", CONFIGS)
def test_config_validates_against_ray_schema(name: str) -> None:
    prepared = _prepared(_load(name))
    assert prepared["head_node_type"] in prepared["available_node_types"]


@pytest.mark.parametrize("name", CONFIGS)
def test_misspelt_field_fails(name: str) -> None:
    config = _load(name)
    config["max_workerz"] = config.pop("max_workers")
    with pytest.raises(ValidationError, match="max_workerz"):
        _prepared(config)


@pytest.mark.parametrize("name", ["aws", "gcp"])
def test_misspelt_node_type_field_fails(name: str) -> None:
    config = _load(name)
    config["available_node_types"]["gpu_4x"]["min_workerz"] = 1
    with pytest.raises(ValidationError, match="min_workerz"):
        _prepared(config)


@pytest.mark.parametrize("name", ["aws", "gcp"])
def test_gpu_workers_hold_a_whole_engine(name: str) -> None:
    """Tensor parallelism stays in a node: every GPU type fits the Serve config's TP size."""
    node_types = _prepared(_load(name))["available_node_types"]
    head = node_types.pop("head")
    assert "GPU" not in head["resources"]
    assert {node["resources"]["GPU"] for node in node_types.values()} == {4, 8}
    tensor_parallel_size = _serve_tensor_parallel_size()
    for node in node_types.values():
        gpus, cpus = node["resources"]["GPU"], node["resources"]["CPU"]
        engines = gpus // tensor_parallel_size
        assert engines >= 1
        # Each engine reserves 1 CPU for itself and 1 per rank.
        assert cpus >= engines * (tensor_parallel_size + 1)
    assert sum(node.get("min_workers", 0) for node in node_types.values()) >= 1


@pytest.mark.parametrize("name", CONFIGS)
def test_ray_starts_with_metrics_and_token_auth_and_deploys_serve(name: str) -> None:
    config = _load(name)
    head = " ".join(config["head_start_ray_commands"])
    workers = " ".join(config["worker_start_ray_commands"])
    for commands in (head, workers):
        assert "--metrics-export-port=8080" in commands
        assert "RAY_AUTH_MODE=token" in commands
    assert "ray start --head" in head
    assert "serve deploy ~/pagedray-deploy/serve/pagedray.yaml" in head
    # The token every node authenticates with is the one on the machine running `ray up`.
    assert config["file_mounts"]["~/.ray/auth_token"] == "~/.ray/auth_token"


@pytest.mark.parametrize("name", CONFIGS)
def test_pagedray_is_installed_from_the_wheel_and_mounts_exist(name: str) -> None:
    config = _load(name)
    setup = " ".join(config["setup_commands"])
    assert "pagedray-dist/pagedray-*.whl" in setup
    assert "ray[default,serve]==2.60.0" in setup
    mounts = config["file_mounts"]
    assert mounts["~/pagedray-dist"] == "./dist"  # built by `pip wheel --no-deps -w dist .`
    assert (ROOT / mounts["~/pagedray-deploy"] / "serve/pagedray.yaml").is_file()


@pytest.mark.parametrize("name", CONFIGS)
def test_model_is_downloaded_where_the_serve_config_looks(name: str) -> None:
    config = _load(name)
    model = yaml.safe_load(SERVE_CONFIG.read_text())["applications"][0]["args"]["model"]
    commands = config["setup_commands"] + config.get("worker_setup_commands", [])
    assert any(f"--local-dir {model}" in command for command in commands)


def test_local_provider_lists_the_machines() -> None:
    config = _load("local")
    provider = config["provider"]
    assert provider["type"] == "local"
    assert provider["head_ip"] and provider["worker_ips"]
    prepared = _prepared(config)
    (node_type,) = prepared["available_node_types"].values()
    assert node_type["min_workers"] == node_type["max_workers"] == len(provider["worker_ips"])
