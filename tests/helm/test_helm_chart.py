"""The Helm chart, rendered and linted by Helm's own engine (helm-python-sdk binds Helm's Go SDK),
its RayService validated against KubeRay's CRD schema, its serveConfigV2 built by pagedray."""

from __future__ import annotations

import copy
import gzip
import math
from functools import cache
from pathlib import Path
from typing import Any

import helm_python as helm
import pytest
import yaml
from jsonschema import Draft7Validator, FormatChecker, ValidationError
from ray.serve.schema import ServeDeploySchema

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm/pagedray"
# KubeRay's RayService CRD, shipped with the tests (tests/helm/kuberay/README.md says whence).
CRD = Path(__file__).parent / "kuberay/ray.io_rayservices.yaml.gz"
RELEASE, NAMESPACE = "llm", "serving"
TP4_X2 = {"engine": {"tensorParallelSize": 4, "replicas": 2}}
MONITORING_ON = {
    "monitoring": {"podMonitor": {"enabled": True}, "grafanaDashboard": {"enabled": True}}
}
STANDARD_LABELS = (
    "helm.sh/chart",
    "app.kubernetes.io/name",
    "app.kubernetes.io/instance",
    "app.kubernetes.io/version",
    "app.kubernetes.io/managed-by",
)


# ---- KubeRay's schema, read as the API server would with strict field validation -------------


def _kube_schema(node: Any) -> Any:
    """An OpenAPI v3 CRD schema as JSON Schema: int-or-string, nullable, and unknown fields refused
    (the API server prunes them silently; `kubectl apply --validate=strict` refuses them)."""
    if not isinstance(node, dict):
        return node
    out = {key: value for key, value in node.items() if not key.startswith("x-kubernetes-")}
    out.pop("nullable", None)
    if "properties" in out:
        out["properties"] = {name: _kube_schema(sub) for name, sub in out["properties"].items()}
    for key in ("items", "additionalProperties", "not"):
        if isinstance(out.get(key), dict):
            out[key] = _kube_schema(out[key])
    for key in ("anyOf", "allOf", "oneOf"):
        if key in out:
            out[key] = [_kube_schema(sub) for sub in out[key]]
    if node.get("x-kubernetes-int-or-string"):
        out.pop("type", None)
        out.setdefault("anyOf", [{"type": "integer"}, {"type": "string"}])
    if node.get("nullable") and "type" in out:
        out["type"] = [out["type"], "null"]
    preserve = node.get("x-kubernetes-preserve-unknown-fields", False)
    if out.get("type") == "object" and "properties" in out and not preserve:
        out.setdefault("additionalProperties", False)
    return out


@cache
def _rayservice_validator() -> Draft7Validator:
    crd = yaml.safe_load(gzip.decompress(CRD.read_bytes()))
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    checker = FormatChecker()

    @checker.checks("int32")
    def _int32(value: object) -> bool:
        return not isinstance(value, int) or -(2**31) <= value < 2**31

    @checker.checks("int64")
    def _int64(value: object) -> bool:
        return not isinstance(value, int) or -(2**63) <= value < 2**63

    schema = _kube_schema(version["schema"]["openAPIV3Schema"])
    return Draft7Validator(schema, format_checker=checker)


def validate_rayservice(rayservice: dict[str, Any]) -> None:
    errors = sorted(_rayservice_validator().iter_errors(rayservice), key=lambda e: e.path)
    if errors:
        raise errors[0]


# ---- rendering ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def chart() -> helm.Chart:
    return helm.Chart.load(CHART)


def _merge(*layers: dict[str, Any]) -> dict[str, Any]:
    merged: dict[str, Any] = {}
    for layer in layers:
        _merge_into(merged, copy.deepcopy(layer))
    return merged


def _merge_into(target: dict[str, Any], layer: dict[str, Any]) -> None:
    for key, value in layer.items():
        if isinstance(value, dict) and isinstance(target.get(key), dict):
            _merge_into(target[key], value)
        else:
            target[key] = value


def render(chart: helm.Chart, *layers: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """Rendered objects by kind, as `helm template` would print them."""
    manifests = chart.render(
        _merge(*layers) or None, name=RELEASE, namespace=NAMESPACE, is_install=True
    )
    objects: dict[str, list[dict[str, Any]]] = {}
    for path, text in manifests.items():
        if path.endswith("NOTES.txt"):
            continue
        for document in yaml.safe_load_all(text):
            if document:
                objects.setdefault(document["kind"], []).append(document)
    return objects


def _rayservice(objects: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    (rayservice,) = objects["RayService"]
    return rayservice


def _gpu_group(rayservice: dict[str, Any]) -> dict[str, Any]:
    (group,) = rayservice["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    return group


def _serve_application(rayservice: dict[str, Any]) -> Any:
    serve_config = yaml.safe_load(rayservice["spec"]["serveConfigV2"])
    (application,) = ServeDeploySchema.model_validate(serve_config).applications
    return application


# ---- lint and schema ---------------------------------------------------------------------------


@pytest.mark.parametrize("values", [{}, TP4_X2, MONITORING_ON], ids=["default", "tp4x2", "mon"])
def test_lint_is_clean(values: dict[str, Any]) -> None:
    report = helm.lint(CHART, values or None, strict=True, namespace=NAMESPACE)
    assert report["errors"] == []
    # Severity 1 is informational ("icon is recommended"); 2 and up are warnings and errors.
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


def test_chart_metadata(chart: helm.Chart) -> None:
    assert (chart.name, chart.version) == ("pagedray", "0.1.0")


@pytest.mark.parametrize(
    "values",
    [{}, TP4_X2, _merge(TP4_X2, MONITORING_ON), {"model": {"source": "initContainer"}}],
    ids=["default", "tp4x2", "tp4x2-monitoring", "init-container"],
)
def test_rayservice_matches_kuberay_crd(chart: helm.Chart, values: dict[str, Any]) -> None:
    rayservice = _rayservice(render(chart, values))
    assert rayservice["apiVersion"] == "ray.io/v1"
    validate_rayservice(rayservice)


def test_crd_validation_catches_a_misspelt_field(chart: helm.Chart) -> None:
    rayservice = _rayservice(render(chart))
    misspelt = copy.deepcopy(rayservice)
    _gpu_group(misspelt)["replicaz"] = _gpu_group(misspelt).pop("replicas")
    with pytest.raises(ValidationError, match="replicaz"):
        validate_rayservice(misspelt)
    wrong_type = copy.deepcopy(rayservice)
    _gpu_group(wrong_type)["replicas"] = "two"
    with pytest.raises(ValidationError):
        validate_rayservice(wrong_type)


def test_values_schema_refuses_a_misspelt_value(chart: helm.Chart) -> None:
    with pytest.raises(helm.HelmError, match="tensorParalelSize"):
        render(chart, {"engine": {"tensorParalelSize": 4}})


def test_engine_larger_than_a_pod_fails(chart: helm.Chart) -> None:
    values = {"engine": {"tensorParallelSize": 8}, "gpuWorkers": {"gpusPerPod": 4}}
    with pytest.raises(helm.HelmError, match="must share a pod"):
        render(chart, values)


# ---- what the RayService runs ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("tensor_parallel_size", "replicas", "gpus_per_pod", "pods"),
    [(1, 1, None, 1), (4, 2, None, 2), (4, 2, 8, 1), (2, 3, 8, 1), (2, 3, 4, 2), (3, 4, 4, 4)],
)
def test_gpu_worker_pods_follow_tp_times_replicas(
    chart: helm.Chart,
    tensor_parallel_size: int,
    replicas: int,
    gpus_per_pod: int | None,
    pods: int,
) -> None:
    values = {
        "engine": {"tensorParallelSize": tensor_parallel_size, "replicas": replicas},
        "gpuWorkers": {"gpusPerPod": gpus_per_pod},
    }
    rayservice = _rayservice(render(chart, values))
    group = _gpu_group(rayservice)
    assert group["replicas"] == group["minReplicas"] == group["maxReplicas"] == pods
    gpus = gpus_per_pod or tensor_parallel_size
    if gpus % tensor_parallel_size == 0:
        assert pods == math.ceil(tensor_parallel_size * replicas / gpus)
    (container,) = group["template"]["spec"]["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == gpus
    assert container["resources"]["requests"]["nvidia.com/gpu"] == gpus
    assert rayservice["spec"]["rayClusterConfig"]["enableInTreeAutoscaling"] is False
    validate_rayservice(rayservice)


def test_autoscaling_bounds_engines_and_pods(chart: helm.Chart) -> None:
    values = _merge(
        TP4_X2,
        {"engine": {"autoscaling": {"enabled": True, "minReplicas": 1, "maxReplicas": 5}}},
        {"gpuWorkers": {"gpusPerPod": 8}},
    )
    rayservice = _rayservice(render(chart, values))
    assert rayservice["spec"]["rayClusterConfig"]["enableInTreeAutoscaling"] is True
    group = _gpu_group(rayservice)
    assert (group["minReplicas"], group["replicas"], group["maxReplicas"]) == (1, 1, 3)
    args = _serve_application(rayservice).args
    assert (args["min_replicas"], args["max_replicas"]) == (1, 5)
    assert "num_replicas" not in args


def test_head_has_no_gpus(chart: helm.Chart) -> None:
    head = _rayservice(render(chart, TP4_X2))["spec"]["rayClusterConfig"]["headGroupSpec"]
    assert head["rayStartParams"]["num-gpus"] == "0"
    (container,) = head["template"]["spec"]["containers"]
    assert "nvidia.com/gpu" not in str(container["resources"])


def test_ray_exports_metrics_and_uses_token_auth(chart: helm.Chart) -> None:
    rayservice = _rayservice(render(chart))
    cluster = rayservice["spec"]["rayClusterConfig"]
    for group in (cluster["headGroupSpec"], _gpu_group(rayservice)):
        assert group["rayStartParams"]["metrics-export-port"] == "8080"
        (container,) = group["template"]["spec"]["containers"]
        assert {"containerPort": 8080, "name": "metrics"} in container["ports"]
    assert cluster["authOptions"] == {"mode": "token"}
    assert cluster["rayVersion"] == "2.60.0"
    off = _rayservice(render(chart, {"rayAuth": {"enabled": False}}))
    assert "authOptions" not in off["spec"]["rayClusterConfig"]


@pytest.mark.parametrize("values", [{}, TP4_X2], ids=["default", "tp4x2"])
def test_serve_config_builds_pagedray(chart: helm.Chart, values: dict[str, Any]) -> None:
    from ray.serve._private.build_app import build_app as serve_build_app

    from pagedray.cluster.openai_app import build_app

    application = _serve_application(_rayservice(render(chart, values)))
    assert application.import_path == "pagedray.cluster.openai_app:build_app"
    args = application.args
    assert args["model"] == "/mnt/models/Qwen2.5-7B-Instruct"
    assert args["device"] == "cuda"
    tensor_parallel_size = values.get("engine", {}).get("tensorParallelSize", 1)
    assert args["tensor_parallel_size"] == tensor_parallel_size
    built = serve_build_app(build_app(dict(args)), name="pagedray")
    (engine,) = [d for d in built.deployments if d.name == "PagedRayEngine"]
    bundles = engine._replica_config.placement_group_bundles
    rank = {"GPU": 1, "CPU": 1}
    # TP=1: the rank runs in the engine replica, whose bundle holds its GPU.
    expected = [rank] if tensor_parallel_size == 1 else [{"CPU": 1}] + [rank] * tensor_parallel_size
    assert bundles == expected
    assert engine._deployment_config.num_replicas == values.get("engine", {}).get("replicas", 1)


def test_engine_values_reach_the_app_args(chart: helm.Chart) -> None:
    values = {
        "engine": {
            "blockSize": 32,
            "numKvBlocks": 4096,
            "maxModelLen": 8192,
            "dtype": "bfloat16",
            "extraArgs": {"scheduling_policy": "priority", "block_size": 64},
        },
        "model": {"path": "Llama-3.1-8B-Instruct", "servedModelName": "llama"},
    }
    args = _serve_application(_rayservice(render(chart, values))).args
    assert args["num_kv_blocks"] == 4096
    assert args["max_model_len"] == 8192
    assert args["dtype"] == "bfloat16"
    assert args["scheduling_policy"] == "priority"
    assert args["block_size"] == 64  # extraArgs win
    assert args["served_model_name"] == "llama"
    assert args["model"] == "/mnt/models/Llama-3.1-8B-Instruct"
    assert "kv_cache_memory_gb" not in _serve_application(_rayservice(render(chart))).args


# ---- model, service, monitoring, labels --------------------------------------------------------


def _pod_templates(rayservice: dict[str, Any]) -> list[dict[str, Any]]:
    """The head's and the GPU workers' pod templates."""
    head = rayservice["spec"]["rayClusterConfig"]["headGroupSpec"]
    return [head["template"], _gpu_group(rayservice)["template"]]


def _pod_specs(rayservice: dict[str, Any]) -> list[dict[str, Any]]:
    return [template["spec"] for template in _pod_templates(rayservice)]


@pytest.mark.parametrize(
    ("source", "volume_key"),
    [("pvc", "persistentVolumeClaim"), ("hostPath", "hostPath"), ("initContainer", "emptyDir")],
)
def test_model_source(chart: helm.Chart, source: str, volume_key: str) -> None:
    values = {"model": {"source": source}, "hfToken": {"secretName": "hf-token"}}
    head, worker = _pod_specs(_rayservice(render(chart, values)))
    for spec in (head, worker):
        (volume,) = [v for v in spec["volumes"] if v["name"] == "models"]
        assert volume_key in volume
        (container,) = spec["containers"]
        mount = {"name": "models", "mountPath": "/mnt/models", "readOnly": True}
        assert mount in container["volumeMounts"]
        assert any(env["name"] == "HF_TOKEN" for env in container["env"])
        assert ("initContainers" in spec) == (source == "initContainer")
    if source == "initContainer":
        head_download = " ".join(head["initContainers"][0]["args"])
        worker_download = " ".join(worker["initContainers"][0]["args"])
        assert '--exclude "*.safetensors"' in head_download  # the ingress needs no weights
        assert "--exclude" not in worker_download


def test_unknown_model_source_fails(chart: helm.Chart) -> None:
    with pytest.raises(helm.HelmError):
        render(chart, {"model": {"source": "s3"}})


def test_service_exposes_the_openai_port(chart: helm.Chart) -> None:
    objects = render(chart)
    (service,) = objects["Service"]
    (port,) = service["spec"]["ports"]
    assert (port["port"], port["targetPort"]) == (8000, "serve")
    selector = dict(service["spec"]["selector"])
    assert selector.pop("ray.io/serve") == "true"  # set by KubeRay on pods serving traffic
    for template in _pod_templates(_rayservice(objects)):
        assert selector.items() <= template["metadata"]["labels"].items()


def test_monitoring_objects_only_when_enabled(chart: helm.Chart) -> None:
    objects = render(chart)
    assert "PodMonitor" not in objects
    assert "ConfigMap" not in objects
    objects = render(chart, MONITORING_ON)
    (pod_monitor,) = objects["PodMonitor"]
    assert pod_monitor["apiVersion"] == "monitoring.coreos.com/v1"
    (endpoint,) = pod_monitor["spec"]["podMetricsEndpoints"]
    assert endpoint["port"] == "metrics"
    selector = pod_monitor["spec"]["selector"]["matchLabels"]
    for template in _pod_templates(_rayservice(objects)):
        assert selector.items() <= template["metadata"]["labels"].items()
        ports = template["spec"]["containers"][0]["ports"]
        assert any(port["name"] == "metrics" for port in ports)
    (config_map,) = objects["ConfigMap"]
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    dashboard = (ROOT / "deploy/grafana/pagedray.json").read_text()
    assert config_map["data"]["pagedray.json"] == dashboard.rstrip("\n")


def test_podmonitor_extra_labels(chart: helm.Chart) -> None:
    values = {"monitoring": {"podMonitor": {"enabled": True, "labels": {"release": "kps"}}}}
    (pod_monitor,) = render(chart, values)["PodMonitor"]
    assert pod_monitor["metadata"]["labels"]["release"] == "kps"


def test_standard_labels_everywhere(chart: helm.Chart) -> None:
    objects = render(chart, MONITORING_ON)
    assert set(objects) == {"RayService", "Service", "PodMonitor", "ConfigMap"}
    for kind_objects in objects.values():
        for obj in kind_objects:
            labels = obj["metadata"]["labels"]
            assert all(label in labels for label in STANDARD_LABELS), obj["kind"]
            assert labels["app.kubernetes.io/instance"] == RELEASE
            assert labels["app.kubernetes.io/name"] == "pagedray"
    for template in _pod_templates(_rayservice(objects)):
        labels = template["metadata"]["labels"]
        assert all(label in labels for label in STANDARD_LABELS)
        assert labels["app.kubernetes.io/component"] in {"ray-head", "ray-gpu-worker"}


def test_notes_render(chart: helm.Chart) -> None:
    manifests = chart.render(TP4_X2, name=RELEASE, namespace=NAMESPACE, is_install=True)
    (notes,) = [text for path, text in manifests.items() if path.endswith("NOTES.txt")]
    assert "kubectl -n serving port-forward svc/llm-pagedray 8000:8000" in notes
    assert "tensor_parallel_size 4" in notes


def test_routing_reaches_the_app_only_when_set(chart: helm.Chart) -> None:
    assert "routing" not in _serve_application(_rayservice(render(chart, TP4_X2))).args
    values = _merge(TP4_X2, {"engine": {"routing": "power-of-two"}})
    assert _serve_application(_rayservice(render(chart, values))).args["routing"] == "power-of-two"
    with pytest.raises(helm.HelmError, match="routing"):
        render(chart, _merge(TP4_X2, {"engine": {"routing": "random"}}))


def test_tier_weights_and_pulls_reach_the_app_only_when_set(chart: helm.Chart) -> None:
    default_args = _serve_application(_rayservice(render(chart, TP4_X2))).args
    names = ("routing_tier_weight", "routing_disk_weight", "routing_pull_min_blocks")
    assert not set(names) & set(default_args)
    engine = {"routingTierWeight": 0.5, "routingDiskWeight": 0, "routingPullMinBlocks": 8}
    args = _serve_application(_rayservice(render(chart, _merge(TP4_X2, {"engine": engine})))).args
    assert [args[name] for name in names] == [0.5, 0, 8]
    with pytest.raises(helm.HelmError, match="routingTierWeight"):
        render(chart, _merge(TP4_X2, {"engine": {"routingTierWeight": 2}}))


def test_routing_load_threshold_reaches_the_app_only_when_set(chart: helm.Chart) -> None:
    default_args = _serve_application(_rayservice(render(chart, TP4_X2))).args
    assert "routing_load_threshold" not in default_args
    values = _merge(TP4_X2, {"engine": {"routingLoadThreshold": 8}})
    args = _serve_application(_rayservice(render(chart, values))).args
    assert args["routing_load_threshold"] == 8
    with pytest.raises(helm.HelmError, match="routingLoadThreshold"):
        render(chart, _merge(TP4_X2, {"engine": {"routingLoadThreshold": -1}}))


@pytest.mark.parametrize(
    ("extra", "seconds"),
    [({}, 630), ({"request_timeout_s": 60}, 90), ({"request_timeout_s": 0}, 3630)],
)
def test_pods_wait_out_the_replicas_drain(chart: helm.Chart, extra: dict, seconds: int) -> None:
    """Kubernetes' 30 s default would kill the streams a draining replica lets finish."""
    rayservice = _rayservice(render(chart, {"engine": {"extraArgs": extra}}))
    cluster = rayservice["spec"]["rayClusterConfig"]
    for group in (cluster["headGroupSpec"], _gpu_group(rayservice)):
        assert group["template"]["spec"]["terminationGracePeriodSeconds"] == seconds
