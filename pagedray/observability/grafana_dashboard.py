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

# Prometheus-side names: Ray exports `ray.util.metrics` with a `ray_` prefix, counters get
# `_total`, histograms `_bucket`/`_sum`/`_count`. Every series carries a `model_name` tag.
GAUGES = (
    "ray_pagedray_num_requests_running",
    "ray_pagedray_num_requests_waiting",
    "ray_pagedray_kv_cache_usage_perc",  # fraction of KV blocks in use, 0..1
)
COUNTERS = (
    "ray_pagedray_prefix_cache_queries_total",  # tokens looked up
    "ray_pagedray_prefix_cache_hits_total",  # tokens found cached
    "ray_pagedray_num_preemptions_total",
    "ray_pagedray_prompt_tokens_total",
    "ray_pagedray_generation_tokens_total",
    "ray_pagedray_request_success_total",  # tag finished_reason
    "ray_pagedray_http_requests_total",  # the ingress's; tags route, status
    "ray_pagedray_routed_requests_total",  # the engine router's (in the ingress); replica, reason
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
)
METRIC_NAMES = GAUGES + COUNTERS + HISTOGRAMS
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")

DASHBOARD_UID = "pagedray"
DEFAULT_OUTPUTS = (Path("deploy/grafana/pagedray.json"), Path("helm/pagedray/files/pagedray.json"))
QUANTILES = (0.5, 0.9, 0.99)
# The label selector every expression uses: the dashboard's variables. `job` keeps one scrape
# job's view, since deploy/prometheus/ scrapes the head both by discovery and statically.
SELECTOR = '{job=~"$job", model_name=~"$model_name"}'
RATE_WINDOW = "[$__rate_interval]"
PANEL_WIDTH, PANEL_HEIGHT = 12, 8


def _rate(metric: str) -> str:
    return f"rate({metric}{SELECTOR}{RATE_WINDOW})"


def _target(expr: str, legend: str, ref_id: str) -> dict[str, Any]:
    return {
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "expr": expr,
        "legendFormat": legend,
        "refId": ref_id,
    }


def _quantile_exprs(
    histogram: str, quantiles: tuple[float, ...] = QUANTILES, by: tuple[str, ...] = ()
) -> list[tuple[str, str]]:
    """Quantiles over all replicas of the selected models (and per `by` label), from `_bucket`."""
    labels = ", ".join(("le", *by, "model_name"))
    legend = " ".join(f"{{{{{label}}}}}" for label in (*by, "model_name"))
    buckets = f"sum by ({labels}) ({_rate(histogram + '_bucket')})"
    return [
        (f"histogram_quantile({q}, {buckets})", f"p{round(q * 100)} {legend}") for q in quantiles
    ]


def _mean_expr(histogram: str) -> tuple[str, str]:
    total = f"sum by (model_name) ({_rate(histogram + '_sum')})"
    count = f"sum by (model_name) ({_rate(histogram + '_count')})"
    return f"{total} / {count}", "mean {{model_name}}"


def _sum_by_model(expr: str) -> str:
    return f"sum by (model_name) ({expr})"


# Each panel: title, unit, description, [(PromQL, legend)]. Laid out two per row, in this order.
PANELS: list[tuple[str, str, str, list[tuple[str, str]]]] = [
    (
        "Generation throughput",
        "tps",
        "Output tokens per second.",
        [
            (_sum_by_model(_rate("ray_pagedray_generation_tokens_total")), "{{model_name}}"),
        ],
    ),
    (
        "Prompt throughput",
        "tps",
        "Prompt tokens per second (prefilled or cached).",
        [
            (_sum_by_model(_rate("ray_pagedray_prompt_tokens_total")), "{{model_name}}"),
        ],
    ),
    (
        "Time to first token",
        "s",
        "Arrival to first output token.",
        _quantile_exprs("ray_pagedray_time_to_first_token_seconds"),
    ),
    (
        "Inter-token latency",
        "s",
        "Time between consecutive output tokens.",
        _quantile_exprs("ray_pagedray_inter_token_latency_seconds"),
    ),
    (
        "End-to-end request latency",
        "s",
        "Arrival to the last output token.",
        _quantile_exprs("ray_pagedray_e2e_request_latency_seconds"),
    ),
    (
        "Queue time",
        "s",
        "Time a request waited before its first schedule.",
        _quantile_exprs("ray_pagedray_request_queue_time_seconds"),
    ),
    (
        "KV cache usage",
        "percentunit",
        "Fraction of KV blocks in use, per engine replica.",
        [
            (
                f"max by (model_name) (ray_pagedray_kv_cache_usage_perc{SELECTOR})",
                "max {{model_name}}",
            ),
            (
                f"avg by (model_name) (ray_pagedray_kv_cache_usage_perc{SELECTOR})",
                "avg {{model_name}}",
            ),
        ],
    ),
    (
        "Prefix cache hit rate",
        "percentunit",
        "Prompt tokens found cached / tokens looked up.",
        [
            (
                f"{_sum_by_model(_rate('ray_pagedray_prefix_cache_hits_total'))} / "
                f"{_sum_by_model(_rate('ray_pagedray_prefix_cache_queries_total'))}",
                "{{model_name}}",
            ),
        ],
    ),
    (
        "Running and waiting requests",
        "short",
        "Summed over engine replicas.",
        [
            (
                _sum_by_model(f"ray_pagedray_num_requests_running{SELECTOR}"),
                "running {{model_name}}",
            ),
            (
                _sum_by_model(f"ray_pagedray_num_requests_waiting{SELECTOR}"),
                "waiting {{model_name}}",
            ),
        ],
    ),
    (
        "Preemptions",
        "ops",
        "Requests preempted (blocks freed, recomputed later) per second.",
        [
            (_sum_by_model(_rate("ray_pagedray_num_preemptions_total")), "{{model_name}}"),
        ],
    ),
    (
        "Finished requests",
        "reqps",
        "Requests finished per second, by finish reason.",
        [
            (
                f"sum by (model_name, finished_reason) "
                f"({_rate('ray_pagedray_request_success_total')})",
                "{{finished_reason}} {{model_name}}",
            ),
        ],
    ),
    (
        "Step time",
        "s",
        "One schedule → forward → update iteration.",
        _quantile_exprs("ray_pagedray_step_time_seconds"),
    ),
    (
        "Batch size",
        "short",
        "Sequences per step.",
        [
            _mean_expr("ray_pagedray_batch_size"),
            *_quantile_exprs("ray_pagedray_batch_size"),
        ],
    ),
    (
        "HTTP requests by status",
        "reqps",
        "API requests the ingress answered per second, by HTTP status.",
        [
            (
                f"sum by (model_name, status) ({_rate('ray_pagedray_http_requests_total')})",
                "{{status}} {{model_name}}",
            ),
        ],
    ),
    (
        "HTTP request latency",
        "s",
        "Request received to response sent (a stream's last chunk), per route.",
        _quantile_exprs("ray_pagedray_http_request_latency_seconds", (0.5, 0.99), ("route",)),
    ),
    (
        "Routed requests per engine replica",
        "reqps",
        "Generation calls the router sent to each engine replica per second.",
        [
            (
                f"sum by (model_name, replica) ({_rate('ray_pagedray_routed_requests_total')})",
                "{{replica}} {{model_name}}",
            ),
        ],
    ),
    (
        "Routing decisions",
        "reqps",
        "Why calls went where they did: prefix_match (the replica caching most of the prompt), "
        "load_fallback (the best match too loaded), no_match (nothing cached anywhere), "
        "load_only (nothing to match: one engine or power-of-two routing).",
        [
            (
                f"sum by (model_name, reason) ({_rate('ray_pagedray_routed_requests_total')})",
                "{{reason}} {{model_name}}",
            ),
        ],
    ),
    (
        "Matched prefix blocks per routed request",
        "short",
        "Leading KV blocks of a prompt that the replica it was routed to caches.",
        [
            _mean_expr("ray_pagedray_routing_matched_blocks"),
            *_quantile_exprs("ray_pagedray_routing_matched_blocks", (0.5, 0.9)),
        ],
    ),
]


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
        "routing.",
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
