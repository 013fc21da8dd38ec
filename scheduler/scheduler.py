"""Continuous batching: every step, decide which tokens of which sequences the workers compute.

Running sequences go first (decodes and unfinished prefill chunks), then waiting ones are admitted
while the token budget, `max_num_seqs` and free blocks allow. When blocks run out the newest
running sequence is preempted (freed, later recomputed). Plain Python: no torch, no Ray.
"""

from __future__ import annotations

import bisect
import itertools
import time
from typing import Iterable

from pagedray.scheduler.block_pool import KVCacheBlock
from pagedray.scheduler.config import SchedulerConfig
from pagedray.scheduler.grammar import GRAMMAR_REJECTED, StructuredOutputManager
from pagedray.scheduler.host_kv_tier import HostKVTier
from pagedray.scheduler.kv_cache_manager import Allocation, KVCacheManager
from pagedray.scheduler.limits import check_request_limits
from pagedray.scheduler.lora_slots import LoRASlots
from pagedray.scheduler.messages import (
    CachedRequestData,
    ModelRunnerOutput,
    RequestError,
    SchedulerOutput,
)
from pagedray.scheduler.outputs import EngineCoreOutput
from pagedray.scheduler.priority import num_seqs, priority_victims
from pagedray.scheduler.request import Request, RequestStatus
from pagedray.scheduler.request_failure import FailureKind, RequestFailure, refusal
from pagedray.scheduler.worker_view import WorkerView

# Steps a request may be passed over because no LoRA slot can take its adapter, before the
# requests of other adapters wait for it (a bound on its wait, whatever the traffic).
LORA_MAX_SLOT_WAITS = 64


class Scheduler:
    """Owns the waiting queue, the running set and, through `KVCacheManager`, every block table."""

    def __init__(
        self,
        config: SchedulerConfig,
        num_kv_blocks: int,
        eos_token_ids: Iterable[int] = (),
        structured: StructuredOutputManager | None = None,
        host_tier: HostKVTier | None = None,
    ) -> None:
        """`host_tier`: the node's tier below the pool (evicted blocks saved, misses found)."""
        self.config = config
        self.structured = structured  # grammars for structured outputs; None: those refused
        # Requests ended outside a step (their grammar failed to compile), for the next step.
        self.pending_outputs: list[EngineCoreOutput] = []
        self.eos_token_ids = frozenset(eos_token_ids)
        self.kv_cache_manager = KVCacheManager(
            num_kv_blocks,
            config.block_size,
            enable_caching=config.enable_prefix_caching,
            record_kv_events=config.enable_kv_cache_events,
            host_tier=host_tier,
        )
        # NOTE: a sequence longer than the whole pool could never be scheduled again after a
        # preemption, so the usable model length is capped by the pool.
        self.max_model_len = min(config.max_model_len, num_kv_blocks * config.block_size)
        self.requests: dict[str, Request] = {}
        self.waiting: list[Request] = []  # sorted by _queue_key
        self.running: list[Request] = []  # admission order: the last is the newest
        self.children: dict[str, list[str]] = {}  # forked parent req_id -> child req_ids
        self._queue_keys: dict[str, tuple[int, float, int]] = {}
        self._arrival_counter = itertools.count()
        self.worker_view = WorkerView(self.kv_cache_manager.get_block_ids)
        self._step_id = 0
        self.num_preemptions = 0
        self.num_computed_tokens_total = 0  # tokens run through the model, all steps
        self.num_cow_copies = 0  # copy-on-write block copies issued
        self.peak_num_running = 0
        self.peak_kv_usage = 0.0
        self.indexed_in_step: list[KVCacheBlock] = []  # blocks the last schedule() indexed
        # The adapters requests may name and the workers' slots; None: LoRA is off.
        self.lora_slots = LoRASlots(config.max_loras) if config.enable_lora else None

    # ---- requests in and out -------------------------------------------------------------

    def add_request(self, req: Request) -> None:
        """Queue a validated request; raises ValueError if it can never fit."""
        if req.req_id in self.requests or req.req_id in self.children:
            raise refusal("request_id", f"{req.req_id!r} is already in use")
        self.check_limits(req.num_tokens, req.sampling_params.n)
        if req.output_token_ids and req.sampling_params.n != 1:
            raise refusal("n", "only a request of one choice resumes from its output")
        if req.lora_name is not None:
            adapter = None if self.lora_slots is None else self.lora_slots.adapter_id(req.lora_name)
            if adapter is None:
                raise refusal("model", f"no LoRA adapter {req.lora_name!r} is loaded")
            assert self.lora_slots is not None
            req.lora_id, req.lora_key = adapter, self.lora_slots.keys[adapter]
        if req.thinking_left is not None and self.structured is None:
            raise refusal("thinking_token_budget", "this engine was built without a tokenizer")
        constraint = req.sampling_params.structured_outputs
        if constraint is not None:
            if self.structured is None:
                raise refusal("structured_outputs", "this engine was built without a tokenizer")
            req.grammar = self.structured.start(constraint, req.thinking_end_token_id)
        if (
            self.config.max_num_waiting is not None
            and len(self.waiting) >= self.config.max_num_waiting
        ):
            raise OverflowError(f"waiting queue is full ({self.config.max_num_waiting} requests)")
        self.requests[req.req_id] = req
        priority = req.priority if self.config.scheduling_policy == "priority" else 0
        self._queue_keys[req.req_id] = (priority, req.arrival_time, next(self._arrival_counter))
        self._enqueue(req)

    def check_limits(self, num_prompt_tokens: int, n: int, max_tokens: int | None = None) -> None:
        """Raises ValueError if a request of this size could never be scheduled here."""
        check_request_limits(
            self.config.max_num_seqs, self.max_model_len, num_prompt_tokens, n, max_tokens
        )

    def finish_requests(self, req_ids: Iterable[str], status: RequestStatus) -> None:
        """End requests from outside the step (abort, or a stop string found by the detokenizer).

        A forked request's id ends all of its children. Blocks are freed at once.
        """
        for req_id in req_ids:
            for seq_id in self.children.get(req_id, [req_id]):
                req = self.requests.get(seq_id)
                if req is not None and not req.is_finished:
                    self._finish(req, status)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- one step ------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Plan one step. Running sequences first, then admissions; preempt when blocks run out."""
        budget = self.config.max_num_batched_tokens
        plan = SchedulerOutput(self._step_id, [], CachedRequestData(), {}, 0, [], [])
        self.indexed_in_step = []
        preempted = False
        if self.config.scheduling_policy == "priority":
            self._make_room_for_priority()

        idx = 0
        while idx < len(self.running) and budget > 0:
            req = self.running[idx]
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            allocation = self.kv_cache_manager.allocate_slots(req, num_new)
            while allocation is None:
                victim = self._pick_victim()
                self._preempt(victim)
                preempted = True
                if victim is req:
                    break
                allocation = self.kv_cache_manager.allocate_slots(req, num_new)
            if allocation is None:
                break  # req preempted itself; everything after it was already preempted
            self._plan(plan, req, allocation, num_new)
            budget -= num_new
            idx += 1

        if not preempted:
            self._admit_waiting(plan, budget)

        plan.total_num_scheduled_tokens = sum(plan.num_scheduled_tokens.values())
        if self.lora_slots is not None:
            plan.lora_loads = self.lora_slots.take_loads()
        plan.finished_req_ids = self.worker_view.take_finished()
        computed = self.indexed_in_step if self.config.kv_offloading_write_through else []
        plan.blocks_to_save, plan.computed_blocks_to_save = self.kv_cache_manager.take_saves(
            computed
        )
        self._step_id += 1
        self.num_computed_tokens_total += plan.total_num_scheduled_tokens
        self.num_cow_copies += len(plan.blocks_to_copy)
        for req_id, num_new in plan.num_scheduled_tokens.items():
            self.requests[req_id].num_computed_tokens += num_new
        self.peak_num_running = max(self.peak_num_running, len(self.running))
        self.peak_kv_usage = max(self.peak_kv_usage, self.kv_cache_manager.usage)
        return plan

    def _make_room_for_priority(self) -> None:
        # NOTE: a request whose grammar still compiles, or whose LoRA adapter is not loaded
        # yet (asking starts its load), cannot be admitted: it preempts no one.
        head = next(
            (
                r
                for r in self.waiting
                if (r.grammar is None or r.grammar.ready()) and self._lora_ready(r)
            ),
            None,
        )
        for victim in priority_victims(head, self.running, self.config.max_num_seqs):
            self._preempt(victim)

    def _admit_waiting(self, plan: SchedulerOutput, budget: int) -> None:
        # NOTE: an unforked n > 1 prompt counts as the n sequences it becomes after its prefill.
        num_running_seqs = sum(num_seqs(running_req) for running_req in self.running)
        # Once a request's adapter has found no slot for `LORA_MAX_SLOT_WAITS` steps, no later
        # adapter request is admitted (base-model ones are) until it is: the slots' sequences
        # drain and it gets one. Before that, others pass it, as vLLM's, to fill the batch.
        slot_starved = False
        idx = 0  # NOTE: a request whose grammar is still compiling is passed over, not waited on
        while idx < len(self.waiting) and budget > 0:
            req = self.waiting[idx]
            if req.grammar is not None and not req.grammar.ready():
                idx += 1
                continue
            grammar_error = _grammar_error(req)
            if grammar_error is not None:
                refusal = RequestFailure(FailureKind.INVALID, grammar_error, "structured_outputs")
                self.pending_outputs.append(self._error_output(req, refusal))
                self._finish(req, RequestStatus.FINISHED_ERROR)
                continue
            req_num_seqs = num_seqs(req)
            if self.running and num_running_seqs + req_num_seqs > self.config.max_num_seqs:
                break
            if req.lora_id is not None and (slot_starved or not self._lora_ready(req)):
                assert self.lora_slots is not None
                if not slot_starved and self.lora_slots.waits_for_slot(req.lora_id):
                    req.num_slot_waits += 1
                    slot_starved = req.num_slot_waits >= LORA_MAX_SLOT_WAITS
                idx += 1  # its adapter is loading, or no slot can take it yet: others may go
                continue
            computed_blocks, num_hit = self.kv_cache_manager.get_computed_blocks(req)
            tier_hits = self.kv_cache_manager.get_tier_hits(req, len(computed_blocks))
            num_hit += tier_hits.num_blocks * self.config.block_size
            num_new = min(req.num_tokens - num_hit, budget)
            allocation = self.kv_cache_manager.allocate_slots(
                req, num_new, computed_blocks, tier_hits
            )
            if allocation is None:
                break
            self.waiting.pop(idx)
            if self.lora_slots is not None and req.lora_id is not None:
                self.lora_slots.acquire(req)
            req.num_computed_tokens = num_hit
            if req.num_cached_tokens < 0:  # first admission (not a preempted one's return)
                req.num_cached_tokens = num_hit
                req.scheduled_time = time.time()
            req.status = RequestStatus.RUNNING
            self._add_running(req)
            self._plan(plan, req, allocation, num_new)
            budget -= num_new
            num_running_seqs += req_num_seqs

    def _lora_ready(self, req: Request) -> bool:
        """Whether `req`'s adapter (if any) is loaded in a slot; if not, the next plan loads it
        where a slot can take it."""
        if req.lora_id is None or self.lora_slots is None:
            return True
        return self.lora_slots.ready(req.lora_id)

    def _plan(
        self, plan: SchedulerOutput, req: Request, allocation: Allocation, num_new: int
    ) -> None:
        """Put `num_new` tokens of `req` in this step's plan, on the blocks just allocated."""
        self.worker_view.emit(req, allocation, plan.scheduled_new_reqs, plan.scheduled_cached_reqs)
        plan.blocks_to_copy.extend(allocation.copies)
        plan.blocks_to_load.extend(allocation.loads)
        plan.blocks_to_load_from_disk.extend(allocation.disk_loads)
        plan.num_scheduled_tokens[req.req_id] = num_new
        # Indexed when planned, as vLLM indexes at allocation: a request admitted later in this
        # very step reads the shared prefix this step computes instead of computing it again.
        # Every layer stores the whole step's K/V before any attention reads it, and a sequence
        # in the plan is never preempted later in the same `schedule()` (see `_pick_victim`).
        self.indexed_in_step += self.kv_cache_manager.cache_blocks(
            req, req.num_computed_tokens + num_new
        )

    def unindex_step_blocks(self, scheduler_output: SchedulerOutput) -> None:
        """The planned step failed before it ran: drop the blocks `_plan` indexed for it, whose
        KV may never have been written (the offline `LLM` is used again after a failed call),
        free the tier slots it was to save into, and the LoRA slots it was to load."""
        if self.lora_slots is not None:
            self.lora_slots.lost(scheduler_output.lora_loads)
        self.kv_cache_manager.block_pool.uncache(self.indexed_in_step)
        self.indexed_in_step = []
        self.kv_cache_manager.step_done(ran=False)

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Apply sampled tokens: fork n > 1 prompts, check stop conditions, free finished blocks."""
        outputs: list[EngineCoreOutput] = []
        for req_id, (first_position, entries) in runner_output.prompt_logprobs.items():
            req = self.requests.get(req_id)
            if req is not None and not req.is_finished:
                req.store_prompt_logprobs(first_position, entries)
        outputs.extend(self._fail(runner_output.failed))
        for req_id, token_ids, logprobs in zip(
            runner_output.req_ids, runner_output.sampled_token_ids, runner_output.logprobs
        ):
            req = self.requests.get(req_id)
            if req is None or req.is_finished or req.num_computed_tokens < req.num_tokens:
                continue  # aborted meanwhile, or preempted and reset
            if req.sampling_params.n > 1 and req.parent_req_id is None:
                outputs.extend(self._fork(req, token_ids, logprobs))
            else:
                outputs.append(self._append(req, token_ids, logprobs))
        return outputs

    def _fail(self, failed: dict[str, RequestError]) -> list[EngineCoreOutput]:
        """End the requests whose sampling failed (every choice of each); the rest go on."""
        outputs: list[EngineCoreOutput] = []
        for req_id, error in failed.items():
            req = self.requests.get(req_id)
            if req is None or req.is_finished:
                continue  # aborted meanwhile, or a sibling's failure already ended it
            outputs.append(self._end_with_error(req, error))
        return outputs

    def lora_loads_done(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """The step ran its plan's adapter loads: the adapters loaded are admitted on; the
        requests waiting for one that failed end (nothing of them ran), with an error."""
        if self.lora_slots is None or not scheduler_output.lora_loads:
            return []
        failed = self.lora_slots.loaded(
            scheduler_output.lora_loads, runner_output.lora_load_failures
        )
        outputs = []
        for req in [r for r in self.waiting if r.lora_id in failed]:
            if not req.is_finished:
                message = f"the LoRA adapter {req.lora_name!r} could not be loaded"
                failure = RequestFailure(FailureKind.INTERNAL, message)
                outputs.append(self._end_with_error(req, failure))
        return outputs

    def _end_with_error(self, req: Request, error: RequestError) -> EngineCoreOutput:
        """End every choice of `req`'s client request (blocks freed); the output that says so."""
        output = self._error_output(req, error)
        self.finish_requests([req.parent_req_id or req.req_id], RequestStatus.FINISHED_ERROR)
        return output

    def _error_output(self, req: Request, error: RequestError) -> EngineCoreOutput:
        return EngineCoreOutput(
            req_id=req.parent_req_id or req.req_id,
            choice_index=0,
            new_token_ids=[],
            new_logprobs=None,
            finish_reason=RequestStatus.FINISHED_ERROR.finish_reason,
            num_prompt_tokens=req.num_prompt_tokens,
            num_cached_tokens=_prompt_hit(req),
            error=error,
        )

    def _append(
        self, req: Request, token_ids: list[int], logprobs: list | None
    ) -> EngineCoreOutput:
        req.append_output_token_ids(token_ids)
        status = self._stop_status(req)
        if req.grammar is not None and self.structured is not None:
            if not req.grammar.accept(token_ids):  # masked: only a bug gets here
                return self._end_with_error(req, GRAMMAR_REJECTED)
            eos = self.structured.end_token(req.grammar)
            if status is None and eos is not None:
                # Complete: only EOS can follow, so it ends the output now rather than being
                # sampled next step (also under ignore_eos or min_tokens: nothing else fits).
                req.append_output_token_ids([eos])
                token_ids, logprobs = [*token_ids, eos], logprobs and [*logprobs, ([eos], [0.0], 1)]
                status = RequestStatus.FINISHED_STOPPED
        if status is not None:
            self._finish(req, status)
        first_output = req.num_output_tokens == len(token_ids)
        return EngineCoreOutput(
            req_id=req.parent_req_id or req.req_id,
            choice_index=req.choice_index,
            new_token_ids=token_ids,
            new_logprobs=logprobs,
            finish_reason=status.finish_reason if status else None,
            num_prompt_tokens=req.num_prompt_tokens,
            num_cached_tokens=_prompt_hit(req),
            prompt_logprobs=req.prompt_logprobs if first_output else None,
        )

    def _fork(
        self, parent: Request, token_ids: list[int], logprobs: list | None
    ) -> list[EngineCoreOutput]:
        """Split a prefilled n > 1 prompt into n sequences sharing its blocks."""
        children = [parent.fork_child(i) for i in range(len(token_ids))]
        self.kv_cache_manager.fork(parent, children)
        if self.lora_slots is not None:
            self.lora_slots.fork(parent, children)
        parent.status = RequestStatus.FINISHED_FORKED
        del self.requests[parent.req_id]
        self.worker_view.forget(parent.req_id)
        self.children[parent.req_id] = [child.req_id for child in children]
        parent_key = self._queue_keys.pop(parent.req_id)
        for child in children:  # children keep their parent's place in the queues
            self._queue_keys[child.req_id] = parent_key
        pos = self.running.index(parent)
        self.running[pos : pos + 1] = children
        # NOTE: register every child before any can finish, or the first to finish would see
        # no live siblings and drop the parent -> children map (then an abort would miss them).
        for child in children:
            self.requests[child.req_id] = child
            child.status = RequestStatus.RUNNING
            child.prompt_logprobs = parent.prompt_logprobs  # computed by the parent's prefill
            if parent.grammar is not None:  # each choice advances its own copy
                child.grammar = parent.grammar.fork()
        return [
            self._append(child, [token_ids[i]], [logprobs[i]] if logprobs else None)
            for i, child in enumerate(children)
            if not child.is_finished  # a sibling's failure ends them all
        ]

    def _stop_status(self, req: Request) -> RequestStatus | None:
        params = req.sampling_params
        last = req.output_token_ids[-1]
        is_eos = last in self.eos_token_ids and not params.ignore_eos
        stopped = is_eos or last in params.stop_token_ids
        if stopped and req.num_output_tokens >= params.min_tokens:
            return RequestStatus.FINISHED_STOPPED
        if params.max_tokens is not None and req.num_output_tokens >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if req.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    # ---- bookkeeping ---------------------------------------------------------------------

    def _finish(self, req: Request, status: RequestStatus) -> None:
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        req.status = status
        if self.lora_slots is not None:
            self.lora_slots.release(req)
        if req.grammar is not None:
            req.grammar.cancel()  # a compile not started yet is dropped
            req.grammar = None
        self.kv_cache_manager.free(req)
        self.worker_view.forget(req.req_id)
        del self.requests[req.req_id]
        self._queue_keys.pop(req.req_id, None)
        parent_id = req.parent_req_id
        if parent_id is not None and all(
            child_id not in self.requests for child_id in self.children.get(parent_id, [])
        ):
            self.children.pop(parent_id, None)

    def _pick_victim(self) -> Request:
        # NOTE: running is kept in victim order (newest, or lowest priority, last), so the victim
        # is never a sequence already scheduled earlier in this step.
        return self.running[-1]

    def _add_running(self, req: Request) -> None:
        if self.config.scheduling_policy == "priority":
            bisect.insort(self.running, req, key=self._queue_key)
        else:
            self.running.append(req)

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.kv_cache_manager.free(req)
        self.worker_view.forget(req.req_id)
        if self.lora_slots is not None:
            self.lora_slots.release(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self._enqueue(req)

    def _enqueue(self, req: Request) -> None:
        bisect.insort(self.waiting, req, key=self._queue_key)

    def _queue_key(self, req: Request) -> tuple[int, float, int]:
        return self._queue_keys[req.req_id]

    def stats(self) -> dict[str, float]:
        return {
            **self.kv_cache_manager.stats(),
            "num_preemptions": self.num_preemptions,
            "num_computed_tokens_total": self.num_computed_tokens_total,
            "num_cow_copies": self.num_cow_copies,
            "num_running": len(self.running),
            "num_waiting": len(self.waiting),
            "peak_num_running": self.peak_num_running,
            "peak_kv_usage": self.peak_kv_usage,
            **(self.lora_slots.stats() if self.lora_slots is not None else {}),
        }


def _grammar_error(req: Request) -> str | None:
    """Why a compiled grammar refuses `req` at admission: it failed to compile, or a resumed
    output (replayed here, once, so the grammar's state is where those tokens left it) does not
    match it."""
    if req.grammar is None:
        return None
    if req.grammar.error is not None:
        return req.grammar.error
    if req.unreplayed_token_ids:
        replayed, req.unreplayed_token_ids = req.unreplayed_token_ids, []
        if not req.grammar.accept(replayed):
            return "the resumed output does not match its structured_outputs"
    return None


def _prompt_hit(req: Request) -> int:
    """Prompt tokens the prefix cache served (of a resumed request, whose hit may cover its
    resumed output too, only the prompt's)."""
    return min(max(req.num_cached_tokens, 0), req.num_prompt_tokens)
