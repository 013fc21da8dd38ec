"""The engine core loop: schedule, run on the workers, update. Three calls a step, as nano-vllm.

The executor is anything that turns a `SchedulerOutput` into rank 0's `ModelRunnerOutput`: an
in-process model runner, or Ray worker actors behind one of the cluster's dispatch paths.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from typing import Callable, Iterable, Protocol

from pagedray.scheduler.config import SchedulerConfig
from pagedray.scheduler.grammar import RequestGrammar, StructuredOutputManager
from pagedray.scheduler.host_kv_tier import HostKVTier
from pagedray.scheduler.kv_events import KVCacheDelta
from pagedray.scheduler.messages import ModelRunnerOutput, SchedulerOutput
from pagedray.scheduler.outputs import EngineCoreOutput
from pagedray.scheduler.request import EngineRequest, Request, RequestStatus
from pagedray.scheduler.scheduler import Scheduler

# Longest the step thread idles on a compiling grammar before the loop looks at its queues again.
GRAMMAR_WAIT_S = 0.05
# Blocks an exiting engine saves per step: a bounded copy (on a GPU, one gather of this many
# blocks on the device), so a large pool's save neither takes the memory of the pool's size nor
# outruns its deadline by much.
SAVE_CHUNK_BLOCKS = 1024


class Executor(Protocol):
    """Runs one step on every tensor-parallel rank and returns rank 0's result."""

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...


class EngineCore:
    """A scheduler bound to an executor; `step()` advances every running sequence by one token."""

    def __init__(
        self,
        config: SchedulerConfig,
        num_kv_blocks: int,
        executor: Executor,
        eos_token_ids: Iterable[int] = (),
        structured: StructuredOutputManager | None = None,
        host_tier: HostKVTier | None = None,
    ) -> None:
        """`structured`: compiles grammars for structured outputs (None: those are refused).
        `host_tier`: the node's KV tier the executor's ranks opened (None: none)."""
        self.scheduler = Scheduler(config, num_kv_blocks, eos_token_ids, structured, host_tier)
        self.executor = executor
        self.num_steps = 0
        self.last_step_time = 0.0  # seconds, time.monotonic() at the end of the last step
        self.last_step_duration = 0.0  # seconds
        self.last_batch_size = 0  # sequences in the last step
        self.last_bitmask_duration: float | None = None  # seconds; None: no constrained row
        # With `record_kv_events`: given each step's prefix-cache changes (and the node host
        # tier's, as `tier`), on the stepping thread, when there are any (a reset between steps
        # comes with the next step's).
        self.kv_delta_listener: Callable[[KVCacheDelta], None] | None = None

    def add_request(self, engine_request: EngineRequest) -> None:
        self.scheduler.add_request(Request(engine_request))

    def abort_requests(self, req_ids: Iterable[str]) -> None:
        self.scheduler.finish_requests(req_ids, RequestStatus.FINISHED_ABORTED)

    def stop_requests(self, req_ids: Iterable[str]) -> None:
        """Finish requests whose stop string the detokenizer found."""
        self.scheduler.finish_requests(req_ids, RequestStatus.FINISHED_STOPPED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self, streaming: bool = True) -> list[EngineCoreOutput]:
        """`streaming`: whether a request in flight streams to its client (the plan says so)."""
        start = time.monotonic()
        scheduler_output = self.scheduler.schedule()
        scheduler_output.streaming = streaming
        # Requests the scheduler ended before they ran (a grammar that failed to compile).
        outputs, self.scheduler.pending_outputs = self.scheduler.pending_outputs, []
        if scheduler_output.total_num_scheduled_tokens == 0:
            if (
                scheduler_output.finished_req_ids
                or scheduler_output.blocks_to_save
                or scheduler_output.lora_loads
            ):
                # Let the workers drop what finished (save, load adapters) when nothing runs.
                manager = self.scheduler.kv_cache_manager
                try:
                    runner_output = self.executor.execute_model(scheduler_output)
                except BaseException:
                    self.scheduler.unindex_step_blocks(scheduler_output)  # nothing was indexed
                    raise
                manager.step_done(ran=True, tier_copy_seconds=runner_output.tier_copy_seconds)
                outputs += self.scheduler.lora_loads_done(scheduler_output, runner_output)
            if not outputs and not scheduler_output.lora_loads:  # else admissions wait on it
                self._wait_for_grammars()
            return outputs
        try:
            runner_output = self._execute(scheduler_output)
        except BaseException:
            # The step's blocks were indexed when planned; their KV may never have been written.
            self.scheduler.unindex_step_blocks(scheduler_output)
            raise
        self.scheduler.kv_cache_manager.step_done(
            ran=True, tier_copy_seconds=runner_output.tier_copy_seconds
        )
        # The loads first: no sequence runs on an adapter still loading, and a failure below
        # must not leave one loading for good.
        outputs += self.scheduler.lora_loads_done(scheduler_output, runner_output)
        outputs += self.scheduler.update_from_output(scheduler_output, runner_output)
        self.num_steps += 1
        self.last_step_time = time.monotonic()
        self.last_step_duration = self.last_step_time - start
        self.last_batch_size = len(scheduler_output.num_scheduled_tokens)
        self.publish_kv_delta()
        return outputs

    def publish_kv_delta(self) -> None:
        """Hand the prefix cache's changes (and the node tier's) to `kv_delta_listener`, if
        any: after each step, and from an idle engine's loop, whose node tier the node's other
        engines keep changing (and whose first delta is the tier's snapshot)."""
        if self.kv_delta_listener is not None:
            delta = self.scheduler.kv_cache_manager.take_kv_delta()
            if delta:
                self.kv_delta_listener(delta)

    def _execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        structured = self.scheduler.structured
        rows, forced = self._grammar_rows(scheduler_output) if structured else ({}, {})
        if structured is not None and (rows or forced):
            # In-process, the masks are filled while the forward pass runs (the model runner
            # waits for them before sampling); a plan that crosses processes carries them.
            overlap = getattr(self.executor, "in_process", False)
            fill = structured.bitmask_future if overlap else structured.bitmask
            scheduler_output.grammar_bitmask = fill(rows, forced)
        runner_output = self.executor.execute_model(scheduler_output)
        if isinstance(scheduler_output.grammar_bitmask, Future):
            scheduler_output.grammar_bitmask.result()  # done before any matcher advances
        self.last_bitmask_duration = structured.stats.last_mask_s if structured and rows else None
        return runner_output

    def _grammar_rows(
        self, scheduler_output: SchedulerOutput
    ) -> tuple[dict[str, RequestGrammar], dict[str, int]]:
        """Of the sequences that sample in this (scheduled) step: the grammars of those held to
        one (not those still thinking: a grammar holds only after it), and the token forced on
        those whose thinking budget is spent (the one that ends the thinking)."""
        rows, forced = {}, {}
        for req_id in scheduler_output.num_scheduled_tokens:
            req = self.scheduler.requests[req_id]
            if req.num_computed_tokens < req.num_tokens:
                continue  # a prefill chunk short of the end samples nothing
            grammar = req.grammar
            if grammar is not None and grammar.holds:
                rows[req_id] = grammar
            elif req.thinking_left == 0 and req.thinking_end_token_id is not None:
                # Its thinking budget is spent: the next token must end the thinking.
                forced[req_id] = req.thinking_end_token_id
        return rows, forced

    def save_cache_to_tier(self, deadline: float | None = None) -> int:
        """Before the engine goes (a drain, a scale-down, a redeploy, `LLM.shutdown`): save
        the blocks its pool caches that the node's tier lacks, so that a replica replacing it
        starts warm without write-through. Only while idle (an in-flight request's next step is
        not this call's to run); the most recently used first, at most half the tier (the other
        engines' blocks there are as warm as these), in steps of `SAVE_CHUNK_BLOCKS` with
        nothing scheduled, until `deadline` (time.monotonic()). Returns the blocks saved."""
        manager = self.scheduler.kv_cache_manager
        tier = manager.host_tier
        if tier is None or self.has_unfinished_requests():
            return 0
        cached = manager.cached_blocks_by_recency()[: tier.num_slots // 2]
        saved_before = tier.num_saved
        for start in range(0, len(cached), SAVE_CHUNK_BLOCKS):
            if deadline is not None and time.monotonic() > deadline:
                break
            manager.offer_for_saving(cached[start : start + SAVE_CHUNK_BLOCKS])
            self.step()  # nothing to schedule: the plan carries only the saves
        return tier.num_saved - saved_before

    def _wait_for_grammars(self) -> None:
        """Nothing could run: if a grammar is compiling, idle on it briefly rather than spin."""
        for req in self.scheduler.waiting:
            if req.grammar is not None and not req.grammar.ready():
                req.grammar.wait(GRAMMAR_WAIT_S)
                return

    def stats(self) -> dict[str, float]:
        structured = self.scheduler.structured
        grammar_stats = {}
        if structured is not None:
            grammar_stats = {
                "num_grammars_compiled": structured.stats.num_compiled,
                "num_grammar_cache_hits": structured.stats.num_cache_hits,
            }
        return {**self.scheduler.stats(), **grammar_stats, "num_steps": self.num_steps}
