"""The ingress replicas' Prometheus metrics, recorded with `ray.util.metrics`: the HTTP
ingress's answers and request migrations (`IngressMetrics`) and the engine router's decisions
(`RouterMetrics`, in the same process). Names follow vLLM's where it has them
(cluster/metric_series.py).
"""

from __future__ import annotations

from ray.util.metrics import Counter, Histogram

from pagedray.cluster.metric_series import TAG_KEYS, TTFT_BUCKETS, export_at_zero, prometheus_names
from pagedray.cluster.replica_watch import STALLED_REASON
from pagedray.engine.request_errors import MIGRATED_FAILURES

# Upper bounds, which include the value; Ray takes positive bounds only, so a miss (0 blocks)
# has the first bucket, 0.5, to itself.
MATCHED_BLOCKS_BUCKETS = [0.5, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096]

# The ingress's series exported as 0 before the first request: each generation route with each
# status the ingress answers it with (ok, bad request, bad API key, unknown model, engine error,
# engine overloaded or dead).
GENERATION_ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages")
HTTP_STATUSES = ("200", "400", "401", "404", "500", "503")
# Why a request was sent to an engine again: the kind of its engine's failure, or its replica
# making no progress (cluster/replica_watch.py).
MIGRATION_REASONS = (*(kind.value for kind in MIGRATED_FAILURES), STALLED_REASON)


class IngressMetrics:
    """One ingress replica's metrics, tagged with its model name: one call per answered request.

    `HTTPMetricsMiddleware` records them, so every route and every status is covered.
    """

    def __init__(self, model_name: str, export_zeros: bool = True) -> None:
        self.model_name = model_name
        tags = {"model_name": model_name}
        self.http_requests = Counter(
            "pagedray_http_requests",
            "API requests answered, by route and HTTP status.",
            TAG_KEYS + ("route", "status"),
        ).set_default_tags(tags)
        # TTFT's buckets: from a refusal in a millisecond to a generation of minutes.
        self.http_request_latency = Histogram(
            "pagedray_http_request_latency_seconds",
            "Request received to response sent (a stream's last chunk), by route.",
            TTFT_BUCKETS,
            TAG_KEYS + ("route",),
        ).set_default_tags(tags)
        self.request_migrations = Counter(
            "pagedray_request_migrations",
            "Engine requests moved to another engine replica after theirs failed them (a stream "
            "resumed from the tokens its client has), by the failure's kind (dead, aborted) or "
            "stalled (its replica made no progress).",
            TAG_KEYS + ("reason",),
        ).set_default_tags(tags)
        # NOTE: a counter of seconds, not a histogram: a histogram is exported only once it
        # has a sample, and a move is rare, so its panel would read "No data" instead of 0.
        self.request_migration_time = Counter(
            "pagedray_request_migration_seconds",
            "Seconds from a request's engine failing it to the request's placement on another "
            "engine replica, summed over moves (per move: divide by the migrations counter).",
            TAG_KEYS,
        ).set_default_tags(tags)
        if export_zeros:
            export_at_zero(self.zero_series())

    def zero_series(self) -> list[tuple[Counter, dict[str, str]]]:
        """The series that exist at 0 before the first request: each generation route with
        each status it is answered with, and each reason to migrate a request."""
        return (
            [
                (self.http_requests, {"route": route, "status": status})
                for route in GENERATION_ROUTES
                for status in HTTP_STATUSES
            ]
            + [(self.request_migrations, {"reason": reason}) for reason in MIGRATION_REASONS]
            + [(self.request_migration_time, {})]
        )

    def record_migration(self, reason: str, seconds: float) -> None:
        """A request moved, for `reason`, placed `seconds` after its engine failed it."""
        self.request_migrations.inc(tags={"reason": reason})
        if seconds > 0:  # Counter.inc refuses 0
            self.request_migration_time.inc(seconds)

    def record(self, route: str, status: int, latency: float) -> None:
        """One answered request: its route template, HTTP status and seconds to answer."""
        self.http_requests.inc(tags={"route": route, "status": str(status)})
        self.http_request_latency.observe(latency, tags={"route": route})

    def prometheus_names(self) -> list[str]:
        """The names Ray's Prometheus endpoint exports these metrics under."""
        return prometheus_names(self)


class RouterMetrics:
    """The engine router's decisions, in each process that routes to the engines (the ingress
    replicas): one call per routed generation, with the replica it went to and why (a call that
    Serve routes again, its replica having refused it or died, counts again).

    Reasons: `prefix_match` (a replica caching most of the prompt's leading blocks),
    `tier_match` (the best replicas' pools hold none of them, their node's host KV tier does),
    `load_fallback` (the best match was too loaded, or full, so another took it), `no_match`
    (no replica caches any of them), `load_only` (nothing to match: one engine, power-of-two
    routing, or no routing hashes yet).
    """

    def __init__(self, model_name: str, export_zeros: bool = True) -> None:
        tags = {"model_name": model_name}
        self.routed_requests = Counter(
            "pagedray_routed_requests",
            "Generation calls routed to an engine replica, by replica and routing decision.",
            TAG_KEYS + ("replica", "reason"),
        ).set_default_tags(tags)
        self.routing_matched_blocks = Histogram(
            "pagedray_routing_matched_blocks",
            "Leading KV blocks of a routed prompt that its replica caches (the router's view; "
            "those in its node's host tier count --routing-tier-weight each, on its disk "
            "--routing-disk-weight).",
            MATCHED_BLOCKS_BUCKETS,
            TAG_KEYS,
        ).set_default_tags(tags)
        if export_zeros:
            export_at_zero(self.zero_series())

    def zero_series(self) -> list[tuple[Counter, dict[str, str]]]:
        """None: its counter's series name replicas, which are not known in advance."""
        return []

    def record(self, replica: str, reason: str, matched_blocks: float | None) -> None:
        """One routed call; `matched_blocks` (the pool's, plus the tier's weighted) None when
        the router had no prefix to match."""
        self.routed_requests.inc(tags={"replica": replica, "reason": reason})
        if matched_blocks is not None:
            self.routing_matched_blocks.observe(matched_blocks)

    def prometheus_names(self) -> list[str]:
        """The names Ray's Prometheus endpoint exports these metrics under."""
        return prometheus_names(self)
