"""Engine and ingress metrics: the names the dashboard queries, what `AsyncEngine` and the
ingress middleware record (through fakes), and the engine's read back from the Ray session's own
Prometheus endpoint (the ingress's, through Serve: tests/cluster/test_openai_server.py)."""

from __future__ import annotations

import argparse
import asyncio
import socket
import time
import urllib.request
import uuid
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.responses import StreamingResponse
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families
from ray.util.metrics import Counter, Gauge, Histogram

from pagedray.cli.serve import add_serve_parser
from pagedray.cluster.engine_metrics import EngineMetrics
from pagedray.cluster.ingress_metrics import IngressMetrics, RouterMetrics
from pagedray.cluster.metrics_endpoint import merge_pagedray_families
from pagedray.engine import async_engine
from pagedray.engine.async_engine import AsyncEngine
from pagedray.engine.config import EngineConfig
from pagedray.engine.engine_factory import build_engine
from pagedray.engine.output_processor import OutputProcessor
from pagedray.observability.grafana_dashboard import METRIC_NAMES
from pagedray.openai.serving import HTTPMetricsMiddleware, error_response
from pagedray.scheduler.sampling_params import SamplingParams

MAX_TOKENS = 5
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
CHOICE = SamplingParams(
    temperature=0.0, max_tokens=MAX_TOKENS, structured_outputs={"choice": ["yes", "no"]}
)
# Ray's metrics agent exports every metrics_report_interval_ms (10 s by default).
EXPORT_TIMEOUT_S = 30.0


class _Recorder:
    """Stands in for a Ray metric: keeps every value it is given."""

    def __init__(self) -> None:
        self.values: list[tuple[float, dict[str, str] | None]] = []

    def set(self, value: float = 1.0, tags: dict[str, str] | None = None) -> None:
        self.values.append((value, tags))

    inc = observe = set

    @property
    def total(self) -> float:
        return sum(value for value, _ in self.values)

    @property
    def last(self) -> float:
        return self.values[-1][0]


def _recording_metrics() -> tuple[EngineMetrics, dict[str, _Recorder]]:
    metrics = EngineMetrics("fake")
    recorders = {}
    for attr, metric in list(vars(metrics).items()):
        if isinstance(metric, (Gauge, Counter, Histogram)):
            recorders[attr] = _Recorder()
            setattr(metrics, attr, recorders[attr])
    return metrics, recorders


def _engine(model: str, metrics: EngineMetrics) -> tuple[AsyncEngine, Any]:
    config = EngineConfig(model=model, num_kv_blocks=32, num_threads=1)
    engine, _executor, tokenizer, _validator = build_engine(config)
    return AsyncEngine(engine, OutputProcessor(tokenizer), metrics=metrics), tokenizer


async def _serve(
    engine: AsyncEngine, prompts: list[list[int]], stream_interval: int | None = 1
) -> None:
    """The first prompt alone (its blocks get cached), then the others together."""

    async def drain(i: int) -> None:
        request = engine.add_request(f"r{i}", prompts[i], GREEDY, stream_interval=stream_interval)
        async for _ in request:
            pass

    await drain(0)
    await asyncio.gather(*(drain(i) for i in range(1, len(prompts))))
    await asyncio.sleep(0.05)  # the loop records the idle state before it sleeps


def _prompts(tokenizer: Any) -> list[list[int]]:
    shared = tokenizer.encode("a shared system prompt " * 6)  # > one 16-token block
    return [shared + tokenizer.encode(tail) for tail in ("one", "two three", "four five six")]


def _exported_names() -> list[str]:
    metrics = (EngineMetrics("m"), IngressMetrics("m"), RouterMetrics("m"))
    return [name for group in metrics for name in group.prometheus_names()]


def test_exported_names_are_the_dashboards() -> None:
    names = _exported_names()
    assert len(set(names)) == len(names)
    assert sorted(names) == sorted(METRIC_NAMES)


def test_metrics_before_rays_first_export_are_every_family_at_zero() -> None:
    """A fresh server's /metrics (Ray exports every 10 s): every family, at 0, not an empty
    answer; a family Ray exports keeps Ray's samples."""
    ray_export = (
        "# HELP ray_node_cpu_count CPUs.\n# TYPE ray_node_cpu_count gauge\nray_node_cpu_count 2.0\n"
        "# HELP ray_pagedray_num_requests_running Sequences in the running batch.\n"
        "# TYPE ray_pagedray_num_requests_running gauge\n"
        'ray_pagedray_num_requests_running{model_name="m",WorkerId="w"} 3.0\n'
    )
    text = merge_pagedray_families([ray_export], "m").decode()
    families = {family.name: family for family in text_string_to_metric_families(text)}
    exposed = {
        f"{name}_total" if family.type == "counter" else name for name, family in families.items()
    }
    assert exposed == set(METRIC_NAMES)
    assert [s.value for s in families["ray_pagedray_num_requests_running"].samples] == [3.0]
    success = families["ray_pagedray_request_success"].samples
    assert {(s.labels["finished_reason"], s.value) for s in success} == {("stop", 0), ("length", 0)}
    ttft = families["ray_pagedray_time_to_first_token_seconds"].samples
    assert {s.labels["model_name"] for s in ttft} == {"m"} and all(s.value == 0 for s in ttft)


def test_serve_sets_the_metrics_export_port() -> None:
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers(dest="command"))
    assert parser.parse_args(["serve"]).metrics_export_port == 8080
    assert parser.parse_args(["serve", "--metrics-export-port", "9101"]).metrics_export_port == 9101


def test_serve_refuses_a_busy_metrics_port(monkeypatch: pytest.MonkeyPatch) -> None:
    import ray

    ray_was_up = ray.is_initialized()
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers(dest="command"))
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        args = parser.parse_args(["serve", "--metrics-export-port", str(busy.getsockname()[1])])
        with pytest.raises(SystemExit, match="--metrics-export-port .* is not free"):
            args.func(args)
    # Refused before any Ray was started (or joined) for it.
    assert ray.is_initialized() == ray_was_up


def test_scheduler_totals_become_counter_deltas() -> None:
    metrics, recorders = _recording_metrics()
    stats = {"num_running": 2, "num_waiting": 1, "kv_usage": 0.5}
    for queries, hits, preemptions in ((0, 0, 0), (48, 16, 0), (48, 16, 1), (80, 48, 1)):
        totals = {"prefix_cache_queries": queries, "prefix_cache_hits": hits}
        metrics.record_stats({**stats, **totals, "num_preemptions": preemptions})
    assert [v for v, _ in recorders["prefix_cache_queries"].values] == [48, 32]
    assert [v for v, _ in recorders["prefix_cache_hits"].values] == [16, 32]
    assert [v for v, _ in recorders["num_preemptions"].values] == [1]
    pulls = {"num_kv_exported_blocks": 6, "num_kv_imported_blocks": 0}
    metrics.record_stats({**stats, **pulls})
    metrics.record_stats({**stats, **pulls, "num_kv_imported_blocks": 4})
    assert [v for v, _ in recorders["num_kv_exported_blocks"].values] == [6]
    assert [v for v, _ in recorders["num_kv_imported_blocks"].values] == [4]
    sources = {"prompt_tokens_local_compute": 30, "prompt_tokens_external_kv_transfer": 16}
    metrics.record_stats({**stats, **sources})
    metrics.record_stats({**stats, **sources, "prompt_tokens_local_compute": 40})
    assert recorders["prompt_tokens_by_source"].values == [
        (30, {"source": "local_compute"}),
        (16, {"source": "external_kv_transfer"}),
        (10, {"source": "local_compute"}),
    ]
    assert recorders["kv_cache_usage_perc"].last == 0.5
    metrics.record_step(0.01, 1, 0, [])  # a step of prefill chunks only
    metrics.record_prefilled(0)
    assert not recorders["generation_tokens"].values and not recorders["prompt_tokens"].values


@pytest.mark.parametrize("stream_interval", [1, None], ids=["streamed", "read-at-the-end"])
def test_engine_records_steps_and_finished_requests(
    tiny_llama: str, stream_interval: int | None
) -> None:
    """The same per token and per request whether a client streams or reads the whole answer
    (the engine then makes no per-step output for it)."""
    metrics, recorders = _recording_metrics()
    engine, tokenizer = _engine(tiny_llama, metrics)
    prompts = _prompts(tokenizer)

    async def run() -> None:
        await _serve(engine, prompts, stream_interval)
        await engine.shutdown()

    asyncio.run(run())
    num_steps = engine.core.num_steps
    assert len(recorders["step_time"].values) == len(recorders["batch_size"].values) == num_steps
    # Each sequence is in one prefill step (short prompts) and MAX_TOKENS - 1 decode steps.
    assert recorders["batch_size"].total == len(prompts) * MAX_TOKENS
    assert recorders["generation_tokens"].total == len(prompts) * MAX_TOKENS
    assert recorders["prompt_tokens"].total == sum(len(p) for p in prompts)
    by_source: dict[str, float] = {}
    for value, tags in recorders["prompt_tokens_by_source"].values:
        by_source[tags["source"]] = by_source.get(tags["source"], 0) + value
    assert sum(by_source.values()) == recorders["prompt_tokens"].total
    assert by_source["local_cache_hit"] == recorders["prefix_cache_hits"].total > 0
    # One per token after a request's first (per request per step, as vLLM).
    assert len(recorders["inter_token_latency"].values) == len(prompts) * (MAX_TOKENS - 1)
    assert [tags for _, tags in recorders["request_success"].values] == [
        {"finished_reason": "length"}
    ] * len(prompts)
    for name in ("time_to_first_token", "e2e_request_latency", "request_queue_time"):
        assert len(recorders[name].values) == len(prompts), name
    ttft = sorted(v for v, _ in recorders["time_to_first_token"].values)
    e2e = sorted(v for v, _ in recorders["e2e_request_latency"].values)
    queue = sorted(v for v, _ in recorders["request_queue_time"].values)
    assert all(0 <= q <= t <= e < 60 for q, t, e in zip(queue, ttft, e2e))
    assert recorders["prefix_cache_hits"].total >= 16 * (len(prompts) - 1)
    for gauge in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        assert recorders[gauge].last == 0, gauge


def test_aborted_request_counts_its_prefilled_prompt(tiny_llama: str) -> None:
    metrics, recorders = _recording_metrics()
    engine, tokenizer = _engine(tiny_llama, metrics)
    prompt = tokenizer.encode("hello there")

    async def run() -> None:
        stream = engine.add_request("long", prompt, SamplingParams(max_tokens=500))
        await stream.__anext__()  # its first token: the prompt was prefilled
        await stream.aclose()
        await asyncio.sleep(0.05)
        await engine.shutdown()

    asyncio.run(run())
    assert recorders["prompt_tokens"].total == len(prompt)
    assert not recorders["request_success"].values and not engine._recorder._requests
    assert recorders["kv_cache_usage_perc"].last == 0


def test_idle_engine_keeps_its_gauges_exported(
    tiny_llama: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(async_engine, "METRICS_REFRESH_S", 0.02)
    metrics, recorders = _recording_metrics()
    engine, _tokenizer = _engine(tiny_llama, metrics)

    async def run() -> None:
        engine.start()
        await asyncio.sleep(0.3)
        await engine.shutdown()

    asyncio.run(run())
    assert len(recorders["kv_cache_usage_perc"].values) >= 5
    assert not recorders["step_time"].values


STREAM_CHUNK_DELAY_S = 0.1


def _recorded_app() -> tuple[TestClient, _Recorder, _Recorder]:
    """A FastAPI app behind the middleware, and the ingress's request counter and latencies."""
    metrics = IngressMetrics("fake")
    metrics.http_requests = requests = _Recorder()  # type: ignore[assignment]
    metrics.http_request_latency = latencies = _Recorder()  # type: ignore[assignment]
    app = FastAPI()
    app.add_middleware(HTTPMetricsMiddleware, metrics_of=lambda: metrics)

    @app.post("/v1/completions")
    async def completions(bad: bool = False) -> Any:
        return error_response(400, "prompt: bad") if bad else {"ok": True}

    @app.get("/stream/{name}")
    async def stream(name: str) -> StreamingResponse:
        async def chunks() -> Any:
            for _ in range(3):
                await asyncio.sleep(STREAM_CHUNK_DELAY_S)
                yield f"data: {name}\n\n"

        return StreamingResponse(chunks(), media_type="text/event-stream")

    @app.get("/boom")
    async def boom() -> None:
        raise RuntimeError("a bug")

    return TestClient(app, raise_server_exceptions=False), requests, latencies


def test_ingress_records_every_answer_by_route_template() -> None:
    client, requests, latencies = _recorded_app()
    assert client.post("/v1/completions").status_code == 200
    assert client.post("/v1/completions?bad=true").status_code == 400
    assert client.get("/v1/completions").status_code == 405
    assert client.get("/stream/x").text.count("data: x") == 3
    assert client.get("/boom").status_code == 500
    assert client.get("/unknown").status_code == 404  # no route: not counted
    answered = [
        ("/v1/completions", "200"),
        ("/v1/completions", "400"),
        ("/v1/completions", "405"),
        ("/stream/{name}", "200"),
        ("/boom", "500"),
    ]
    assert requests.values == [(1.0, {"route": r, "status": s}) for r, s in answered]
    assert [tags for _, tags in latencies.values] == [{"route": r} for r, _ in answered]
    # A stream is timed to its last chunk, not to its headers.
    assert latencies.values[3][0] >= 3 * STREAM_CHUNK_DELAY_S
    assert all(0 <= latency < 10 for latency, _ in latencies.values)


def _scrape(model_name: str) -> dict[str, float]:
    """This Ray node's Prometheus endpoint: `name{finished_reason}` → value, for one model."""
    import ray

    port = next(node["MetricsExportPort"] for node in ray.nodes() if node["Alive"])
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.labels.get("model_name") != model_name or "le" in sample.labels:
                continue
            key = sample.name
            if "finished_reason" in sample.labels:
                key += f"{{{sample.labels['finished_reason']}}}"
            values[key] = values.get(key, 0.0) + sample.value  # summed over workers
    return values


def test_ray_exports_what_the_engine_records(ray_cluster: Any, tiny_llama: str) -> None:
    model_name = f"metrics-{uuid.uuid4().hex[:8]}"  # apart from other tests' engines
    engine, tokenizer = _engine(tiny_llama, EngineMetrics(model_name))
    prompts = _prompts(tokenizer)
    num = float(len(prompts))

    async def run() -> tuple[dict[str, float], dict[str, float]]:
        await _serve(engine, prompts)
        # One request constrained to a choice: the structured-output series.
        num_constrained_tokens = 0
        async for output in engine.add_request("choice", prompts[0], CHOICE):
            num_constrained_tokens += sum(len(delta.token_ids) for delta in output.deltas)
        await asyncio.sleep(0.05)
        expected = {
            "ray_pagedray_time_to_first_token_seconds_count": num + 1,
            "ray_pagedray_e2e_request_latency_seconds_count": num + 1,
            "ray_pagedray_request_queue_time_seconds_count": num + 1,
            "ray_pagedray_request_success_total{length}": num,
            "ray_pagedray_request_success_total{stop}": 1.0,
            "ray_pagedray_generation_tokens_total": num * MAX_TOKENS + num_constrained_tokens,
            "ray_pagedray_prompt_tokens_total": float(sum(map(len, prompts)) + len(prompts[0])),
            "ray_pagedray_structured_output_requests_total": 1.0,  # {kind="choice"}, 0 for others
            "ray_pagedray_grammar_compile_seconds_count": 1.0,
            "ray_pagedray_step_time_seconds_count": float(engine.core.num_steps),
            "ray_pagedray_batch_size_count": float(engine.core.num_steps),
            "ray_pagedray_num_requests_running": 0.0,
            "ray_pagedray_num_requests_waiting": 0.0,
            "ray_pagedray_kv_cache_usage_perc": 0.0,
        }
        # The engine stays up (idle, refreshing its gauges) while Ray exports.
        deadline = time.monotonic() + EXPORT_TIMEOUT_S
        values = await asyncio.to_thread(_scrape, model_name)
        while any(values.get(k) != v for k, v in expected.items()):
            if time.monotonic() > deadline:
                break
            await asyncio.sleep(1.0)
            values = await asyncio.to_thread(_scrape, model_name)
        await engine.shutdown()
        return expected, values

    expected, values = asyncio.run(run())
    assert {k: values.get(k) for k in expected} == expected
    exported = {name.removesuffix("{length}") for name in values}
    for name in engine.metrics.prometheus_names():
        series = name if name in exported else f"{name}_count"
        assert series in exported, f"{name} is not exported"
    assert values["ray_pagedray_prefix_cache_hits_total"] >= 16 * (len(prompts) - 1)
    assert values["ray_pagedray_prefix_cache_queries_total"] >= sum(len(p) for p in prompts)
    assert values["ray_pagedray_inter_token_latency_seconds_count"] > 0
    assert values["ray_pagedray_grammar_bitmask_seconds_count"] >= 1


# The names operators' dashboards and alerts are built on. Changing one breaks them: a rename
# must be a deliberate change of this list (and a release note), never a side effect.
STABLE_PROMETHEUS_NAMES = (
    "ray_pagedray_num_requests_running",
    "ray_pagedray_num_requests_waiting",
    "ray_pagedray_kv_cache_usage_perc",
    "ray_pagedray_prefix_cache_queries_total",
    "ray_pagedray_prefix_cache_hits_total",
    "ray_pagedray_num_preemptions_total",
    "ray_pagedray_lora_adapters_running",
    "ray_pagedray_lora_loads_total",
    "ray_pagedray_external_prefix_cache_queries_total",
    "ray_pagedray_external_prefix_cache_hits_total",
    "ray_pagedray_host_tier_saved_blocks_total",
    "ray_pagedray_host_tier_loaded_blocks_total",
    "ray_pagedray_host_tier_blocks",
    "ray_pagedray_disk_tier_saved_blocks_total",
    "ray_pagedray_disk_tier_loaded_blocks_total",
    "ray_pagedray_host_tier_save_seconds_total",
    "ray_pagedray_host_tier_load_seconds_total",
    "ray_pagedray_disk_tier_load_seconds_total",
    "ray_pagedray_disk_tier_blocks",
    "ray_pagedray_kv_exported_blocks_total",
    "ray_pagedray_kv_imported_blocks_total",
    "ray_pagedray_prompt_tokens_total",
    "ray_pagedray_prompt_tokens_by_source_total",
    "ray_pagedray_generation_tokens_total",
    "ray_pagedray_request_success_total",
    "ray_pagedray_time_to_first_token_seconds",
    "ray_pagedray_inter_token_latency_seconds",
    "ray_pagedray_e2e_request_latency_seconds",
    "ray_pagedray_request_queue_time_seconds",
    "ray_pagedray_step_time_seconds",
    "ray_pagedray_batch_size",
    "ray_pagedray_http_requests_total",
    "ray_pagedray_http_request_latency_seconds",
    "ray_pagedray_routed_requests_total",
    "ray_pagedray_routing_matched_blocks",
    "ray_pagedray_request_migrations_total",
    "ray_pagedray_request_migration_seconds_total",
    "ray_pagedray_structured_output_requests_total",
    "ray_pagedray_grammar_compile_seconds",
    "ray_pagedray_grammar_bitmask_seconds",
)


def test_metric_names_are_not_renamed_under_operators() -> None:
    assert sorted(_exported_names()) == sorted(STABLE_PROMETHEUS_NAMES)
