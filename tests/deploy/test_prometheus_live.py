"""A real Prometheus, configured from deploy/prometheus/prometheus.yml, scraping a real
`pagedray serve` (its own local Ray) while it serves requests over HTTP: the engine's metrics
arrive, and every series the Grafana dashboard queries exists.

Needs the `prometheus` binary: as root the test installs Debian's package when it is missing
(`apt-get update`, then `apt-get install -y --no-install-recommends prometheus`); else it skips.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import httpx
import promql_parser
import pytest
import yaml
from _subprocesses import free_port, get_ok, pagedray_serve, stop, wait_for

from pagedray.observability.grafana_dashboard import METRIC_NAMES, promql_expressions

ROOT = Path(__file__).resolve().parents[2]
MODEL = "tiny"
NUM_SHORT = 4  # short requests, then one long one that fills most of the KV cache
LONG_MAX_TOKENS = 900  # of the tiny model's 1024 positions: 57 of the 64 blocks
APT_TIMEOUT_S = 300
START_TIMEOUT_S = 150  # Ray, Serve, the engine replica and its worker on 2 CPU cores
METRICS_TIMEOUT_S = 60
SEEN_WAIT_S = 2.5  # a metrics report (1 s) and a scrape (1 s) after a request, with room
# What Grafana would substitute for the dashboard's variables, for the local scrape job.
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$model_name": MODEL, "$job": "ray-local"}
LABEL_VALUES = re.compile(r"^label_values\((?P<selector>.+), (?P<label>\w+)\)$")

pytestmark = pytest.mark.slow


def _prometheus_binary() -> str:
    """The `prometheus` executable; installed from Debian's package when missing and root."""
    found = shutil.which("prometheus")
    if found is not None:
        return found
    if not hasattr(os, "geteuid") or os.geteuid() != 0 or shutil.which("apt-get") is None:
        pytest.skip("no `prometheus` binary; install it as root: apt-get install -y prometheus")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for command in (
        ["apt-get", "update"],
        ["apt-get", "install", "-y", "--no-install-recommends", "prometheus"],
    ):
        result = subprocess.run(
            command, env=env, capture_output=True, text=True, timeout=APT_TIMEOUT_S
        )
        if result.returncode != 0:
            pytest.skip(f"{' '.join(command)} failed: {result.stderr[-500:]}")
    found = shutil.which("prometheus")
    if found is None:
        pytest.skip("apt-get installed no `prometheus` binary")
    return found


@pytest.fixture(scope="module")
def workdir() -> Iterator[Path]:
    # NOTE: short, under /tmp: Ray's Unix sockets live below it, and their paths are limited.
    path = Path(tempfile.mkdtemp(prefix="pdr-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def prometheus_bin() -> str:
    return _prometheus_binary()


@pytest.fixture(scope="module")
def server(workdir: Path, tiny_llama: str, prometheus_bin: str) -> Iterator[dict[str, Any]]:
    """`pagedray serve` on free ports; afterwards it and every process of its Ray are gone.

    Takes `prometheus_bin` only to skip before starting anything when Prometheus is missing.
    """
    # Export every second, not every 10 (Ray then drops gauges unrecorded for 2 s: the engine
    # re-records them every second, idle or not).
    env = {"RAY_metrics_report_interval_ms": "1000"}
    flags = ["--served-model-name", MODEL, "--num-kv-blocks", "64"]
    # Two engines: requests are then routed by prefix, so the routing series exist too.
    flags += ["--num-threads", "1", "--device", "cpu", "--num-replicas", "2"]
    with pagedray_serve(
        tiny_llama, *flags, workdir=workdir, env=env, start_timeout_s=START_TIMEOUT_S
    ) as serving:
        yield {
            "url": serving.url,
            "metrics_port": serving.metrics_port,
            "ray_tmp": serving.ray_tmp,
        }
    # pagedray_serve asserted a clean exit and that no Ray process outlived it.
    assert not get_ok(f"http://127.0.0.1:{serving.metrics_port}/metrics")


def _prometheus_config(metrics_port: int, ray_tmp: Path, path: Path) -> None:
    """deploy/prometheus/prometheus.yml, scraping every second this Ray instead of /tmp/ray's."""
    config = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())
    config["global"] = {"scrape_interval": "1s", "evaluation_interval": "1s"}
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert set(jobs) == {"ray", "ray-local"}
    jobs["ray"]["file_sd_configs"][0]["files"] = [
        str(ray_tmp / "prom_metrics_service_discovery.json")
    ]
    jobs["ray-local"]["static_configs"][0]["targets"] = [f"127.0.0.1:{metrics_port}"]
    path.write_text(yaml.safe_dump(config))


@pytest.fixture(scope="module")
def prometheus(
    server: dict[str, Any], workdir: Path, prometheus_bin: str
) -> Iterator[Callable[[str], list[dict[str, Any]]]]:
    """A Prometheus on a free loopback port; yields its instant-query function."""
    config = workdir / "prometheus.yml"
    _prometheus_config(server["metrics_port"], server["ray_tmp"], config)
    port = free_port()
    command = [
        prometheus_bin,
        f"--config.file={config}",
        f"--storage.tsdb.path={workdir / 'tsdb'}",
        f"--web.listen-address=127.0.0.1:{port}",
    ]
    log = (workdir / "prometheus.log").open("w")
    proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"

    def query(expr: str) -> list[dict[str, Any]]:
        response = httpx.get(f"{url}/api/v1/query", params={"query": expr}, timeout=10)
        body = response.json()
        assert body["status"] == "success", f"{expr}: {body}"
        return body["data"]["result"]

    try:
        wait_for("prometheus ready", lambda: get_ok(f"{url}/-/ready"), 30, proc)
    except AssertionError as exc:
        stop(proc, 30)
        log.close()
        raise AssertionError(f"{exc}\n{(workdir / 'prometheus.log').read_text()[-3000:]}") from exc
    try:
        # NOTE: Prometheus applies new targets a few seconds after it starts: scrape first.
        for job in ("ray-local", "ray"):
            up = f'max(up{{job="{job}", instance=~".*:{server["metrics_port"]}"}})'
            wait_for(f"prometheus scraping job {job}", lambda up=up: _value(query(up)) == 1, 30)
        yield query
    finally:
        stop(proc, 30)
        log.close()


def _value(result: list[dict[str, Any]]) -> float | None:
    return float(result[0]["value"][1]) if result else None


def _complete(url: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def _selector_names(expr: str) -> list[str]:
    for variable, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(variable, value)
    names: list[str] = []

    def visit(node: object) -> bool:
        if isinstance(node, promql_parser.VectorSelector):
            names.append(node.name)
        return True

    promql_parser.walk(promql_parser.parse(expr), visit)
    return names


def test_prometheus_sees_what_pagedray_serve_records(
    server: dict[str, Any], prometheus: Callable[[str], list[dict[str, Any]]]
) -> None:
    url = server["url"]
    with concurrent.futures.ThreadPoolExecutor(NUM_SHORT) as pool:
        prompts = [f"request number {i} says" for i in range(NUM_SHORT)]
        for output in pool.map(lambda p: _complete(url, p, 8), prompts):
            assert output["choices"][0]["finish_reason"] == "length"
    local = f'job="ray-local", model_name="{MODEL}"'
    peak_query = f"max(max_over_time(ray_pagedray_kv_cache_usage_perc{{{local}}}[5m]))"
    # The long request fills the cache while it runs. The engine can finish it between two
    # metric reports (1 s apart here), so it is sent again until a scrape has seen it running.
    num_long, deadline = 0, time.monotonic() + METRICS_TIMEOUT_S
    while True:
        output = _complete(url, "a long one", LONG_MAX_TOKENS)
        assert output["usage"]["completion_tokens"] == LONG_MAX_TOKENS
        num_long += 1
        time.sleep(SEEN_WAIT_S)  # a report and a scrape
        if (_value(prometheus(peak_query)) or 0) > 0 or time.monotonic() > deadline:
            break
    # One constrained request: the structured-output series (it ends "stop", with its EOS).
    body = {"model": MODEL, "prompt": "yes or no", "max_tokens": 8}
    body["structured_outputs"] = {"choice": ["yes", "no"]}
    constrained = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert constrained.status_code == 200, constrained.text
    num_constrained_tokens = constrained.json()["usage"]["completion_tokens"]
    num_requests = NUM_SHORT + num_long + 1

    def count(job: str) -> float | None:
        selector = f'job="{job}", model_name="{MODEL}"'
        return _value(
            prometheus(f"sum(ray_pagedray_time_to_first_token_seconds_count{{{selector}}})")
        )

    # Both scrape jobs of deploy/: the static target and the head's discovery file.
    for job in ("ray-local", "ray"):
        wait_for(
            f"TTFT count of job {job}",
            lambda job=job: count(job) == num_requests,
            METRICS_TIMEOUT_S,
        )
    successes = prometheus(
        f'sum(ray_pagedray_request_success_total{{{local}, finished_reason="length"}})'
    )
    assert _value(successes) == num_requests - 1
    tokens = _value(prometheus(f"sum(ray_pagedray_generation_tokens_total{{{local}}})"))
    assert tokens == NUM_SHORT * 8 + num_long * LONG_MAX_TOKENS + num_constrained_tokens
    # The long request filled the cache while it ran; idle, it is empty again.
    assert (_value(prometheus(peak_query)) or 0) > 0
    for gauge in ("kv_cache_usage_perc", "num_requests_running", "num_requests_waiting"):
        assert _value(prometheus(f"max(ray_pagedray_{gauge}{{{local}}})")) == 0, gauge

    dashboard = json.loads((ROOT / "deploy/grafana/pagedray.json").read_text())
    exprs = promql_expressions(dashboard)
    names = {name for expr in exprs for name in _selector_names(_unwrap(expr))}
    assert {_base(name) for name in names} == set(METRIC_NAMES)
    for name in sorted(names):
        assert prometheus(f"{name}{{{local}}}"), f"{name} is not in the scrape"
    for expr in exprs:  # and every panel's query answers, as Grafana would send it
        assert prometheus(_as_sent(expr)), f"no data for {expr}"


def _as_sent(expr: str) -> str:
    for variable, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(variable, value)
    return _unwrap(expr)


def _unwrap(expr: str) -> str:
    """A Grafana `label_values(selector, label)` variable query → its selector."""
    match = LABEL_VALUES.match(expr)
    return match.group("selector") if match else expr


def _base(series: str) -> str:
    for suffix in ("_bucket", "_sum", "_count"):
        if series.endswith(suffix) and series.removesuffix(suffix) in METRIC_NAMES:
            return series.removesuffix(suffix)
    return series
