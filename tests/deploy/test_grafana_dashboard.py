"""The generated Grafana dashboard: up to date on disk, PromQL that parses and names only
pagedray's metrics, every metric shown, and the provisioning files that load it."""

from __future__ import annotations

import json
import re
from pathlib import Path

import promql_parser
import pytest
import yaml

from pagedray.observability import grafana_dashboard
from pagedray.observability.grafana_dashboard import (
    COUNTERS,
    GAUGES,
    HISTOGRAM_SUFFIXES,
    HISTOGRAMS,
    METRIC_NAMES,
    build_dashboard,
    dashboard_json,
    promql_expressions,
)

ROOT = Path(__file__).resolve().parents[2]
REGENERATE = "run `python -m pagedray.observability.grafana_dashboard` from the repository root"
# Grafana's variables, replaced by what Grafana would send so the Prometheus parser accepts them.
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$model_name": ".*", "$job": ".*"}
LABEL_VALUES = re.compile(r"^label_values\((?P<selector>.+), (?P<label>\w+)\)$")


def _as_promql(expr: str) -> str:
    for variable, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(variable, value)
    match = LABEL_VALUES.match(expr)  # a Grafana variable query, around a plain selector
    return match.group("selector") if match else expr


def _selector_names(expr: str) -> list[str]:
    names: list[str] = []

    def visit(node: object) -> bool:
        if isinstance(node, promql_parser.VectorSelector):
            names.append(node.name)
        return True

    promql_parser.walk(promql_parser.parse(_as_promql(expr)), visit)
    return names


def _metric_of(series: str) -> str:
    """The METRIC_NAMES entry a series belongs to; only histograms have suffixed series."""
    if series in GAUGES or series in COUNTERS:
        return series
    for suffix in HISTOGRAM_SUFFIXES:
        base = series.removesuffix(suffix)
        if base != series and base in HISTOGRAMS:
            return base
    raise AssertionError(f"{series!r} is not one of METRIC_NAMES (or a histogram's series)")


@pytest.mark.parametrize(
    "path", ["deploy/grafana/pagedray.json", "helm/pagedray/files/pagedray.json"]
)
def test_written_dashboard_is_up_to_date(path: str) -> None:
    on_disk = ROOT / path
    assert on_disk.exists(), f"{path} is missing: {REGENERATE}"
    assert on_disk.read_text() == dashboard_json(), f"{path} is stale: {REGENERATE}"


def test_every_expression_parses_and_names_only_pagedray_metrics() -> None:
    exprs = promql_expressions(build_dashboard())
    assert len(exprs) >= 20
    for expr in exprs:
        names = _selector_names(expr)
        assert names, f"no metric in {expr!r}"
        for name in names:
            _metric_of(name)
        assert 'model_name=~"$model_name"' in expr or expr.startswith("label_values("), expr


def test_every_metric_is_on_the_dashboard() -> None:
    shown = {
        _metric_of(name)
        for expr in promql_expressions(build_dashboard())
        for name in _selector_names(expr)
    }
    assert shown == set(METRIC_NAMES)


def test_metric_names_follow_ray_prometheus_naming() -> None:
    assert len(set(METRIC_NAMES)) == len(METRIC_NAMES) == 40
    assert all(name.startswith("ray_pagedray_") for name in METRIC_NAMES)
    assert all(name.endswith("_total") for name in COUNTERS)
    assert not any(name.endswith(("_total", *HISTOGRAM_SUFFIXES)) for name in GAUGES + HISTOGRAMS)


def test_latency_panels_are_quantiles_over_buckets() -> None:
    dashboard = build_dashboard()
    by_title = {panel["title"]: panel for panel in dashboard["panels"]}
    for title in ("Time to first token", "Inter-token latency", "End-to-end request latency"):
        exprs = [target["expr"] for target in by_title[title]["targets"]]
        assert len(exprs) == 3
        for expr, quantile in zip(exprs, ("0.5", "0.9", "0.99")):
            assert expr.startswith(f"histogram_quantile({quantile}, sum by (le, model_name) ")
            assert "_seconds_bucket{" in expr
        assert by_title[title]["fieldConfig"]["defaults"]["unit"] == "s"


def test_panels_are_laid_out_without_overlap() -> None:
    panels = build_dashboard()["panels"]
    assert len({panel["id"] for panel in panels}) == len(panels)
    cells = set()
    for panel in panels:
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24
        for x in range(grid["x"], grid["x"] + grid["w"]):
            for y in range(grid["y"], grid["y"] + grid["h"]):
                assert (x, y) not in cells, f"{panel['title']} overlaps another panel"
                cells.add((x, y))
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}"


def test_module_main_writes_the_json(tmp_path: Path) -> None:
    out = tmp_path / "nested" / "dashboard.json"
    assert grafana_dashboard.main(["--out", str(out)]) == 0
    assert json.loads(out.read_text())["uid"] == "pagedray"


def test_provisioning_files() -> None:
    provisioning = ROOT / "deploy/grafana/provisioning"
    datasources = yaml.safe_load((provisioning / "datasources/prometheus.yaml").read_text())
    (datasource,) = datasources["datasources"]
    assert datasource["type"] == "prometheus"
    assert datasource["url"].endswith(":9090")
    providers = yaml.safe_load((provisioning / "dashboards/pagedray.yaml").read_text())
    (provider,) = providers["providers"]
    assert provider["type"] == "file"
    assert provider["options"]["path"].startswith("/")
    assert datasources["apiVersion"] == providers["apiVersion"] == 1


def test_prometheus_scrapes_the_static_target_and_ray_discovery_file() -> None:
    config = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert set(jobs) == {"ray", "ray-local"}
    assert all(job["metrics_path"] == "/metrics" for job in jobs.values())
    files = [path for sd in jobs["ray"]["file_sd_configs"] for path in sd["files"]]
    assert files == ["/tmp/ray/prom_metrics_service_discovery.json"]
    assert jobs["ray-local"]["static_configs"] == [{"targets": ["127.0.0.1:8080"]}]
    # Two jobs see the head: the dashboard must keep to one (see the NOTE in the config).
    panels = build_dashboard()["panels"]
    assert all('job=~"$job"' in target["expr"] for panel in panels for target in panel["targets"])
