"""The engine core driven from asyncio: many concurrent requests, one continuous-batching loop.

`EngineCore` is not thread-safe: the event loop changes it only while no run of steps is in flight;
steps run on the compute thread (workers/compute_thread.py), back to back while the loop has
nothing for the engine (engine/step_runner.py), keeping the loop free for requests, aborts,
health checks and the finished steps' outputs while the model runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any, AsyncGenerator

from pagedray.engine.admission import (
    DEFAULT_REQUEST_TIMEOUT_S,
    Admission,
    default_max_num_waiting,
)
from pagedray.engine.kv_handoffs import KVHandoffs
from pagedray.engine.output_processor import ChoiceDelta, OutputProcessor, deltas_by_request
from pagedray.engine.request_errors import (
    EngineDeadError,
    EngineOverloadedError,
    RequestFailedError,
)
from pagedray.engine.request_lifecycle import RequestLifecycle
from pagedray.engine.request_stream import Sink
from pagedray.engine.stats_log import StatsLog
from pagedray.engine.step_metrics import EngineMetrics, StepMetricsRecorder
from pagedray.engine.step_runner import FinishedStep, StepRunner
from pagedray.engine.wire import GenerateRequest, RequestStepOutput
from pagedray.scheduler.engine_core import EngineCore
from pagedray.scheduler.kv_transfer import KVExport
from pagedray.scheduler.prefix_hash import BlockHash
from pagedray.scheduler.request import EngineRequest
from pagedray.scheduler.sampling_params import SamplingParams
from pagedray.workers.compute_thread import compute_thread

# A step running longer than this marks the engine unhealthy (a hung collective, a dead worker).
DEFAULT_STUCK_AFTER_S = 120.0
# A step running this many times longer than the slowest recent one, and at least
# `STALL_FLOOR_S`, is taken for a stall (`stalled`): its engine's requests move elsewhere.
STALL_FACTOR = 10.0
STALL_FLOOR_S = 10.0
# Steps the engine must have timed before a step can be a stall: the first ones (kernels
# compiling, the first long prefills) set what is normal.
STALL_MIN_STEPS = 16
# NOTE: Ray drops a gauge not recorded again within two metrics export intervals (20 s by
# default, 2 s at least), so an idle engine with metrics re-records its gauges this often.
METRICS_REFRESH_S = 1.0

# How long an exiting engine may spend saving its pool's cache to the host tier (a pool of
# a few GiB takes about a second).
SAVE_ON_EXIT_S = 10.0
SAVE_OVERRUN_S = 2.0  # past its deadline, the step a save is in may still finish

logger = logging.getLogger(__name__)


class AsyncEngine:
    """Owns an `EngineCore` and its `OutputProcessor` and steps them; the requests' side (streams,
    admission, aborts) is its `RequestLifecycle`."""

    def __init__(
        self,
        core: EngineCore,
        output_processor: OutputProcessor,
        stuck_after_s: float = DEFAULT_STUCK_AFTER_S,
        metrics: EngineMetrics | None = None,
        request_timeout_s: float | None = DEFAULT_REQUEST_TIMEOUT_S,
        stats_log: StatsLog | None = None,
    ) -> None:
        """`metrics`: recorded every step and at every finish; `request_timeout_s` None: none;
        `stats_log`: the periodic stats line's (vLLM's), when the engine writes one."""
        self.core = core
        self.output_processor = output_processor
        self.stuck_after_s = stuck_after_s
        self.metrics = metrics
        self.stats_log = stats_log
        self._recorder = StepMetricsRecorder(metrics, stats_log)
        config = core.scheduler.config
        max_num_waiting = config.max_num_waiting or default_max_num_waiting(
            config.max_num_seqs, core.scheduler.kv_cache_manager.num_blocks
        )
        self.admission = Admission(
            max_num_waiting, request_timeout_s, by_priority=config.scheduling_policy == "priority"
        )
        self.requests = RequestLifecycle(self.admission, self._wake)
        self.handoffs = KVHandoffs(core)  # blocks pulled from or given to other engines
        self._wakeup: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._runner = StepRunner(core)
        self._error: BaseException | None = None
        self._saved = self._saving = False  # the pool's cache went to the tier at exit
        self._stats = self.core.stats()  # a snapshot, refreshed only while no step runs

    def start(self) -> None:
        """Start the loop on the running event loop (idempotent)."""
        if self._task is None:
            self._wakeup = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._run_loop())

    def submit(
        self, request: GenerateRequest, sink: Sink | None = None
    ) -> AsyncGenerator[RequestStepOutput, None]:
        """`add_request` of a wire request (each engine client's way in)."""
        return self.add_request(
            request.request_id,
            request.prompt_token_ids,
            request.sampling_params,
            priority=request.priority,
            cache_salt=request.cache_salt,
            lora_name=request.lora_name,
            stream_interval=request.stream_interval,
            sink=sink,
            output_token_ids=request.output_token_ids,
            thinking_end_token_id=request.thinking_end_token_id,
            thinking_start_token_id=request.thinking_start_token_id,
        )

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        lora_name: str | None = None,
        stream_interval: int | None = 1,
        sink: Sink | None = None,
        output_token_ids: list[int] | None = None,
        thinking_end_token_id: int | None = None,
        thinking_start_token_id: int | None = None,
    ) -> AsyncGenerator[RequestStepOutput, None]:
        """Queue a validated request; returns its stream of outputs, merged per
        `stream_interval` tokens (None: one output at the end; see `StreamCoalescer`).
        `output_token_ids`: its output so far, from an engine that lost it (it resumes there).
        `thinking_end_token_id`: the token that ends the thinking its output starts in (a
        reasoning model's `</think>`): its structured output holds after it, its thinking budget
        counts before it; `thinking_start_token_id`: `<think>`, which is no thinking token.

        Closing or cancelling the stream before it finishes aborts the request. With `sink`,
        each output (or the failure) goes to it instead, and `abort()` ends the request.

        Raises:
            EngineDeadError: the loop has stopped.
            EngineOverloadedError: the waiting queue is full.
            ValueError: `request_id` is already in use, or the request exceeds the engine's
                limits (prompt or prompt + max_tokens over the pool, n over max_num_seqs).
        """
        self.start()
        self._raise_if_dead()
        # Refused here, before the caller answers 200, rather than failing once queued.
        self.core.scheduler.check_limits(len(prompt_token_ids), params.n, params.max_tokens)
        engine_request = EngineRequest(
            request_id,
            list(prompt_token_ids),
            params,
            arrival_time=time.time(),  # now, not when the step in flight ends
            priority=priority,
            cache_salt=cache_salt,
            lora_name=lora_name,
            output_token_ids=list(output_token_ids or ()),
            thinking_end_token_id=thinking_end_token_id,
            thinking_start_token_id=thinking_start_token_id,
        )
        return self.requests.accept(
            engine_request,
            prompt,
            stream_interval,
            sink,
            int(self._stats["num_waiting"]),
            lambda: self.core.scheduler.waiting,
        )

    def export_kv(
        self, block_hashes: list[BlockHash], with_bytes: bool
    ) -> asyncio.Future[KVExport]:
        """Another engine would compute this prompt prefix: the leading blocks of it that this
        one caches, saved into the node's tier within a step (with their bytes for another
        node's engine; engine/kv_handoffs.py)."""
        self.start()
        self._raise_if_dead()
        answer = self.handoffs.export(block_hashes, with_bytes)
        self._wake()
        return answer

    def give_kv(self, export: KVExport) -> None:
        """Blocks another node's engine exported: into this node's tier before the requests
        added after this call are admitted (a dead engine drops them)."""
        if self._error is None and not (self._task is not None and self._task.done()):
            self.handoffs.give(export)

    def abort(self, request_id: str) -> None:
        """Abort a request: blocks freed before the next step, its stream failed (for a sink)."""
        self.requests.abort(request_id)

    def health(self) -> dict[str, Any]:
        """`healthy` only while the loop is alive and no step has been running too long;
        `degraded` while the waiting queue is full or a request was refused lately."""
        self._check_workers()
        error = None
        if self._error is not None:
            error = f"engine loop died: {self._error!r}"
        elif self._task is not None and self._task.done():
            error = "engine loop stopped"
        elif (started := self._runner.started) is not None:
            running_for = time.monotonic() - started
            if running_for > self.stuck_after_s:
                error = f"engine step has been running for {running_for:.1f}s (stuck)"
        return {
            "healthy": error is None,
            "degraded": error is None and self.admission.degraded(self._num_waiting()),
            "error": error,
            "num_steps": self.core.num_steps,
        }

    def stalled(self) -> str | None:
        """Why the engine makes no progress while it has work, if it does not: its loop ended,
        or the running step has run `STALL_FACTOR` times longer than the slowest recent one (a
        hung collective, a wedged worker). Sooner than `health`'s `stuck_after_s`, which gets
        the replica replaced: a stall only takes it out of routing (cluster/replica_watch.py)
        until it steps again."""
        if self._error is not None or (self._task is not None and self._task.done()):
            return "engine loop stopped"
        started = self._runner.started
        if started is None or self._runner.num_timed_steps < STALL_MIN_STEPS:
            return None
        running_for = time.monotonic() - started
        limit = min(self.stuck_after_s, max(STALL_FLOOR_S, STALL_FACTOR * self._runner.slowest_s))
        if running_for > limit:
            return f"engine step has been running for {running_for:.1f}s"
        return None

    def stats(self) -> dict[str, Any]:
        if self._runner.started is None and not self._saving:
            self._stats = self.core.stats()
        return {
            **self._stats,
            "num_requests": len(self.requests.streams),
            "num_pending": len(self.requests.pending),
            "max_num_waiting": self.admission.max_num_waiting,
            "max_model_len": self.core.scheduler.max_model_len,
            "last_step_duration": self.core.last_step_duration,
            "last_batch_size": self.core.last_batch_size,
            **self.handoffs.stats(),
            "healthy": self.health()["healthy"],
        }

    async def shutdown(self) -> None:
        """Stop the loop, leave the pool's cache in the node's tier when idle, and fail what is
        still in flight."""
        if self._task is not None and not self._task.done():
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, self.save_cache_to_tier, SAVE_ON_EXIT_S)
        self._fail_all(EngineDeadError("engine shut down"))

    def save_cache_to_tier(self, timeout_s: float) -> int:
        """The engine is going away: save its pool's cached blocks to the node's host tier
        (`EngineCore.save_cache_to_tier`) for at most about `timeout_s`; blocking, for a
        destructor; once. Not while a run of steps is in flight (requests still run: their
        steps are the loop's, not this call's). A failure is logged, never raised: the engine
        goes either way."""
        if self._error is not None or self._saved or self._runner.started is not None:
            return 0
        self._saved = self._saving = True  # `stats` reads no tier meanwhile (one thread does)
        deadline = time.monotonic() + timeout_s
        future = compute_thread().submit(self.core.save_cache_to_tier, deadline)
        future.add_done_callback(lambda _: setattr(self, "_saving", False))
        try:
            saved = future.result(timeout=timeout_s + SAVE_OVERRUN_S)
        except Exception:  # noqa: BLE001 - a dead rank, a timeout: nothing more to save
            future.cancel()  # if it has not started yet
            logger.warning("saving the KV cache to the host tier failed", exc_info=True)
            return 0
        if saved:
            logger.info("saved %d cached KV blocks to the host tier before exiting", saved)
        return saved

    # ---- the loop ------------------------------------------------------------------------

    async def _run_loop(self) -> None:
        """schedule → execute → update, in runs of steps (`StepRunner`). A step's outputs go to
        the streams and metrics while the next step runs; only what the next plan depends on
        (stop strings found here, new requests, aborts) is done between runs."""
        assert self._wakeup is not None
        finished_step: FinishedStep | None = None
        compute = compute_thread()
        loop = asyncio.get_running_loop()
        try:
            while True:
                self._apply_pending()
                if not self.core.has_unfinished_requests():
                    if finished_step is not None:
                        self._complete(finished_step)
                        finished_step = None
                    if self.handoffs.needs_step():  # idle, yet an export's blocks need saving
                        await self._save_step(loop)
                        continue
                    self.requests.expire()
                    self._recorder.stats(self._stats, self.handoffs.stats())
                    if not self._saving:  # idle: no step touches the index or the tier now
                        self.core.publish_kv_delta()
                    self._wakeup.clear()
                    await self._wait_for_work()
                    continue
                self._runner.started = time.monotonic()
                self._runner.streaming = self.requests.any_streaming()
                steps = loop.run_in_executor(
                    compute, self._runner.run, loop, self._hand_over, self._may_run_on
                )
                try:
                    if finished_step is not None:
                        self._complete(finished_step)
                        finished_step = None
                    self.requests.expire()
                    self._recorder.stats(self._stats, self.handoffs.stats())
                    finished_step = await steps
                finally:
                    self._runner.started = None
                if (failure := self._runner.failure) is not None:
                    raise failure  # a step handed over mid-run failed on the loop
                self.handoffs.answer()  # the run's first step saved what exports offered
                self._process(finished_step)
        except asyncio.CancelledError:
            self._runner.stopping = True
            raise
        except BaseException as exc:  # noqa: BLE001 - any failure kills the engine, loudly
            self._runner.stopping = True
            self._error = exc
            self._fail_all(EngineDeadError(f"engine step failed: {exc!r}"))

    async def _save_step(self, loop: asyncio.AbstractEventLoop) -> None:
        """A step that schedules nothing, for the saves its plan carries."""
        self._runner.started = time.monotonic()
        try:
            await loop.run_in_executor(compute_thread(), self.core.step)
        finally:
            self._runner.started = None
        self.handoffs.answer()

    def _hand_over(self, finished_step: FinishedStep) -> None:
        """A step of a run that goes on: its outputs out now, while the next one runs."""
        self._process(finished_step)
        self._complete(finished_step)
        self.requests.expire()
        self._recorder.stats(self._stats, self.handoffs.stats())
        self._runner.streaming = self.requests.any_streaming()

    def _may_run_on(self) -> bool:
        """Read on the compute thread between a run's steps: nothing waits for the engine."""
        stop_strings = self.output_processor.finds_stop_strings
        return not (self.requests.has_changes() or stop_strings or self.handoffs.waiting())

    def _process(self, finished_step: FinishedStep) -> None:
        """A step's outputs; a stop string found (never mid-run, see `_may_run_on`) stops it."""
        finished_step.advanced = self.output_processor.advanced(finished_step.outputs)
        finished_step.deltas, stopped = self.output_processor.process(finished_step.outputs)
        if stopped:
            self.core.stop_requests(stopped)
        self._stats = finished_step.stats

    def _complete(self, finished_step: FinishedStep) -> None:
        """A finished step's outputs to their streams, and its metrics."""
        by_request = deltas_by_request(finished_step.deltas)
        if finished_step.record is not None:
            self._recorder.step(finished_step.record, finished_step.advanced)
        self._publish(by_request)

    async def _wait_for_work(self) -> None:
        """Sleep until woken; with metrics or the stats line, at most `METRICS_REFRESH_S` (gauges
        stay exported, and the line that shows the load ending is written)."""
        assert self._wakeup is not None
        refreshed = self.metrics is not None or self.stats_log is not None
        timeout_s = METRICS_REFRESH_S if refreshed else None
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._wakeup.wait(), timeout_s)

    def _apply_pending(self) -> None:
        """Hand accepted requests and aborts to the scheduler, after the engines' KV hand-offs
        (no step is in flight here)."""
        self.handoffs.apply()
        if not self.requests.has_changes():
            return  # nothing changed: the stats snapshot of the last step stands
        aborts, pending = self.requests.take_changes()
        if aborts:
            self.core.abort_requests(aborts)
            for request_id in aborts:
                self._recorder.aborted(request_id, self.output_processor.requests.get(request_id))
                self.output_processor.abort(request_id)
        for item in pending:
            request = item.engine_request
            try:
                self.core.add_request(request)
            except OverflowError as exc:
                self.requests.fail(request.req_id, EngineOverloadedError(str(exc)))
                continue
            except ValueError as exc:
                self.requests.fail(request.req_id, exc)
                continue
            except Exception as exc:  # noqa: BLE001 - one request's failure is its own
                logger.exception("request %s could not be queued", request.req_id)
                self.requests.fail(request.req_id, exc)
                continue
            params = request.sampling_params
            state = self.output_processor.add_request(
                request.req_id, item.prompt, request.prompt_token_ids, params, item.at_end
            )
            state.arrival_time = request.arrival_time
            self._recorder.admitted(self.core.scheduler.requests[request.req_id])
        self._stats = self.core.stats()

    def _publish(self, by_request: dict[str, list[ChoiceDelta]]) -> None:
        for request_id, request_deltas in by_request.items():
            state = self.output_processor.requests.get(request_id)
            if state is None:
                continue
            if state.error is not None:  # no success: counted like an abort
                self._recorder.aborted(request_id, self.output_processor.requests.pop(request_id))
                self.requests.fail(request_id, RequestFailedError(state.error))
                continue
            output = RequestStepOutput(
                request_id, request_deltas, num_cached_tokens=state.num_cached_tokens
            )
            if state.finished:
                self.output_processor.requests.pop(request_id)
                output.finished = True
                self._recorder.finished(state)
            self.requests.deliver(request_id, output)

    def _fail_all(self, exc: BaseException) -> None:
        self._recorder.clear()
        self.handoffs.fail_all(exc)
        for request_id in self.requests.fail_all(exc):
            self.output_processor.abort(request_id)

    def _check_workers(self) -> None:
        """Between steps, an executor that can tell (`dead_rank`) is asked whether a rank died:
        the engine is then dead at once, its requests failed, rather than at the next step."""
        dead_rank = getattr(self.core.executor, "dead_rank", None)
        if self._error is not None or self._runner.started is not None or dead_rank is None:
            return
        rank = dead_rank()
        if rank is not None:
            self._error = RuntimeError(f"worker rank {rank} exited")
            self._fail_all(EngineDeadError(f"engine lost a worker: rank {rank} exited"))
            if self._task is not None:
                self._task.cancel()

    def _num_waiting(self) -> int:
        return int(self._stats["num_waiting"]) + len(self.requests.pending)

    def _raise_if_dead(self) -> None:  # a stuck step shows in health(); requests still queue
        if self._error is not None or (self._task is not None and self._task.done()):
            raise EngineDeadError(self.health()["error"] or "engine loop stopped")

    def _wake(self) -> None:
        if self._wakeup is not None:
            self._wakeup.set()
