"""What pagedray's groups of Prometheus metrics share: the model-name tag, the latency buckets
of vLLM's that two groups use, the names Ray exports a group under, and the series exported at 0
before anything is recorded.

Names follow vLLM's. Ray exports each as `ray_<name>` (counters add `_total`, histograms
`_bucket`/`_sum`/`_count`): exactly `grafana_dashboard.METRIC_NAMES`, which a test checks.
"""

from __future__ import annotations

from typing import Any

from ray.util.metrics import Counter, Gauge, Histogram

TAG_KEYS = ("model_name",)
# vLLM's buckets (seconds); inter-token latency and step time start lower, for fast GPUs.
TTFT_BUCKETS = [
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
]  # fmt: skip


def prometheus_names(metrics: Any) -> list[str]:
    """The names Ray's Prometheus endpoint exports the metrics of `metrics` under (its
    attributes)."""
    names = []
    for metric in vars(metrics).values():
        if isinstance(metric, Counter):
            names.append(f"ray_{metric.info['name']}_total")
        elif isinstance(metric, (Gauge, Histogram)):
            names.append(f"ray_{metric.info['name']}")
    return names


def export_at_zero(series: list[tuple[Counter, dict[str, str]]]) -> None:
    # NOTE: Ray exports a series only once something is recorded, and `Counter.inc` refuses 0:
    # without this, a counter that never moved (preemptions) would be absent from Prometheus and
    # its dashboard panel would show "No data" instead of 0.
    for counter, tags in series:
        counter._record(0.0, tags or None)
