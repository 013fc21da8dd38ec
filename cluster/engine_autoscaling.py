"""Autoscaling of engine replicas on the engines' own load: sequences and KV cache, not calls.

Serve's default policy scales on ongoing calls per replica (ray#51632), which for an engine says
little: its ingresses hold subscriptions open on it (output channels, KV index streams) that are
calls but no load, and one call may be a 4-token chat or a 30k-token prompt. Each engine replica
reports instead (`EngineDeployment.record_autoscaling_stats`, Serve's custom metrics) what a
vLLM operator watches: running and waiting sequences and the KV cache's usage, under vLLM's
metric names. `EngineAutoscalingPolicy` wants as many replicas as keep both below their
targets:

    desired = max(sum(running + waiting) / (max_num_seqs * target_seqs_fraction),
                  sum(kv_cache_usage_perc) / target_kv_cache_usage)

Serve's wrapper then applies what the autoscaling config says (min and max replicas, up- and
downscale delays and factors). A replica that has not reported yet counts as idle; with no report
at all the policy holds the target count. A removed replica drains: Serve routes it nothing new
and waits for its calls, which the engine deployment's shutdown timeout lets finish (see
`engine_deployment.drain_timeout_s`).
"""

from __future__ import annotations

from typing import Any

from ray.serve.config import AutoscalingContext, AutoscalingPolicy

# The metric names each engine replica reports (vLLM's gauges of the same meaning).
RUNNING = "num_requests_running"
WAITING = "num_requests_waiting"
KV_CACHE_USAGE = "kv_cache_usage_perc"
# Defaults: scale up before a replica's batch or KV pool fills, so that new requests are not
# the ones that find it full.
DEFAULT_TARGET_SEQS_FRACTION = 0.8
DEFAULT_TARGET_KV_CACHE_USAGE = 0.7


class EngineAutoscalingPolicy:
    """Serve's custom autoscaling policy for engine replicas (see the module).

    A class, so that Serve builds it once with `policy_kwargs` (JSON values) and calls it every
    autoscaling tick with the deployment's `AutoscalingContext`.
    """

    def __init__(
        self,
        max_num_seqs: int,
        target_seqs_fraction: float = DEFAULT_TARGET_SEQS_FRACTION,
        target_kv_cache_usage: float = DEFAULT_TARGET_KV_CACHE_USAGE,
    ) -> None:
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, got {max_num_seqs}")
        for name, value in (
            ("target_seqs_fraction", target_seqs_fraction),
            ("target_kv_cache_usage", target_kv_cache_usage),
        ):
            if not 0 < value <= 1:
                raise ValueError(f"{name} must be in (0, 1], got {value}")
        self.target_seqs = max_num_seqs * target_seqs_fraction
        self.target_kv_cache_usage = target_kv_cache_usage

    def __call__(self, ctx: AutoscalingContext) -> tuple[float, dict[str, Any]]:
        metrics = ctx.aggregated_metrics or {}
        if not metrics.get(RUNNING) and not metrics.get(KV_CACHE_USAGE):
            # Nothing reported yet: keep the target (not the count running, which during a
            # scale-up is lower and would start Serve's downscale timer).
            return ctx.target_num_replicas, {}
        return self.desired_replicas(metrics), {}

    def desired_replicas(self, metrics: dict[str, dict[Any, float]]) -> float:
        """Replicas (fractional: Serve rounds after its factors) for the reported load."""
        sequences = sum(metrics.get(RUNNING, {}).values()) + sum(metrics.get(WAITING, {}).values())
        usage = sum(metrics.get(KV_CACHE_USAGE, {}).values())
        return max(sequences / self.target_seqs, usage / self.target_kv_cache_usage)


def engine_autoscaling_config(
    min_replicas: int, max_replicas: int, max_num_seqs: int, **overrides: Any
) -> dict[str, Any]:
    """Serve's `autoscaling_config` for the engines: `EngineAutoscalingPolicy` between the bounds;
    `overrides` are other `AutoscalingConfig` fields (delays, metrics interval)."""
    if not 0 <= min_replicas <= max_replicas or max_replicas < 1:
        raise ValueError(
            f"replicas: need 0 <= min_replicas <= max_replicas and max_replicas >= 1, got "
            f"{min_replicas} and {max_replicas}"
        )
    policy = AutoscalingPolicy(
        policy_function=EngineAutoscalingPolicy, policy_kwargs={"max_num_seqs": max_num_seqs}
    )
    return {
        "min_replicas": min_replicas,
        "max_replicas": max_replicas,
        "policy": policy,
        **overrides,
    }


def report(stats: dict[str, Any]) -> dict[str, float]:
    """An engine replica's autoscaling stats from its `stats()`: what the policy reads."""
    return {
        RUNNING: float(stats["num_running"]),
        # Admitted but not yet with the scheduler: waiting as much as the scheduler's own.
        WAITING: float(stats["num_waiting"] + stats.get("num_pending", 0)),
        KV_CACHE_USAGE: float(stats["kv_usage"]),
    }
