"""The Grafana dashboard for pagedray's Prometheus metrics, built from code.

`python -m pagedray.observability.grafana_dashboard` writes it to deploy/grafana/pagedray.json
and to the Helm chart's files/ (a test checks both are up to date); edit this module, not the
JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from pagedray.observability.dashboard_panels import PANELS

# Prometheus-side names: Ray exports `ray.util.metrics` with a `ray_` prefix, counters get
# `_total`, histograms `_bucket`/`_sum`/`_count`. Every series carries a `model_name` tag.
GAUGES = (
    "ray_pagedray_num_requests_running",
    "ray_pagedray_num_requests_waiting",
    "ray_pagedray_kv_cache_usage_perc",  # fraction of KV blocks in use, 0..1
    "ray_pagedray_host_tier_blocks",  # blocks in the node's host KV tier
    "ray_pagedray_disk_tier_blocks",  # blocks in the node's disk KV tier
    "ray_pagedray_lora_adapters_running",  # LoRA adapters of the running sequences
)
COUNTERS = (
    "ray_pagedray_prefix_cache_queries_total",  # tokens looked up
    "ray_pagedray_prefix_cache_hits_total",  # tokens found cached
    "ray_pagedray_external_prefix_cache_queries_total",  # tokens looked up in the host tier
    "ray_pagedray_external_prefix_cache_hits_total",  # tokens loaded from it
    "ray_pagedray_host_tier_saved_blocks_total",
    "ray_pagedray_host_tier_loaded_blocks_total",
    "ray_pagedray_disk_tier_saved_blocks_total",  # moved down from the host tier
    "ray_pagedray_disk_tier_loaded_blocks_total",
    "ray_pagedray_host_tier_save_seconds_total",  # rank 0's copy time
    "ray_pagedray_host_tier_load_seconds_total",
    "ray_pagedray_disk_tier_load_seconds_total",
    "ray_pagedray_kv_exported_blocks_total",  # pulled from this engine by another
    "ray_pagedray_kv_imported_blocks_total",  # pulled from another node into this one's tier
    "ray_pagedray_num_preemptions_total",
    "ray_pagedray_lora_loads_total",  # adapters loaded into a slot (--max-loras)
    "ray_pagedray_prompt_tokens_total",
    "ray_pagedray_prompt_tokens_by_source_total",  # tag source (vLLM's three)
    "ray_pagedray_generation_tokens_total",
    "ray_pagedray_request_success_total",  # tag finished_reason
    "ray_pagedray_http_requests_total",  # the ingress's; tags route, status
    "ray_pagedray_routed_requests_total",  # the engine router's (in the ingress); replica, reason
    "ray_pagedray_request_migrations_total",  # the ingress's; tag reason
    "ray_pagedray_request_migration_seconds_total",  # the ingress's: summed over moves
    "ray_pagedray_structured_output_requests_total",  # tag kind
)
HISTOGRAMS = (
    "ray_pagedray_time_to_first_token_seconds",
    "ray_pagedray_inter_token_latency_seconds",
    "ray_pagedray_e2e_request_latency_seconds",
    "ray_pagedray_request_queue_time_seconds",
    "ray_pagedray_step_time_seconds",
    "ray_pagedray_batch_size",
    "ray_pagedray_http_request_latency_seconds",  # the ingress's; tag route
    "ray_pagedray_routing_matched_blocks",  # the engine router's
    "ray_pagedray_grammar_compile_seconds",
    "ray_pagedray_grammar_bitmask_seconds",
)
METRIC_NAMES = GAUGES + COUNTERS + HISTOGRAMS
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")

DASHBOARD_UID = "pagedray"
DEFAULT_OUTPUTS = (Path("deploy/grafana/pagedray.json"), Path("helm/pagedray/files/pagedray.json"))
PANEL_WIDTH, PANEL_HEIGHT = 12, 8


def _target(expr: str, legend: str, ref_id: str) -> dict[str, Any]:
    return {
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "expr": expr,
        "legendFormat": legend,
        "refId": ref_id,
    }


def _timeseries(
    panel_id: int, title: str, unit: str, description: str, exprs: list[tuple[str, str]]
) -> dict[str, Any]:
    ref_ids = "ABCDEFGH"
    position = panel_id - 1
    return {
        "id": panel_id,
        "type": "timeseries",
        "title": title,
        "description": description,
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "gridPos": {
            "h": PANEL_HEIGHT,
            "w": PANEL_WIDTH,
            "x": (position % 2) * PANEL_WIDTH,
            "y": (position // 2) * PANEL_HEIGHT,
        },
        "fieldConfig": {"defaults": {"unit": unit, "min": 0}, "overrides": []},
        "options": {
            "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
            "tooltip": {"mode": "multi", "sort": "none"},
        },
        "targets": [_target(expr, legend, ref_ids[i]) for i, (expr, legend) in enumerate(exprs)],
    }


def _templating() -> dict[str, Any]:
    datasource = {
        "name": "datasource",
        "label": "Prometheus",
        "type": "datasource",
        "query": "prometheus",
        "current": {},
        "hide": 0,
    }
    job = {
        "name": "job",
        "label": "Scrape job",
        "type": "query",
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "query": {"query": f"label_values({GAUGES[0]}, job)", "refId": "job"},
        "definition": f"label_values({GAUGES[0]}, job)",
        "includeAll": False,
        "multi": False,
        "current": {},
        "refresh": 2,
        "sort": 1,
        "hide": 0,
    }
    model_name = {
        "name": "model_name",
        "label": "Model",
        "type": "query",
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "query": {
            "query": f'label_values({GAUGES[0]}{{job=~"$job"}}, model_name)',
            "refId": "model_name",
        },
        "definition": f'label_values({GAUGES[0]}{{job=~"$job"}}, model_name)',
        "includeAll": True,
        "multi": True,
        "allValue": ".*",
        "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
        "refresh": 2,
        "sort": 1,
        "hide": 0,
    }
    return {"list": [datasource, job, model_name]}


def build_dashboard() -> dict[str, Any]:
    """The dashboard model (the `dashboard` object of Grafana's POST /api/dashboards/db)."""
    panels = [
        _timeseries(panel_id, title, unit, description, exprs)
        for panel_id, (title, unit, description, exprs) in enumerate(PANELS, start=1)
    ]
    return {
        "uid": DASHBOARD_UID,
        "title": "pagedray",
        "description": "pagedray LLM serving: throughput, latency, KV cache, scheduler, HTTP, "
        "routing, structured outputs.",
        "tags": ["pagedray", "llm", "ray"],
        "timezone": "browser",
        "editable": True,
        "graphTooltip": 1,
        "refresh": "10s",
        "schemaVersion": 39,
        "time": {"from": "now-1h", "to": "now"},
        "templating": _templating(),
        "annotations": {"list": []},
        "links": [],
        "panels": panels,
    }


def promql_expressions(dashboard: dict[str, Any]) -> list[str]:
    """Every PromQL expression in the dashboard: panel targets and query variables."""
    exprs = [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            exprs.append(variable["definition"])
    return exprs


def dashboard_json() -> str:
    """The dashboard as written to disk: stable key order, so regenerating is a no-op."""
    return json.dumps(build_dashboard(), indent=2, sort_keys=True) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--out",
        action="append",
        type=Path,
        help="file to write (repeatable); default: the repository's copies, from its root",
    )
    args = parser.parse_args(argv)
    text = dashboard_json()
    for path in args.out or DEFAULT_OUTPUTS:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
