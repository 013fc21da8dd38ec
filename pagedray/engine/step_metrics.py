"""Turns the serving loop's events into metric records: a few calls per step and one per
request at its end, never one per token, since the loop is the engine's hot path."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Mapping, Protocol

from pagedray.engine.output_processor import RequestState
from pagedray.engine.stats_log import StatsLog
from pagedray.scheduler.engine_core import EngineCore
from pagedray.scheduler.request import Request

logger = logging.getLogger(__name__)


class EngineMetrics(Protocol):
    """What the loop records into: Ray's metrics in a served engine (`EngineMetrics` of
    cluster/engine_metrics.py, which this describes), injected, so the engine imports no Ray."""

    def record_stats(self, stats: dict[str, float]) -> None: ...

    def record_step(
        self,
        step_time: float,
        batch_size: int,
        num_generation_tokens: int,
        inter_token_latencies: list[float],
    ) -> None: ...

    def record_structured_request(self, kind: str) -> None: ...

    def record_grammar(
        self, bitmask_duration: float | None, compile_times: tuple[float, ...]
    ) -> None: ...

    def record_prefilled(self, num_prompt_tokens: int) -> None: ...

    def record_finished(
        self,
        finished_reason: str,
        num_prompt_tokens: int,
        arrival_time: float,
        scheduled_time: float | None,
        first_token_time: float,
        finish_time: float,
    ) -> None: ...


@dataclass(frozen=True)
class StepRecord:
    """One finished step, as metrics see it: read from the engine when the step ends, since the
    next step may already run (and overwrite the engine's fields) when it is recorded."""

    end_time: float  # time.monotonic()
    duration: float  # seconds
    batch_size: int  # sequences scheduled
    num_tokens: int  # tokens the step produced (a forced EOS with the token before it)
    bitmask_duration: float | None = None  # seconds filling grammar bitmasks; None: no grammar
    grammar_compile_times: tuple[float, ...] = ()  # seconds, each grammar compiled since

    @classmethod
    def of(cls, engine: EngineCore, num_tokens: int) -> StepRecord:
        structured = engine.scheduler.structured
        compile_times = tuple(structured.take_compile_times()) if structured else ()
        return cls(
            engine.last_step_time,
            engine.last_step_duration,
            engine.last_batch_size,
            num_tokens,
            engine.last_bitmask_duration,
            compile_times,
        )


class StepMetricsRecorder:
    """Records into an `EngineMetrics` and feeds the stats line (`StatsLog`); with neither,
    every call does nothing."""

    def __init__(self, metrics: EngineMetrics | None, stats_log: StatsLog | None = None) -> None:
        self.metrics = metrics
        self.stats_log = stats_log  # the periodic stats line, when the engine writes one
        # Scheduler-side state of live requests, kept for their queue time.
        self._requests: dict[str, Request] = {}
        # time.monotonic() of each live request's last token: its next token's latency.
        self._last_token_time: dict[str, float] = {}

    def stats(self, *parts: Mapping[str, float]) -> None:
        """A stats snapshot, given in parts (the scheduler's, the KV hand-offs')."""
        if self.metrics is None and self.stats_log is None:
            return
        merged: dict[str, float] = {}
        for part in parts:
            merged.update(part)
        if self.metrics is not None:
            self.metrics.record_stats(merged)
        if self.stats_log is not None:
            self._to_stats_log(self.stats_log.stats, merged)

    def _to_stats_log(self, feed: Callable[[Any], None], value: Any) -> None:
        """A log line never fails the engine: a stats line that raises is turned off, loudly."""
        try:
            feed(value)
        except Exception:  # noqa: BLE001 - a diagnostic, never worth the requests in flight
            logger.exception("the stats line failed; it is off from now on")
            self.stats_log = None

    def admitted(self, request: Request) -> None:
        if self.metrics is not None:
            self._requests[request.req_id] = request
            constraint = request.sampling_params.structured_outputs
            if constraint is not None:
                self.metrics.record_structured_request(constraint.key[0])

    def step(self, step: StepRecord, request_ids: list[str]) -> None:
        """A step; `request_ids` got tokens in it. Each of them that had a token before
        observes its own inter-token latency (as vLLM: per request, per step it advanced), so
        a request that waited, preempted, shows the wait its client saw."""
        if self.stats_log is not None:
            self._to_stats_log(self.stats_log.step, step.num_tokens)
        if self.metrics is None:
            return
        now = step.end_time
        latencies = []
        for request_id in request_ids:
            last = self._last_token_time.get(request_id)
            if last is not None:
                latencies.append(now - last)
            self._last_token_time[request_id] = now
        self.metrics.record_step(step.duration, step.batch_size, step.num_tokens, latencies)
        if step.bitmask_duration is not None or step.grammar_compile_times:
            self.metrics.record_grammar(step.bitmask_duration, step.grammar_compile_times)

    def finished(self, state: RequestState) -> None:
        request = self._requests.pop(state.request_id, None)
        self._last_token_time.pop(state.request_id, None)
        if self.metrics is None:
            return
        finish_time = state.finish_time or time.time()
        self.metrics.record_finished(
            # NOTE: an n > 1 request counts once, with its first choice's reason.
            finished_reason=state.choices[0].finish_reason or "unknown",
            num_prompt_tokens=len(state.prompt_token_ids),
            arrival_time=state.arrival_time,
            scheduled_time=request.scheduled_time if request is not None else None,
            first_token_time=state.first_token_time or finish_time,
            finish_time=finish_time,
        )

    def aborted(self, request_id: str, state: RequestState | None) -> None:
        """A request that ended without success (aborted, failed): its prefill still counts."""
        self._requests.pop(request_id, None)
        self._last_token_time.pop(request_id, None)
        if self.metrics is not None and state is not None and state.first_token_time is not None:
            self.metrics.record_prefilled(len(state.prompt_token_ids))

    def clear(self) -> None:
        self._requests.clear()
        self._last_token_time.clear()
