"""The engines' autoscaling policy (cluster/engine_autoscaling.py): replicas for the reported
sequences and KV usage, within Serve's bounds. Serve running it against live engines is in
test_engine_scaling.py."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from ray.serve.config import AutoscalingConfig, AutoscalingContext

from pagedray.cluster.engine_autoscaling import (
    KV_CACHE_USAGE,
    RUNNING,
    WAITING,
    EngineAutoscalingPolicy,
    engine_autoscaling_config,
    report,
)


def _context(
    metrics: dict[str, dict[str, float]],
    current: int,
    config: Any = None,
    target: int | None = None,
) -> Any:
    return AutoscalingContext(
        deployment_id=None,  # type: ignore[arg-type]
        deployment_name="PagedRayEngine",
        app_name="pagedray",
        current_num_replicas=current,
        target_num_replicas=current if target is None else target,
        running_replicas=[],
        total_num_requests=0.0,
        total_queued_requests=0.0,
        aggregated_metrics=metrics,  # type: ignore[arg-type]
        raw_metrics=None,
        capacity_adjusted_min_replicas=config.min_replicas if config else 1,
        capacity_adjusted_max_replicas=config.max_replicas if config else 8,
        policy_state={},
        last_scale_up_time=None,
        last_scale_down_time=None,
        current_time=None,
        config=config,
    )


def _load(running: list[float], waiting: list[float], usage: list[float]) -> dict[str, Any]:
    def by_replica(values: list[float]) -> dict[str, float]:
        return {f"r{i}": value for i, value in enumerate(values)}

    return {
        RUNNING: by_replica(running),
        WAITING: by_replica(waiting),
        KV_CACHE_USAGE: by_replica(usage),
    }


def test_replicas_follow_sequences_or_kv_usage_whichever_needs_more() -> None:
    policy = EngineAutoscalingPolicy(max_num_seqs=10)  # 8 sequences per replica, 70% KV
    assert policy(_context(_load([8, 8], [8, 0], [0.1, 0.1]), 2))[0] == pytest.approx(3.0)
    assert policy(_context(_load([2, 2], [0, 0], [0.7, 0.7]), 2))[0] == pytest.approx(2.0)
    assert policy(_context(_load([2, 1], [0, 0], [0.95, 0.9]), 2))[0] == pytest.approx(1.85 / 0.7)
    assert policy(_context(_load([0, 0], [0, 0], [0.0, 0.0]), 2))[0] == 0.0


def test_no_report_yet_holds_the_target() -> None:
    """Mid scale-up (3 wanted, 1 running), no report must not read as a wish to go back to 1."""
    assert EngineAutoscalingPolicy(max_num_seqs=4)(_context({}, 1, target=3)) == (3, {})


@given(
    st.lists(st.tuples(st.integers(0, 64), st.integers(0, 64), st.floats(0, 1)), min_size=1),
    st.integers(0, 64),
)
def test_more_load_never_wants_fewer_replicas(
    replicas: list[tuple[int, int, float]], extra: int
) -> None:
    policy = EngineAutoscalingPolicy(max_num_seqs=16)
    running, waiting, usage = (list(column) for column in zip(*replicas))
    base = policy.desired_replicas(_load(running, waiting, usage))
    waiting[0] += extra
    assert policy.desired_replicas(_load(running, waiting, usage)) >= base


def test_bad_targets_are_refused() -> None:
    with pytest.raises(ValueError, match="max_num_seqs"):
        EngineAutoscalingPolicy(max_num_seqs=0)
    with pytest.raises(ValueError, match="target_kv_cache_usage"):
        EngineAutoscalingPolicy(max_num_seqs=4, target_kv_cache_usage=1.5)
    with pytest.raises(ValueError, match="min_replicas"):
        engine_autoscaling_config(3, 2, max_num_seqs=4)


def test_serve_takes_the_config_and_wraps_the_policy() -> None:
    """The config as Serve validates it; the policy as Serve loads it (built once, with its
    kwargs) and wraps it (rounding, delays; Serve's controller then clamps to the bounds)."""
    from ray.serve._private.autoscaling_state import _resolve_policy_callable
    from ray.serve.autoscaling_policy import _apply_autoscaling_config

    config = AutoscalingConfig(
        **engine_autoscaling_config(1, 3, max_num_seqs=4, upscale_delay_s=0, downscale_delay_s=0)
    )
    policy = _apply_autoscaling_config(_resolve_policy_callable(config.policy))
    flood = _load([4, 4], [40, 40], [1.0, 1.0])
    assert policy(_context(flood, 2, config))[0] == 28  # 88 sequences / 3.2 per replica
    # Idle: down, but to zero only from one replica (Serve's rule).
    assert policy(_context(_load([0, 0], [0, 0], [0, 0]), 2, config))[0] == 1


def test_a_replicas_report_counts_its_admitted_requests_as_waiting() -> None:
    stats = {"num_running": 3, "num_waiting": 2, "num_pending": 1, "kv_usage": 0.25}
    assert report(stats) == {RUNNING: 3.0, WAITING: 3.0, KV_CACHE_USAGE: 0.25}
