"""What `pagedray serve` prints (pagedray/cli/console.py): Ray's and Serve's noise left out,
everything else kept, and the replicas' progress while it starts. The real console of two
starts and stops: tests/deploy/test_serve_restart.py."""

from __future__ import annotations

from ray.serve._private.common import (
    DeploymentStatus,
    DeploymentStatusTrigger,
    ReplicaState,
)
from ray.serve.schema import DeploymentStatusOverview

from pagedray.cli.console import quiet_lines, replica_progress
from pagedray.cli.serve_runtime import AppState, wait_until_ready

BANNER = [
    "INFO 2026-12-05 18:31:40,685 serve 29841 -- Throughput optimized Ray Serve enabled with "
    "the following configurations:",
    "  • Direct ingress enabled",
    "  • Request path log buffer size: 1",
    "",
]


def test_serves_banner_and_the_stops_noise_are_dropped_and_nothing_else() -> None:
    killed = (
        "Task ServeController.graceful_shutdown failed. There are infinite retries remaining, "
        "so the task will be retried. Error: The actor is dead because it was killed by `ray.kill`."
    )
    kept = [
        "Traceback (most recent call last):",
        "  • a bullet of someone else's",
        "ValueError: a replica's real failure",
    ]
    assert quiet_lines([*BANNER, kept[0], killed]) == [kept[0]]
    assert quiet_lines(kept) == kept  # a bullet away from the banner is not the banner's


def _overview(running: int, starting: int) -> DeploymentStatusOverview:
    states = {ReplicaState.RUNNING: running, ReplicaState.STARTING: starting}
    trigger = DeploymentStatusTrigger.CONFIG_UPDATE_STARTED
    return DeploymentStatusOverview(DeploymentStatus.UPDATING, trigger, states, "")


def test_the_replicas_progress_in_a_line() -> None:
    assert replica_progress({}) is None
    deployments = {"PagedRayEngine": _overview(0, 2), "OpenAIIngress": _overview(1, 0)}
    assert replica_progress(deployments) == "replicas running: engine 0/2, HTTP ingress 1/1"


def test_progress_is_reported_when_it_changes() -> None:
    states = iter(
        [
            AppState("DEPLOYING", progress="replicas running: engine 0/1"),
            AppState("DEPLOYING", progress="replicas running: engine 0/1"),
            AppState("DEPLOYING", progress="replicas running: engine 0/1"),
            AppState("RUNNING", progress="replicas running: engine 1/1"),  # once it answers
        ]
    )
    answers = iter([503, 503, 503, 200])

    class Answer:
        def __init__(self) -> None:
            self.status_code = next(answers)

    reports: list[str] = []
    wait_until_ready(
        "http://x/health", lambda: next(states), 10.0, get=lambda _: Answer(), report=reports.append
    )
    assert reports == [
        "pagedray: replicas running: engine 0/1",
        "pagedray: replicas running: engine 1/1",
    ]
