"""`GET /metrics` on the API port: pagedray's series from Ray's metrics export, in one answer.

Ray exports each node's metrics on that node's export port (`--metrics-export-port`), which is
what Prometheus scrapes (deploy/prometheus). Clients that look for vLLM's `/metrics` on the API
port (aiperf, guidellm, ...) find the same series here: the ingress fetches every alive node's
export port, keeps the `ray_pagedray_*` families and merges them across nodes, each HELP and
TYPE once, with Ray's names and labels unchanged, so one dashboard reads either endpoint.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Iterable

import httpx
import ray
from prometheus_client.exposition import generate_latest
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.parser import text_string_to_metric_families
from ray.util.metrics import Counter, Gauge, Histogram

from pagedray.cluster.engine_metrics import EngineMetrics
from pagedray.cluster.ingress_metrics import GENERATION_ROUTES, IngressMetrics, RouterMetrics

logger = logging.getLogger(__name__)

PREFIX = "ray_pagedray_"
# Seconds to wait for one node's export port: a node that does not answer is left out, so a
# slow or dead node delays a scrape by this much at most.
SCRAPE_TIMEOUT_S = 2.0
# Prometheus' classic text format, which `generate_latest` writes and every scraper reads.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_HEADERS = (f"# HELP {PREFIX}", f"# TYPE {PREFIX}")


def metric_groups(model_name: str) -> list[EngineMetrics | IngressMetrics | RouterMetrics]:
    """Every pagedray metric's definition, for `model_name`, without recording anything (what
    /metrics shows at 0 before Ray's first export; `with_zeros`)."""
    return [
        EngineMetrics(model_name, export_zeros=False),
        IngressMetrics(model_name, export_zeros=False),
        RouterMetrics(model_name, export_zeros=False),
    ]


def export_urls() -> list[str]:
    """Each alive node's metrics export endpoint (a blocking call to Ray's GCS).

    NOTE: every alive node rather than only those running a replica: a node without one exports
    no pagedray series, and finding the replicas' nodes would need Ray's state API (the
    dashboard), which a joined cluster may not run.
    """
    urls = []
    for node in ray.nodes():
        port = node.get("MetricsExportPort")
        if node.get("Alive") and isinstance(port, int) and port > 0:
            host = str(node["NodeManagerAddress"])
            host = f"[{host}]" if ":" in host else host  # an IPv6 address
            urls.append(f"http://{host}:{port}/metrics")
    return urls


async def fetch_exports(urls: list[str], timeout_s: float = SCRAPE_TIMEOUT_S) -> list[str]:
    """The text of every export that answered 200 in time; the others are logged and skipped."""

    async def fetch(client: httpx.AsyncClient, url: str) -> str | None:
        try:
            response = await client.get(url)
            response.raise_for_status()
            return response.text
        except httpx.HTTPError as exc:
            logger.warning("metrics: %s did not answer: %r", url, exc)
            return None

    async with httpx.AsyncClient(timeout=timeout_s) as client:
        texts = await asyncio.gather(*(fetch(client, url) for url in urls))
    return [text for text in texts if text is not None]


def merge_pagedray_families(texts: Iterable[str], model_name: str) -> bytes:
    """Prometheus text with the `ray_pagedray_*` families of every export: samples of one family
    from several nodes under one HELP and TYPE (Ray's NodeAddress and WorkerId labels keep
    their series apart). A family no export holds yet is there at 0 for `model_name`."""
    families: dict[str, Metric] = {}
    for text in texts:
        # Only pagedray's lines are parsed: an export holds some 170 families of Ray's own.
        lines = [line for line in text.splitlines() if _is_pagedray_line(line)]
        for family in text_string_to_metric_families("\n".join(lines) + "\n"):
            if not family.name.startswith(PREFIX):
                continue
            merged = families.setdefault(family.name, family)
            if merged is not family:
                merged.samples.extend(family.samples)
    for family in zero_families(model_name):
        families.setdefault(family.name, family)
    return generate_latest(_Families(list(families.values())))


def zero_families(model_name: str) -> list[Metric]:
    """Every pagedray family at 0, as a fresh server's would read: Ray exports what the replicas
    record only every few seconds (10 by default), and a scraper or a client that reads
    /metrics before that should find the series, not an empty answer (vLLM's exist at once).
    Counters have the series they are created with (`zero_series`); gauges and histograms one
    per model name (and per generation route, for the ingress's latency)."""
    families: list[Metric] = []
    for group in metric_groups(model_name):
        zero_tags: dict[str, list[dict[str, str]]] = {}
        for counter, tags in group.zero_series():
            zero_tags.setdefault(counter.info["name"], []).append(tags)
        for metric in vars(group).values():
            if isinstance(metric, (Counter, Gauge, Histogram)):
                families.append(_zero_family(metric, model_name, zero_tags))
    return families


def _zero_family(
    metric: Counter | Gauge | Histogram, model_name: str, zero_tags: dict[str, list[dict[str, str]]]
) -> Metric:
    info = metric.info
    name, keys = "ray_" + info["name"], list(info["tag_keys"])
    extra = [key for key in keys if key != "model_name"]
    if isinstance(metric, Counter):
        counter = CounterMetricFamily(name, info["description"], labels=keys)
        for tags in zero_tags.get(info["name"], []):
            counter.add_metric([model_name if k == "model_name" else tags[k] for k in keys], 0.0)
        return counter
    label_sets = [{"route": route} for route in GENERATION_ROUTES] if extra == ["route"] else [{}]
    if extra and extra != ["route"]:
        label_sets = []  # series named by values not known in advance
    if isinstance(metric, Gauge):
        gauge = GaugeMetricFamily(name, info["description"], labels=keys)
        for tags in label_sets:
            gauge.add_metric([model_name if k == "model_name" else tags[k] for k in keys], 0.0)
        return gauge
    family = HistogramMetricFamily(name, info["description"], labels=keys)
    buckets = [(repr(float(b)), 0.0) for b in info["boundaries"]] + [("+Inf", 0.0)]
    for tags in label_sets:
        labels = [model_name if k == "model_name" else tags[k] for k in keys]
        family.add_metric(labels, buckets=buckets, sum_value=0.0)
    return family


def _is_pagedray_line(line: str) -> bool:
    return line.startswith(PREFIX) or line.startswith(_HEADERS)


class _Families:
    """A collector of already-built families, which is all `generate_latest` asks for."""

    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> Any:
        return iter(self.families)
