"""The engine's Prometheus metrics (`EngineMetrics`), recorded with `ray.util.metrics` by each
engine replica's `AsyncEngine`: the scheduler's gauges and counters, per-step and per-request
latencies, the KV tiers' and the grammars'. Names follow vLLM's (cluster/metric_series.py).
"""

from __future__ import annotations

from ray.util.metrics import Counter, Gauge, Histogram

from pagedray.cluster.metric_series import TAG_KEYS, TTFT_BUCKETS, export_at_zero, prometheus_names
from pagedray.scheduler.kv_cache_manager import PROMPT_TOKEN_SOURCES

ITL_BUCKETS = [
    0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
    0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
]  # fmt: skip
REQUEST_LATENCY_BUCKETS = [
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
    120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
]  # fmt: skip
BATCH_SIZE_BUCKETS = [1.0, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 1024]

# The scheduler's cumulative stats exported as counters: `Scheduler.stats()` keys, and the
# names of the counter attributes below.
_CUMULATIVE_STATS = (
    "prefix_cache_queries",
    "prefix_cache_hits",
    "num_preemptions",
    "external_prefix_cache_queries",
    "external_prefix_cache_hits",
    "host_tier_saved_blocks",
    "host_tier_loaded_blocks",
    "disk_tier_saved_blocks",
    "disk_tier_loaded_blocks",
    "host_tier_save_seconds",
    "host_tier_load_seconds",
    "disk_tier_load_seconds",
    "num_kv_exported_blocks",
    "num_kv_imported_blocks",
    "num_lora_loads",
)
# `Scheduler.stats()` keys of the prompt tokens counted by source (a tagged counter).
_SOURCE_STATS = tuple(f"prompt_tokens_{source}" for source in PROMPT_TOKEN_SOURCES)
# What a request finishes with (`RequestStatus.finish_reason`; aborts are no success).
FINISHED_REASONS = ("stop", "length")
# The kinds of constraint a structured-output request has (`StructuredOutputsParams.key`).
CONSTRAINT_KINDS = ("json", "regex", "choice", "grammar")
# From a cached mask of a few microseconds to a large schema's compile of a second.
GRAMMAR_BUCKETS = [1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0]


class EngineMetrics:
    """One engine's metrics, tagged with its model name. `AsyncEngine` records them.

    Per loop iteration a few calls (`record_stats`, `record_step`, one inter-token latency per
    request that advanced), per request one call at its finish (`record_finished`); a call costs
    about a microsecond, and runs beside the next step.
    """

    def __init__(self, model_name: str, export_zeros: bool = True) -> None:
        self.model_name = model_name
        tags = {"model_name": model_name}

        def gauge(name: str, description: str) -> Gauge:
            return Gauge(name, description, TAG_KEYS).set_default_tags(tags)

        def counter(name: str, description: str, tag_keys: tuple[str, ...] = ()) -> Counter:
            return Counter(name, description, TAG_KEYS + tag_keys).set_default_tags(tags)

        def histogram(name: str, description: str, buckets: list[float]) -> Histogram:
            return Histogram(name, description, buckets, TAG_KEYS).set_default_tags(tags)

        self.num_requests_running = gauge(
            "pagedray_num_requests_running", "Sequences in the running batch."
        )
        self.num_requests_waiting = gauge(
            "pagedray_num_requests_waiting", "Requests waiting to be scheduled (or preempted)."
        )
        self.kv_cache_usage_perc = gauge(
            "pagedray_kv_cache_usage_perc", "Fraction of KV cache blocks in use, 0..1."
        )
        self.prefix_cache_queries = counter(
            "pagedray_prefix_cache_queries", "Prompt tokens looked up in the prefix cache."
        )
        self.prefix_cache_hits = counter(
            "pagedray_prefix_cache_hits", "Prompt tokens found in the prefix cache."
        )
        self.external_prefix_cache_queries = counter(
            "pagedray_external_prefix_cache_queries",
            "Prompt tokens looked up in the node's host KV tier (past the pool's hits).",
        )
        self.external_prefix_cache_hits = counter(
            "pagedray_external_prefix_cache_hits",
            "Prompt tokens loaded from the node's host KV tier instead of computed.",
        )
        self.host_tier_saved_blocks = counter(
            "pagedray_host_tier_saved_blocks", "KV blocks evicted from the pool into the host tier."
        )
        self.host_tier_loaded_blocks = counter(
            "pagedray_host_tier_loaded_blocks", "KV blocks loaded from the host tier into the pool."
        )
        self.disk_tier_saved_blocks = counter(
            "pagedray_disk_tier_saved_blocks",
            "KV blocks the host tier moved down to the disk tier.",
        )
        self.disk_tier_loaded_blocks = counter(
            "pagedray_disk_tier_loaded_blocks", "KV blocks loaded from the disk tier into the pool."
        )
        # vLLM's offloading connector calls these kv_offload_store_time / kv_offload_load_time.
        self.host_tier_save_seconds = counter(
            "pagedray_host_tier_save_seconds",
            "Seconds rank 0 spent copying blocks from the pool into the host tier.",
        )
        self.host_tier_load_seconds = counter(
            "pagedray_host_tier_load_seconds",
            "Seconds rank 0 spent copying blocks from the host tier into the pool.",
        )
        self.disk_tier_load_seconds = counter(
            "pagedray_disk_tier_load_seconds",
            "Seconds rank 0 spent copying blocks from the disk tier into the pool.",
        )
        self.num_kv_exported_blocks = counter(
            "pagedray_kv_exported_blocks",
            "KV blocks this engine handed to another that pulled them (from its node's tier).",
        )
        self.num_kv_imported_blocks = counter(
            "pagedray_kv_imported_blocks",
            "KV blocks pulled from another node's engine into this node's host tier.",
        )
        self.disk_tier_blocks = gauge(
            "pagedray_disk_tier_blocks", "KV blocks held in the node's disk tier (--kv-disk-dir)."
        )
        self.host_tier_blocks = gauge(
            "pagedray_host_tier_blocks",
            "KV blocks held in the node's host tier (by every engine of the model on the node).",
        )
        self.num_lora_adapters_running = gauge(
            "pagedray_lora_adapters_running", "LoRA adapters the running sequences use."
        )
        self.num_lora_loads = counter(
            "pagedray_lora_loads", "LoRA adapters loaded into a slot of the ranks (--max-loras)."
        )
        self.num_preemptions = counter(
            "pagedray_num_preemptions", "Sequences preempted (blocks freed, recomputed later)."
        )
        self.prompt_tokens = counter("pagedray_prompt_tokens", "Prompt tokens prefilled.")
        self.prompt_tokens_by_source = counter(
            "pagedray_prompt_tokens_by_source",
            "Prompt tokens at their request's first admission (one refused or aborted before "
            "it counts in none), by source: local_compute (computed), local_cache_hit (the "
            "pool's prefix cache), external_kv_transfer (a KV tier).",
            ("source",),
        )
        self.generation_tokens = counter("pagedray_generation_tokens", "Tokens generated.")
        self.request_success = counter(
            "pagedray_request_success", "Requests finished, by finish reason.", ("finished_reason",)
        )
        self.time_to_first_token = histogram(
            "pagedray_time_to_first_token_seconds", "Arrival to first token.", TTFT_BUCKETS
        )
        self.inter_token_latency = histogram(
            "pagedray_inter_token_latency_seconds",
            "Time between consecutive tokens of a request (one observation per request per step).",
            ITL_BUCKETS,
        )
        self.e2e_request_latency = histogram(
            "pagedray_e2e_request_latency_seconds",
            "Arrival to last token.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.request_queue_time = histogram(
            "pagedray_request_queue_time_seconds", "Arrival to first schedule.", TTFT_BUCKETS
        )
        self.step_time = histogram(
            "pagedray_step_time_seconds", "One schedule, forward, update iteration.", ITL_BUCKETS
        )
        self.batch_size = histogram(
            "pagedray_batch_size", "Sequences per step.", BATCH_SIZE_BUCKETS
        )
        self.structured_output_requests = counter(
            "pagedray_structured_output_requests",
            "Requests whose output is constrained, by kind (json, regex, choice, grammar).",
            ("kind",),
        )
        self.grammar_compile_time = histogram(
            "pagedray_grammar_compile_seconds",
            "Compiling a constraint not in the grammar cache (on the compile thread).",
            GRAMMAR_BUCKETS,
        )
        self.grammar_bitmask_time = histogram(
            "pagedray_grammar_bitmask_seconds",
            "Filling a step's token bitmasks for its constrained sequences.",
            GRAMMAR_BUCKETS,
        )
        self._last_totals = dict.fromkeys(_CUMULATIVE_STATS + _SOURCE_STATS, 0.0)
        if export_zeros:
            export_at_zero(self.zero_series())

    def zero_series(self) -> list[tuple[Counter, dict[str, str]]]:
        """The counters' series that exist at 0 before anything is counted (tags beyond the
        model name)."""
        tagged = (
            self.request_success,
            self.structured_output_requests,
            self.prompt_tokens_by_source,
        )
        series: list[tuple[Counter, dict[str, str]]] = [
            (metric, {})
            for metric in vars(self).values()
            if isinstance(metric, Counter) and all(metric is not t for t in tagged)
        ]
        series += [(self.structured_output_requests, {"kind": k}) for k in CONSTRAINT_KINDS]
        series += [(self.request_success, {"finished_reason": r}) for r in FINISHED_REASONS]
        series += [(self.prompt_tokens_by_source, {"source": s}) for s in PROMPT_TOKEN_SOURCES]
        return series

    def record_stats(self, stats: dict[str, float]) -> None:
        """Gauges from a scheduler stats snapshot; its cumulative counts become counter deltas."""
        self.num_requests_running.set(stats["num_running"])
        self.num_requests_waiting.set(stats["num_waiting"])
        self.kv_cache_usage_perc.set(stats["kv_usage"])
        self.host_tier_blocks.set(stats.get("host_tier_num_blocks", 0))
        self.disk_tier_blocks.set(stats.get("disk_tier_num_blocks", 0))
        self.num_lora_adapters_running.set(stats.get("num_lora_adapters_running", 0))
        for key in _CUMULATIVE_STATS:
            delta = self._delta(stats, key)
            if delta > 0:  # Counter.inc refuses 0
                getattr(self, key).inc(delta)
        for source, key in zip(PROMPT_TOKEN_SOURCES, _SOURCE_STATS):
            delta = self._delta(stats, key)
            if delta > 0:
                self.prompt_tokens_by_source.inc(delta, tags={"source": source})

    def _delta(self, stats: dict[str, float], key: str) -> float:
        """How far a cumulative stat moved since the last snapshot (its key may be absent: the
        tier's exist only with a tier)."""
        total = stats.get(key, 0)
        delta = total - self._last_totals[key]
        self._last_totals[key] = max(total, self._last_totals[key])
        return delta

    def record_step(
        self,
        step_time: float,
        batch_size: int,
        num_generation_tokens: int,
        inter_token_latencies: list[float],
    ) -> None:
        """One step that ran on the workers, with the inter-token latency of each request that
        got a token in it after an earlier one."""
        self.step_time.observe(step_time)
        self.batch_size.observe(batch_size)
        if num_generation_tokens > 0:
            self.generation_tokens.inc(num_generation_tokens)
        for latency in inter_token_latencies:
            self.inter_token_latency.observe(latency)

    def record_structured_request(self, kind: str) -> None:
        self.structured_output_requests.inc(tags={"kind": kind})

    def record_grammar(
        self, bitmask_duration: float | None, compile_times: tuple[float, ...]
    ) -> None:
        """A step's bitmask time (None: it had no constrained row) and new grammars' compiles."""
        if bitmask_duration is not None:
            self.grammar_bitmask_time.observe(bitmask_duration)
        for seconds in compile_times:
            self.grammar_compile_time.observe(seconds)

    def record_prefilled(self, num_prompt_tokens: int) -> None:
        """An aborted request whose prompt was prefilled: its prompt tokens still count."""
        if num_prompt_tokens > 0:
            self.prompt_tokens.inc(num_prompt_tokens)

    def record_finished(
        self,
        finished_reason: str,
        num_prompt_tokens: int,
        arrival_time: float,
        scheduled_time: float | None,
        first_token_time: float,
        finish_time: float,
    ) -> None:
        """A request that finished (all its choices); times are time.time() seconds."""
        self.request_success.inc(tags={"finished_reason": finished_reason})
        self.record_prefilled(num_prompt_tokens)
        self.time_to_first_token.observe(max(first_token_time - arrival_time, 0.0))
        self.e2e_request_latency.observe(max(finish_time - arrival_time, 0.0))
        if scheduled_time is not None:
            self.request_queue_time.observe(max(scheduled_time - arrival_time, 0.0))

    def prometheus_names(self) -> list[str]:
        """The names Ray's Prometheus endpoint exports these metrics under."""
        return prometheus_names(self)
