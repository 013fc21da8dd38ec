"""The dashboard's panels: what each shows, in PromQL over the names `grafana_dashboard` lists.

Kept apart from the dashboard's frame (layout, variables, provisioning) so the list can grow.
"""

from __future__ import annotations

QUANTILES = (0.5, 0.9, 0.99)
# The label selector every expression uses: the dashboard's variables. `job` keeps one scrape
# job's view, since deploy/prometheus/ scrapes the head both by discovery and statically.
SELECTOR = '{job=~"$job", model_name=~"$model_name"}'
RATE_WINDOW = "[$__rate_interval]"


def _rate(metric: str) -> str:
    return f"rate({metric}{SELECTOR}{RATE_WINDOW})"


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


def _named(name: str, exprs: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """The series of `exprs` with `name` before their legends (two histograms in one panel)."""
    return [(expr, f"{name} {legend}") for expr, legend in exprs]


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
        "Prompt tokens found in the pools / tokens looked up; and of the tokens past the pools' "
        "hits, those loaded from the node's host KV tier.",
        [
            (
                f"{_sum_by_model(_rate('ray_pagedray_prefix_cache_hits_total'))} / "
                f"{_sum_by_model(_rate('ray_pagedray_prefix_cache_queries_total'))}",
                "pool {{model_name}}",
            ),
            (
                f"{_sum_by_model(_rate('ray_pagedray_external_prefix_cache_hits_total'))} / "
                f"{_sum_by_model(_rate('ray_pagedray_external_prefix_cache_queries_total'))}",
                "host tier {{model_name}}",
            ),
        ],
    ),
    (
        "Prompt tokens by source",
        "short",
        "Prompt tokens per second at admission: computed, found in the pools' prefix caches, "
        "loaded from the node's KV tiers (vLLM's local_compute, local_cache_hit, "
        "external_kv_transfer).",
        [
            (
                f"sum by (model_name, source) "
                f"({_rate('ray_pagedray_prompt_tokens_by_source_total')})",
                "{{source}} {{model_name}}",
            ),
        ],
    ),
    (
        "KV tiers",
        "short",
        "Blocks saved to and loaded from the node's host tier per second (evicted from a pool; "
        "found there instead of computed), moved down to and loaded from its disk tier, pulled "
        "into this node's tier from another node's engine and pulled from this node's engines by "
        "others, and the blocks each holds.",
        [
            (_sum_by_model(_rate("ray_pagedray_host_tier_saved_blocks_total")), "host saved/s"),
            (_sum_by_model(_rate("ray_pagedray_host_tier_loaded_blocks_total")), "host loaded/s"),
            (_sum_by_model(_rate("ray_pagedray_disk_tier_saved_blocks_total")), "disk saved/s"),
            (_sum_by_model(_rate("ray_pagedray_disk_tier_loaded_blocks_total")), "disk loaded/s"),
            (_sum_by_model(_rate("ray_pagedray_kv_imported_blocks_total")), "pulled in/s"),
            (_sum_by_model(_rate("ray_pagedray_kv_exported_blocks_total")), "pulled out/s"),
            (
                f"max by (model_name) (ray_pagedray_host_tier_blocks{SELECTOR})",
                "host held {{model_name}}",
            ),
            (
                f"max by (model_name) (ray_pagedray_disk_tier_blocks{SELECTOR})",
                "disk held {{model_name}}",
            ),
        ],
    ),
    (
        "KV tier copy time",
        "percentunit",
        "Share of wall time rank 0 spends copying blocks between its pool and the tiers (saves "
        "to the host tier, loads from it and from the disk tier): what the tiers cost the steps.",
        [
            (_sum_by_model(_rate("ray_pagedray_host_tier_save_seconds_total")), "host save"),
            (_sum_by_model(_rate("ray_pagedray_host_tier_load_seconds_total")), "host load"),
            (_sum_by_model(_rate("ray_pagedray_disk_tier_load_seconds_total")), "disk load"),
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
        "LoRA adapters",
        "short",
        "Adapters the running sequences use, and adapters loaded into a slot per second (a "
        "steady rate of loads: --max-loras is below the adapters in use).",
        [
            (
                _sum_by_model(f"ray_pagedray_lora_adapters_running{SELECTOR}"),
                "running {{model_name}}",
            ),
            (_sum_by_model(_rate("ray_pagedray_lora_loads_total")), "loads/s {{model_name}}"),
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
        "Requests migrated to another engine",
        "reqps",
        "Requests moved to another engine replica after theirs failed them (a stream resumes "
        "from the tokens its client has), by the failure: dead (the replica or its engine "
        "died), aborted (from outside: a lost output channel) or stalled (its replica stopped "
        "answering or stepping).",
        [
            (
                f"sum by (model_name, reason) ({_rate('ray_pagedray_request_migrations_total')})",
                "{{reason}} {{model_name}}",
            ),
        ],
    ),
    (
        "Migration time",
        "s",
        "Mean seconds from a request's engine failing it to its placement on another replica.",
        [
            (
                f"sum by (model_name) ({_rate('ray_pagedray_request_migration_seconds_total')})"
                f" / sum by (model_name) ({_rate('ray_pagedray_request_migrations_total')})",
                "mean {{model_name}}",
            ),
        ],
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
        "tier_match (only its node's host or disk tier holds it), load_fallback (the best "
        "match too loaded: the prefix is pulled from it when it holds enough more), no_match "
        "(nothing cached anywhere), load_only (nothing to match: one engine or power-of-two).",
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
    (
        "Structured-output requests",
        "reqps",
        "Requests per second whose output is constrained, by kind: json (response_format, a "
        "forced tool call), regex, choice, grammar.",
        [
            (
                f"sum by (model_name, kind) "
                f"({_rate('ray_pagedray_structured_output_requests_total')})",
                "{{kind}} {{model_name}}",
            ),
        ],
    ),
    (
        "Grammar compile and bitmask time",
        "s",
        "Compiling a constraint not yet cached (off the step loop), and filling one step's token "
        "bitmasks for its constrained sequences (on it).",
        [
            *_named(
                "compile", _quantile_exprs("ray_pagedray_grammar_compile_seconds", (0.5, 0.99))
            ),
            *_named(
                "bitmask", _quantile_exprs("ray_pagedray_grammar_bitmask_seconds", (0.5, 0.99))
            ),
        ],
    ),
]
