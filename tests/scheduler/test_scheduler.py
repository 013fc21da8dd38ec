"""Scheduler: continuous batching, chunked prefill, prefix hits, forks, preemption and stops.

A stand-in executor (`StandInWorker`) rebuilds the workers' state from the messages alone and
emulates the KV cache's contents, so every step also checks that no sequence reads KV that is not
its own: prefix caching, copy-on-write and preemption must never corrupt what attention reads.
"""

from __future__ import annotations

import dataclasses
import pickle
from collections.abc import Sequence
from dataclasses import dataclass

import pytest

from pagedray.scheduler.config import SchedulerConfig
from pagedray.scheduler.messages import (
    CachedRequestData,
    GrammarBitmask,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from pagedray.scheduler.outputs import EngineCoreOutput
from pagedray.scheduler.request import EngineRequest, Request, RequestStatus
from pagedray.scheduler.request_failure import FailureKind, RequestFailure
from pagedray.scheduler.sampling_params import SamplingParams
from pagedray.scheduler.scheduler import Scheduler

VOCAB = 13  # the stand-in model's vocabulary: token ids 0..12


def next_token_ids(token_ids: Sequence[int], num_samples: int = 1) -> list[int]:
    """The stand-in model: deterministic in the whole sequence so far; n samples are distinct."""
    base = hash(tuple(token_ids)) % VOCAB  # ints hash the same in every process
    return [(base + i) % VOCAB for i in range(num_samples)]


def reference_outputs(
    prompt: Sequence[int],
    params: SamplingParams,
    max_model_len: int,
    eos_token_ids: Sequence[int] = (),
) -> list[tuple[list[int], str]]:
    """Each of the n choices' output tokens and finish reason, generated one token at a time."""
    results = []
    for first in next_token_ids(prompt, params.n):
        token_ids, output, token = list(prompt), [], first
        while True:
            token_ids.append(token)
            output.append(token)
            stops = (token in eos_token_ids and not params.ignore_eos) or (
                token in params.stop_token_ids
            )
            if len(output) >= params.min_tokens and stops:
                reason = "stop"
                break
            if params.max_tokens is not None and len(output) >= params.max_tokens:
                reason = "length"
                break
            if len(token_ids) >= max_model_len:
                reason = "length"
                break
            (token,) = next_token_ids(token_ids)
        results.append((output, reason))
    return results


@dataclass
class SeqState:
    """What the stand-in worker knows of one sequence, built only from the messages."""

    token_ids: list[int]
    block_ids: list[int]  # the block table
    num_computed_tokens: int
    num_prompt_tokens: int
    n: int  # samples at the first sample of an unforked prompt


class StandInWorker:
    """Executes plans the way the workers interpret them, on an emulated KV cache.

    `kv` maps a slot (block id * block_size + offset) to the token prefix whose KV was written
    there. Every position a scheduled sequence attends to must hold its own prefix.
    """

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.seqs: dict[str, SeqState] = {}
        self.kv: dict[int, tuple[int, ...]] = {}
        self.last_plan: SchedulerOutput | None = None
        self.num_calls = 0

    def execute_model(self, plan: SchedulerOutput) -> ModelRunnerOutput:
        self.last_plan = plan
        self.num_calls += 1
        self._update_states(plan)
        self._copy_blocks(plan.blocks_to_copy)
        req_ids, sampled = self._forward(plan)
        return ModelRunnerOutput(plan.step_id, req_ids, sampled, [None] * len(req_ids))

    def _update_states(self, plan: SchedulerOutput) -> None:
        assert len(set(plan.finished_req_ids)) == len(plan.finished_req_ids), plan.finished_req_ids
        for req_id in plan.finished_req_ids:
            assert req_id in self.seqs, f"drop of {req_id!r}, which the workers never got"
            del self.seqs[req_id]
        for new in plan.scheduled_new_reqs:
            assert new.req_id not in self.seqs, f"{new.req_id!r} sent in full twice"
            self.seqs[new.req_id] = SeqState(
                token_ids=new.prompt_token_ids + new.output_token_ids,
                block_ids=list(new.block_ids),
                num_computed_tokens=new.num_computed_tokens,
                num_prompt_tokens=len(new.prompt_token_ids),
                n=new.sampling_params.n,
            )
        cached = plan.scheduled_cached_reqs
        num_cached = len(cached.req_ids)
        assert len(cached.new_token_ids) == len(cached.new_block_ids) == num_cached
        assert len(cached.num_computed_tokens) == num_cached
        for req_id, token_ids, block_ids, num_computed in zip(
            cached.req_ids, cached.new_token_ids, cached.new_block_ids, cached.num_computed_tokens
        ):
            seq = self.seqs[req_id]
            assert num_computed == seq.num_computed_tokens, f"{req_id}: computed count diverged"
            seq.token_ids.extend(token_ids)
            seq.block_ids.extend(block_ids)
        sent = [new.req_id for new in plan.scheduled_new_reqs] + cached.req_ids
        assert sorted(sent) == sorted(plan.num_scheduled_tokens), "plan lists differ"
        assert plan.total_num_scheduled_tokens == sum(plan.num_scheduled_tokens.values())

    def _copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        srcs = [src for src, _ in copies]
        dsts = [dst for _, dst in copies]
        # The copy kernel runs all pairs at once: a dst must be neither repeated nor a src.
        assert len(set(dsts)) == len(dsts) and not set(srcs) & set(dsts), copies
        for src, dst in copies:
            for offset in range(self.block_size):
                src_slot, dst_slot = src * self.block_size + offset, dst * self.block_size + offset
                if src_slot in self.kv:
                    self.kv[dst_slot] = self.kv[src_slot]
                else:
                    self.kv.pop(dst_slot, None)

    def _forward(self, plan: SchedulerOutput) -> tuple[list[str], list[list[int]]]:
        # Every sequence writes its new tokens' KV before any attention reads, as per layer.
        writer: dict[int, str] = {}
        for req_id, num_scheduled in plan.num_scheduled_tokens.items():
            seq = self.seqs[req_id]
            end = seq.num_computed_tokens + num_scheduled
            assert num_scheduled >= 1 and end <= len(seq.token_ids), (req_id, num_scheduled)
            for pos in range(seq.num_computed_tokens, end):
                slot = self._slot(seq, pos)
                assert slot not in writer, f"{req_id} and {writer[slot]} both write slot {slot}"
                writer[slot] = req_id
                self.kv[slot] = tuple(seq.token_ids[: pos + 1])
        req_ids, sampled = [], []
        for req_id, num_scheduled in plan.num_scheduled_tokens.items():
            seq = self.seqs[req_id]
            seq.num_computed_tokens += num_scheduled
            for pos in range(seq.num_computed_tokens):
                slot = self._slot(seq, pos)
                assert self.kv.get(slot) == tuple(seq.token_ids[: pos + 1]), (
                    f"{req_id} reads foreign KV at position {pos} (slot {slot})"
                )
            if seq.num_computed_tokens >= len(seq.token_ids):
                unforked = seq.n > 1 and len(seq.token_ids) == seq.num_prompt_tokens
                req_ids.append(req_id)
                sampled.append(next_token_ids(seq.token_ids, seq.n if unforked else 1))
        return req_ids, sampled

    def _slot(self, seq: SeqState, pos: int) -> int:
        assert pos // self.block_size < len(seq.block_ids), f"position {pos} beyond the table"
        return seq.block_ids[pos // self.block_size] * self.block_size + pos % self.block_size


# ---- helpers --------------------------------------------------------------------------------


def make_scheduler(
    num_blocks: int = 16, block_size: int = 4, eos_token_ids: Sequence[int] = (), **config
) -> Scheduler:
    config.setdefault("max_model_len", 256)
    return Scheduler(SchedulerConfig(block_size=block_size, **config), num_blocks, eos_token_ids)


def make_request(
    req_id: str,
    prompt: list[int],
    priority: int = 0,
    cache_salt: str | None = None,
    arrival_time: float = 1.0,
    **params,
) -> Request:
    params.setdefault("max_tokens", 4)
    engine_request = EngineRequest(
        req_id, prompt, SamplingParams(**params), arrival_time, priority, cache_salt
    )
    return Request(engine_request)


def step(
    scheduler: Scheduler, worker: StandInWorker, results: dict | None = None
) -> tuple[SchedulerOutput, list[EngineCoreOutput]]:
    """One schedule -> execute -> update round; outputs are also collected into `results`."""
    plan = scheduler.schedule()
    outputs = scheduler.update_from_output(plan, worker.execute_model(plan))
    scheduler.kv_cache_manager.check_invariants()
    if results is not None:
        collect(results, outputs)
    return plan, outputs


def run_all(
    scheduler: Scheduler, worker: StandInWorker, results: dict | None = None, max_steps: int = 200
) -> dict[tuple[str, int], tuple[list[int], str | None]]:
    """Step until every request finished; (req_id, choice) -> (output tokens, finish reason).

    Outputs are added to `results` when given (those of steps the caller ran itself).
    """
    results = {} if results is None else results
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            break
        step(scheduler, worker, results)
    assert not scheduler.has_unfinished_requests()
    return results


def collect(
    results: dict[tuple[str, int], tuple[list[int], str | None]], outputs: list[EngineCoreOutput]
) -> None:
    for out in outputs:
        tokens, reason = results.get((out.req_id, out.choice_index), ([], None))
        assert reason is None, f"{out.req_id}#{out.choice_index}: output after finishing"
        results[(out.req_id, out.choice_index)] = (tokens + out.new_token_ids, out.finish_reason)


def expected(scheduler: Scheduler, req_id: str, prompt: list[int], **params):
    params.setdefault("max_tokens", 4)
    choices = reference_outputs(
        prompt, SamplingParams(**params), scheduler.max_model_len, sorted(scheduler.eos_token_ids)
    )
    return {(req_id, i): choice for i, choice in enumerate(choices)}


def ref_cnt(scheduler: Scheduler, block_id: int) -> int:
    return scheduler.kv_cache_manager.block_pool.blocks[block_id].ref_cnt


def new_ids(plan: SchedulerOutput) -> list[str]:
    return [new.req_id for new in plan.scheduled_new_reqs]


def assert_all_free(scheduler: Scheduler) -> None:
    kv = scheduler.kv_cache_manager
    kv.check_invariants()
    assert kv.num_free_blocks == kv.num_blocks
    assert not kv.req_to_blocks and not scheduler.requests and not scheduler.children
    assert not scheduler._queue_keys and not scheduler.worker_view.num_tokens_sent  # nothing leaks


# ---- continuous batching --------------------------------------------------------------------


def test_admits_until_max_num_seqs() -> None:
    scheduler, worker = make_scheduler(max_num_seqs=2), StandInWorker(4)
    for req_id in "abc":
        scheduler.add_request(make_request(req_id, [1, 2, 3, ord(req_id)], max_tokens=1))
    plan, outputs = step(scheduler, worker)
    assert new_ids(plan) == ["a", "b"]
    assert plan.num_scheduled_tokens == {"a": 4, "b": 4}
    assert [new.block_ids for new in plan.scheduled_new_reqs] == [[0], [1]]
    assert [out.finish_reason for out in outputs] == ["length", "length"]
    assert [req.req_id for req in scheduler.waiting] == ["c"]
    plan, _ = step(scheduler, worker)
    assert new_ids(plan) == ["c"] and plan.finished_req_ids == ["a", "b"]
    assert scheduler.stats()["peak_num_running"] == 2


def test_unforked_parallel_prompt_counts_as_n_seqs() -> None:
    scheduler, worker = make_scheduler(max_num_seqs=3), StandInWorker(4)
    scheduler.add_request(make_request("p", [1, 2, 3, 4, 5], n=3, max_tokens=2))
    scheduler.add_request(make_request("q", [6, 7], max_tokens=2))
    plan, _ = step(scheduler, worker)
    assert new_ids(plan) == ["p"]  # p becomes 3 sequences: no room for q
    assert len(scheduler.running) == 3
    run_all(scheduler, worker)
    assert scheduler.stats()["peak_num_running"] == 3
    assert_all_free(scheduler)


def test_admits_until_max_num_batched_tokens_then_chunks() -> None:
    scheduler, worker = make_scheduler(max_num_batched_tokens=10), StandInWorker(4)
    prompts = {req_id: [1, 2, 3, ord(req_id)] for req_id in "abc"}
    for req_id, prompt in prompts.items():
        scheduler.add_request(make_request(req_id, prompt, max_tokens=3))
    results: dict = {}
    plan, outputs = step(scheduler, worker, results)
    assert plan.num_scheduled_tokens == {"a": 4, "b": 4, "c": 2}  # c: a first chunk
    assert plan.total_num_scheduled_tokens == 10
    assert [out.req_id for out in outputs] == ["a", "b"]  # c has not reached its last token
    plan, outputs = step(scheduler, worker, results)
    assert plan.num_scheduled_tokens == {"a": 1, "b": 1, "c": 2}
    assert plan.scheduled_cached_reqs.req_ids == ["a", "b", "c"]
    assert plan.scheduled_cached_reqs.num_computed_tokens == [4, 4, 2]
    assert [out.req_id for out in outputs] == ["a", "b", "c"]
    run_all(scheduler, worker, results)
    for req_id, prompt in prompts.items():
        assert (
            results[(req_id, 0)] == expected(scheduler, req_id, prompt, max_tokens=3)[(req_id, 0)]
        )
    assert_all_free(scheduler)


def test_chunked_prefill_runs_alongside_decodes() -> None:
    scheduler, worker = make_scheduler(max_num_batched_tokens=8), StandInWorker(4)
    scheduler.add_request(make_request("a", [9, 8, 7, 6], max_tokens=8))
    long_prompt = list(range(20))
    scheduler.add_request(make_request("long", long_prompt, max_tokens=2))
    results: dict = {}
    plan, outputs = step(scheduler, worker, results)
    assert plan.num_scheduled_tokens == {"a": 4, "long": 4}
    assert [new.block_ids for new in plan.scheduled_new_reqs] == [[0], [1]]
    assert [out.req_id for out in outputs] == ["a"]
    computed, new_blocks = [], []
    for chunk in (7, 7, 2):
        plan, outputs = step(scheduler, worker, results)
        assert plan.num_scheduled_tokens == {"a": 1, "long": chunk}
        assert not plan.scheduled_new_reqs  # sent in full once, then diffs only
        cached = plan.scheduled_cached_reqs
        computed.append(cached.num_computed_tokens[1])
        new_blocks.append(cached.new_block_ids)
        assert [out.req_id for out in outputs] == (["a", "long"] if chunk == 2 else ["a"])
    assert computed == [4, 11, 18]
    # a grows one block when its decode crosses position 4; long grows with each chunk.
    assert new_blocks == [[[2], [3, 4]], [[], [5, 6]], [[], []]]
    assert scheduler.kv_cache_manager.get_block_ids("long") == [1, 3, 4, 5, 6]
    run_all(scheduler, worker, results)
    assert results == {
        **expected(scheduler, "a", [9, 8, 7, 6], max_tokens=8),
        **expected(scheduler, "long", long_prompt, max_tokens=2),
    }


# ---- prefix caching -------------------------------------------------------------------------


def test_prefix_computed_in_this_step_is_read_by_a_request_admitted_after_it() -> None:
    """Two requests that arrive together compute their shared prefix once, in the same step
    (every layer stores the step's K/V before attention reads it, as the stand-in checks)."""
    scheduler, worker = make_scheduler(), StandInWorker(4)
    prompt_a, prompt_b = list(range(10)), list(range(8)) + [11, 12, 11]
    scheduler.add_request(make_request("a", prompt_a, max_tokens=3))
    scheduler.add_request(make_request("b", prompt_b, max_tokens=3))
    results: dict = {}
    plan, _ = step(scheduler, worker, results)
    new_a, new_b = plan.scheduled_new_reqs
    assert (new_a.num_computed_tokens, new_b.num_computed_tokens) == (0, 8)
    assert new_b.block_ids[:2] == new_a.block_ids[:2]
    assert plan.num_scheduled_tokens == {"a": 10, "b": 3}
    assert scheduler.stats()["prefix_cache_hits"] == 8
    run_all(scheduler, worker, results)
    assert results == {
        **expected(scheduler, "a", prompt_a, max_tokens=3),
        **expected(scheduler, "b", prompt_b, max_tokens=3),
    }


def test_a_running_chunk_shares_the_blocks_its_step_fills() -> None:
    """`a`'s prefill runs in two chunks; `b`, admitted beside the second, reads both blocks that
    chunk fills rather than only the one the first chunk left in the cache."""
    scheduler, worker = make_scheduler(max_num_batched_tokens=7), StandInWorker(4)
    prompt_a, prompt_b = list(range(10)), list(range(8)) + [12]
    scheduler.add_request(make_request("a", prompt_a, max_tokens=2))
    results: dict = {}
    plan, _ = step(scheduler, worker, results)
    assert plan.num_scheduled_tokens == {"a": 7}
    scheduler.add_request(make_request("b", prompt_b, max_tokens=2))
    plan, _ = step(scheduler, worker, results)
    assert plan.num_scheduled_tokens == {"a": 3, "b": 1}
    assert plan.scheduled_new_reqs[0].num_computed_tokens == 8
    run_all(scheduler, worker, results)
    assert results == {
        **expected(scheduler, "a", prompt_a, max_tokens=2),
        **expected(scheduler, "b", prompt_b, max_tokens=2),
    }


def test_shared_prefix_is_admitted_as_computed() -> None:
    scheduler, worker = make_scheduler(), StandInWorker(4)
    prompt_a = list(range(10))
    scheduler.add_request(make_request("a", prompt_a, max_tokens=1))
    run_all(scheduler, worker)
    assert scheduler.stats()["prefix_cache_hits"] == 0
    prompt_b = list(range(8)) + [11, 12, 11]
    scheduler.add_request(make_request("b", prompt_b, max_tokens=3))
    results: dict = {}
    plan, _ = step(scheduler, worker, results)
    (new,) = plan.scheduled_new_reqs
    assert new.num_computed_tokens == 8
    assert new.block_ids == [0, 1, 3]  # a's first two blocks, then the free-queue head
    assert plan.num_scheduled_tokens == {"b": 3}
    stats = scheduler.stats()
    assert stats["prefix_cache_hits"] == 8
    assert stats["prefix_cache_queries"] == 10 + 11
    run_all(scheduler, worker, results)
    assert results == expected(scheduler, "b", prompt_b, max_tokens=3)
    assert scheduler.requests == {}


def test_different_cache_salt_gets_no_hit() -> None:
    scheduler, worker = make_scheduler(), StandInWorker(4)
    prompt = list(range(10))
    scheduler.add_request(make_request("a", prompt, cache_salt="tenant-1", max_tokens=1))
    run_all(scheduler, worker)
    scheduler.add_request(make_request("b", prompt, cache_salt="tenant-2", max_tokens=1))
    plan, _ = step(scheduler, worker)
    assert plan.scheduled_new_reqs[0].num_computed_tokens == 0
    assert plan.num_scheduled_tokens == {"b": 10}
    assert scheduler.stats()["prefix_cache_hits"] == 0
    scheduler.add_request(make_request("c", prompt, cache_salt="tenant-1", max_tokens=1))
    plan, _ = step(scheduler, worker)
    assert plan.scheduled_new_reqs[0].num_computed_tokens == 8  # same tenant: a hit
    assert scheduler.stats()["prefix_cache_hits"] == 8


# ---- copy-on-write parallel sampling --------------------------------------------------------


def test_parallel_sampling_forks_and_copies_the_shared_tail() -> None:
    scheduler, worker = make_scheduler(num_blocks=16, block_size=16), StandInWorker(16)
    prompt = list(range(20))
    scheduler.add_request(make_request("r", prompt, n=4, max_tokens=3))
    results: dict = {}
    plan, outputs = step(scheduler, worker, results)
    assert plan.scheduled_new_reqs[0].block_ids == [0, 1]
    assert [(out.req_id, out.choice_index) for out in outputs] == [("r", i) for i in range(4)]
    assert len({out.new_token_ids[0] for out in outputs}) == 4
    assert ref_cnt(scheduler, 0) == 4 and ref_cnt(scheduler, 1) == 4
    assert [req.req_id for req in scheduler.running] == ["r#0", "r#1", "r#2", "r#3"]

    plan, _ = step(scheduler, worker, results)
    assert plan.blocks_to_copy == [(1, 2), (1, 3), (1, 4)]  # the last child keeps block 1
    assert new_ids(plan) == ["r#0", "r#1", "r#2", "r#3"]
    assert [new.block_ids for new in plan.scheduled_new_reqs] == [[0, 2], [0, 3], [0, 4], [0, 1]]
    assert all(new.num_computed_tokens == 20 for new in plan.scheduled_new_reqs)
    assert plan.finished_req_ids == ["r"]
    assert ref_cnt(scheduler, 0) == 4 and ref_cnt(scheduler, 1) == 1
    run_all(scheduler, worker, results)
    assert results == expected(scheduler, "r", prompt, n=4, max_tokens=3)
    assert_all_free(scheduler)


def test_parallel_sampling_that_finishes_at_the_fork_frees_everything() -> None:
    scheduler, worker = make_scheduler(), StandInWorker(4)
    scheduler.add_request(make_request("r", [1, 2, 3, 4, 5], n=3, max_tokens=1))
    _, outputs = step(scheduler, worker)
    assert [out.finish_reason for out in outputs] == ["length"] * 3
    assert_all_free(scheduler)
    plan = scheduler.schedule()
    assert plan.finished_req_ids == ["r"]  # the children never reached the workers
    worker.execute_model(plan)
    assert worker.seqs == {}


# ---- preemption and priority ----------------------------------------------------------------


def test_preempts_newest_when_blocks_run_out_and_recomputes_it() -> None:
    scheduler, worker = make_scheduler(num_blocks=4), StandInWorker(4)
    prompts = {"a": [1, 2, 3, 4, 5, 6], "b": [6, 5, 4, 3, 2, 1]}
    for req_id, prompt in prompts.items():
        scheduler.add_request(make_request(req_id, prompt, max_tokens=6))
    results: dict = {}
    for _ in range(3):
        plan, _ = step(scheduler, worker, results)
        assert set(plan.num_scheduled_tokens) == {"a", "b"}
    assert scheduler.kv_cache_manager.get_block_ids("b") == [2, 3]
    plan, _ = step(scheduler, worker, results)  # a needs a third block: b goes
    assert plan.num_scheduled_tokens == {"a": 1}
    assert plan.finished_req_ids == ["b"]
    assert scheduler.num_preemptions == 1 and scheduler.stats()["num_preemptions"] == 1
    (b,) = scheduler.waiting
    assert b.status is RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert scheduler.kv_cache_manager.get_block_ids("b") == []
    assert scheduler.kv_cache_manager.get_block_ids("a") == [0, 1, 3]
    assert ref_cnt(scheduler, 2) == 0  # b's blocks went back to the pool
    readmitted = None
    while scheduler.has_unfinished_requests():
        plan, _ = step(scheduler, worker, results)
        readmitted = readmitted or next(
            (new for new in plan.scheduled_new_reqs if new.req_id == "b"), None
        )
    assert readmitted is not None
    assert readmitted.num_computed_tokens == 4  # b's first block was still cached
    # The readmission's lookup (6 prompt + 3 output tokens, its own block found) is counted
    # apart from the first admissions', which found nothing.
    stats = scheduler.stats()
    assert (stats["prefix_cache_queries"], stats["prefix_cache_hits"]) == (12, 0)
    assert (stats["preempted_prefix_cache_queries"], stats["preempted_prefix_cache_hits"]) == (9, 4)
    assert len(readmitted.output_token_ids) == 3
    for req_id, prompt in prompts.items():
        assert (
            results[(req_id, 0)] == expected(scheduler, req_id, prompt, max_tokens=6)[(req_id, 0)]
        )
    assert results[("b", 0)][1] == "length" and len(results[("b", 0)][0]) == 6
    assert_all_free(scheduler)


@pytest.mark.parametrize(("policy", "victim"), [("fcfs", "c"), ("priority", "b")])
def test_preemption_victim_by_policy(policy: str, victim: str) -> None:
    scheduler, worker = make_scheduler(num_blocks=5, scheduling_policy=policy), StandInWorker(4)
    scheduler.add_request(make_request("a", [1, 1, 1, 1], priority=0, arrival_time=1.0))
    scheduler.add_request(make_request("b", [2, 2, 2, 2, 2, 2], priority=5, arrival_time=2.0))
    scheduler.add_request(make_request("c", [3, 3, 3, 3], priority=1, arrival_time=3.0))
    plan, _ = step(scheduler, worker)
    want_order = ["a", "b", "c"] if policy == "fcfs" else ["a", "c", "b"]
    assert new_ids(plan) == want_order
    plan, _ = step(scheduler, worker)
    assert plan.finished_req_ids == [victim]
    assert set(plan.num_scheduled_tokens) == {"a", "b", "c"} - {victim}
    assert [req.req_id for req in scheduler.waiting] == [victim]
    results = run_all(scheduler, worker)
    assert all(reason == "length" for _, reason in results.values())
    assert_all_free(scheduler)


def test_priority_policy_admits_lower_value_first() -> None:
    scheduler, worker = (
        make_scheduler(max_num_seqs=1, scheduling_policy="priority"),
        StandInWorker(4),
    )
    scheduler.add_request(make_request("low", [1, 2], priority=5, arrival_time=1.0, max_tokens=1))
    scheduler.add_request(make_request("high", [3, 4], priority=0, arrival_time=2.0, max_tokens=1))
    scheduler.add_request(make_request("mid", [5, 6], priority=2, arrival_time=3.0, max_tokens=1))
    admitted = [new_ids(step(scheduler, worker)[0]) for _ in range(3)]
    assert admitted == [["high"], ["mid"], ["low"]]


def test_urgent_request_preempts_a_full_batch_of_worse_priority() -> None:
    """Priority policy, every seat taken: a better-priority arrival preempts the newest of the
    worst-priority sequences and runs at once; every output is what it would have been."""
    scheduler, worker = (
        make_scheduler(max_num_seqs=2, scheduling_policy="priority"),
        StandInWorker(4),
    )
    long_prompts = {"long0": [1, 2, 3], "long1": [4, 5, 6]}
    for i, (req_id, prompt) in enumerate(long_prompts.items()):
        scheduler.add_request(make_request(req_id, prompt, arrival_time=1.0 + i, max_tokens=12))
    results: dict = {}
    for _ in range(3):
        step(scheduler, worker, results)
    scheduler.add_request(make_request("urgent", [7, 8], priority=-1, arrival_time=5.0))
    plan, _ = step(scheduler, worker, results)
    assert new_ids(plan) == ["urgent"] and plan.finished_req_ids == ["long1"]
    assert [req.req_id for req in scheduler.waiting] == ["long1"]
    assert scheduler.num_preemptions == 1
    run_all(scheduler, worker, results)
    assert results[("urgent", 0)] == expected(scheduler, "urgent", [7, 8])[("urgent", 0)]
    for req_id, prompt in long_prompts.items():
        want = expected(scheduler, req_id, prompt, max_tokens=12)[(req_id, 0)]
        assert results[(req_id, 0)] == want
    assert_all_free(scheduler)


def test_equal_priority_never_preempts_for_seats() -> None:
    scheduler, worker = (
        make_scheduler(max_num_seqs=1, scheduling_policy="priority"),
        StandInWorker(4),
    )
    scheduler.add_request(make_request("first", [1, 2], arrival_time=1.0, max_tokens=6))
    step(scheduler, worker)
    scheduler.add_request(make_request("second", [3, 4], arrival_time=2.0))
    plan, _ = step(scheduler, worker)
    assert set(plan.num_scheduled_tokens) == {"first"} and scheduler.num_preemptions == 0


def test_fcfs_ignores_priority() -> None:
    scheduler, worker = make_scheduler(max_num_seqs=1), StandInWorker(4)
    scheduler.add_request(make_request("first", [1, 2], priority=5, arrival_time=1.0))
    scheduler.add_request(make_request("second", [3, 4], priority=0, arrival_time=2.0))
    assert new_ids(step(scheduler, worker)[0]) == ["first"]


# ---- finishing ------------------------------------------------------------------------------


def test_abort_frees_blocks_at_once_and_tells_the_workers() -> None:
    scheduler, worker = make_scheduler(), StandInWorker(4)
    scheduler.add_request(make_request("a", list(range(6)), max_tokens=8))
    scheduler.add_request(make_request("b", list(range(3)), max_tokens=8))
    step(scheduler, worker)
    scheduler.add_request(make_request("waiting", [7], max_tokens=8))
    scheduler.finish_requests(["a", "waiting"], RequestStatus.FINISHED_ABORTED)
    assert scheduler.kv_cache_manager.get_block_ids("a") == []
    assert scheduler.kv_cache_manager.num_free_blocks == 16 - 1  # b keeps its one block
    assert "a" not in scheduler.requests and not scheduler.waiting
    plan, outputs = step(scheduler, worker)
    assert plan.finished_req_ids == ["a"]  # "waiting" never reached the workers
    assert set(plan.num_scheduled_tokens) == {"b"}
    assert all(out.req_id == "b" for out in outputs)
    assert "a" not in worker.seqs
    scheduler.finish_requests(["a", "unknown"], RequestStatus.FINISHED_ABORTED)  # no-op


def test_abort_of_a_forked_request_ends_every_child() -> None:
    scheduler, worker = make_scheduler(), StandInWorker(4)
    scheduler.add_request(make_request("r", [1, 2, 3, 4, 5, 6], n=3, max_tokens=8))
    step(scheduler, worker)
    step(scheduler, worker)
    scheduler.finish_requests(["r"], RequestStatus.FINISHED_ABORTED)
    assert_all_free(scheduler)
    plan = scheduler.schedule()
    assert sorted(plan.finished_req_ids) == ["r#0", "r#1", "r#2"]
    worker.execute_model(plan)
    assert worker.seqs == {}


def test_abort_after_a_child_finished_at_the_fork() -> None:
    scheduler = make_scheduler(eos_token_ids=[2])
    scheduler.add_request(make_request("r", [1, 1, 1, 1, 1], n=3, max_tokens=8))
    plan = scheduler.schedule()
    runner_output = ModelRunnerOutput(plan.step_id, ["r"], [[2, 5, 6]], [None])
    outputs = scheduler.update_from_output(plan, runner_output)
    assert [out.finish_reason for out in outputs] == ["stop", None, None]
    assert scheduler.children == {"r": ["r#0", "r#1", "r#2"]}
    scheduler.finish_requests(["r"], RequestStatus.FINISHED_ABORTED)
    assert not scheduler.has_unfinished_requests()
    assert_all_free(scheduler)


def test_a_failed_sequence_ends_its_request_alone() -> None:
    """A request whose sampling failed on the workers ends with "error", every choice of it,
    its blocks freed; its neighbours keep running and finish as they would have."""
    scheduler, worker = make_scheduler(), StandInWorker(4)
    for req_id, n in (("ok", 1), ("bad", 2), ("other", 1)):
        scheduler.add_request(make_request(req_id, [1, 2, 3, 4, 5], n=n, max_tokens=6))
    results: dict = {}
    step(scheduler, worker, results)  # prefill: "bad" forks into two children
    step(scheduler, worker, results)
    plan = scheduler.schedule()
    runner_output = worker.execute_model(plan)
    failed = runner_output.req_ids.index("bad#1")
    del runner_output.req_ids[failed], runner_output.sampled_token_ids[failed]
    del runner_output.logprobs[failed]
    failure = RequestFailure(FailureKind.INVALID, "non-finite")
    runner_output.failed = {"bad#1": failure}
    outputs = scheduler.update_from_output(plan, runner_output)
    collect(results, outputs)
    errors = [out for out in outputs if out.finish_reason == "error"]
    assert [(out.req_id, out.error) for out in errors] == [("bad", failure)]
    assert "bad#0" not in scheduler.requests and "bad" not in scheduler.children
    run_all(scheduler, worker, results)
    for req_id in ("ok", "other"):
        assert (
            results[(req_id, 0)]
            == expected(scheduler, req_id, [1, 2, 3, 4, 5], max_tokens=6)[(req_id, 0)]
        )
    assert_all_free(scheduler)


def decode(scheduler: Scheduler, token_ids: list[int]) -> list[EngineCoreOutput]:
    """Run one single-request scheduler over a script of sampled tokens, until it finishes."""
    outputs = []
    for token in token_ids:
        plan = scheduler.schedule()
        (req_id,) = plan.num_scheduled_tokens
        runner_output = ModelRunnerOutput(plan.step_id, [req_id], [[token]], [None])
        outputs += scheduler.update_from_output(plan, runner_output)
        if outputs[-1].finish_reason is not None:
            break
    return outputs


@pytest.mark.parametrize(
    ("params", "script", "num_tokens", "reason"),
    [
        ({}, [5, 2, 5], 2, "stop"),  # eos
        ({"ignore_eos": True, "max_tokens": 3}, [2, 2, 2, 2], 3, "length"),
        ({"min_tokens": 2}, [2, 2, 5], 2, "stop"),  # the first eos comes too early
        ({"min_tokens": 3}, [2, 2, 2, 5], 3, "stop"),
        ({"stop_token_ids": [7]}, [5, 7, 5], 2, "stop"),
        ({"stop_token_ids": [7], "min_tokens": 2}, [7, 7], 2, "stop"),
        ({"max_tokens": 2}, [5, 5, 5], 2, "length"),
        ({"max_tokens": None}, [5] * 10, 4, "length"),  # max_model_len = 8, prompt 4
    ],
)
def test_stop_conditions(params: dict, script: list[int], num_tokens: int, reason: str) -> None:
    scheduler = make_scheduler(eos_token_ids=[2], max_model_len=8)
    params.setdefault("max_tokens", 16)
    scheduler.add_request(make_request("a", [1, 1, 1, 1], **params))
    outputs = decode(scheduler, script)
    assert [token for out in outputs for token in out.new_token_ids] == script[:num_tokens]
    assert [out.finish_reason for out in outputs] == [None] * (num_tokens - 1) + [reason]
    assert_all_free(scheduler)


def test_max_model_len_is_capped_by_the_pool_and_checked_on_add() -> None:
    scheduler = make_scheduler(num_blocks=2, block_size=4, max_model_len=100)
    assert scheduler.max_model_len == 8
    with pytest.raises(ValueError, match="max_model_len=8"):
        scheduler.add_request(make_request("a", list(range(9))))
    scheduler.add_request(make_request("b", list(range(6)), max_tokens=None))
    outputs = decode(scheduler, [3, 3, 3])
    assert [out.finish_reason for out in outputs] == [None, "length"]
    with pytest.raises(ValueError, match="already in use"):
        scheduler.add_request(make_request("c", [1]))
        scheduler.add_request(make_request("c", [1]))


def test_full_pool_runs_every_request_together() -> None:
    scheduler, worker = make_scheduler(num_blocks=64, block_size=16), StandInWorker(16)
    prompts = {f"r{i}": [i] + [i % 7] * 16 for i in range(32)}
    for req_id, prompt in prompts.items():
        scheduler.add_request(make_request(req_id, prompt, max_tokens=16))
    results: dict = {}
    plan, _ = step(scheduler, worker, results)
    assert len(plan.scheduled_new_reqs) == 32 and plan.total_num_scheduled_tokens == 32 * 17
    run_all(scheduler, worker, results)
    stats = scheduler.stats()
    assert stats["peak_num_running"] == 32
    assert stats["num_preemptions"] == 0
    assert stats["peak_kv_usage"] == 1.0  # 2 blocks per sequence: the pool exactly
    for req_id, prompt in prompts.items():
        assert (
            results[(req_id, 0)] == expected(scheduler, req_id, prompt, max_tokens=16)[(req_id, 0)]
        )
        assert len(results[(req_id, 0)][0]) == 16
    assert_all_free(scheduler)


# ---- messages -------------------------------------------------------------------------------


def test_messages_pickle_round_trip() -> None:
    scheduler, worker = make_scheduler(), StandInWorker(4)
    scheduler.add_request(make_request("r", list(range(6)), n=2, max_tokens=4, seed=7))
    first = scheduler.schedule()
    runner_output = worker.execute_model(first)
    scheduler.update_from_output(first, runner_output)
    second = scheduler.schedule()
    cached = CachedRequestData(["x"], [[1, 2]], [[3]], [5])
    engine_request = EngineRequest(
        "e", [1, 2, 3], SamplingParams(n=2, stop=["x"]), 2.5, priority=3, cache_salt="s"
    )
    logprobs_output = ModelRunnerOutput(4, ["x"], [[1]], [[([1, 2], [-0.1, -2.5], 1)]])
    constrained = EngineRequest(
        "c", [1, 2], SamplingParams(structured_outputs={"json": {"type": "object"}})
    )
    with_bitmask = dataclasses.replace(
        second, grammar_bitmask=GrammarBitmask(["x"], 1, b"\x01\x00\x00\x80")
    )
    messages = [
        first,
        with_bitmask,
        constrained,
        second,
        first.scheduled_new_reqs[0],
        second.scheduled_new_reqs[0],
        cached,
        runner_output,
        logprobs_output,
        engine_request,
    ]
    kinds = {type(message) for message in messages}
    assert kinds == {
        SchedulerOutput,
        NewRequestData,
        CachedRequestData,
        ModelRunnerOutput,
        EngineRequest,
    }
    assert with_bitmask.grammar_bitmask is not None
    for message in messages:
        assert pickle.loads(pickle.dumps(message)) == message
    assert second.blocks_to_copy  # the copy ops survive too


START, END = 510, 511  # `<think>`, `</think>`


@pytest.mark.parametrize(
    ("prompt", "output", "left"),
    [
        ([1, 2], [], 3),  # nothing spent yet
        ([1, 2], [5, 6], 1),  # two thinking tokens
        ([1, 2], [START, 5], 2),  # a leading `<think>` is no thinking token
        ([1, 2], [5, START], 1),  # past the start it is text, and counts
        ([1, START, 7, 8], [], 1),  # the prompt's own thinking since its `<think>` is spent
        ([START, 7, END, 1], [5], 2),  # a closed thinking in the prompt spends nothing
        ([1, START, 7, 8, 9, 9], [5], 0),  # spent past the budget: the end is forced next
        ([1, 2], [5, END, 6], None),  # ended: nothing more to count
    ],
)
def test_a_thinking_budget_counts_as_vllm_s_does(
    prompt: list[int], output: list[int], left: int | None
) -> None:
    """`thinking_token_budget` 3 (vLLM's rule): the thinking tokens of the output and of the
    prompt since its last `<think>`, a leading `<think>` excepted; the same whether the output
    arrives as sampled or is resumed, and in a forked child."""
    params = SamplingParams(thinking_token_budget=3)
    tags: dict = {"thinking_end_token_id": END, "thinking_start_token_id": START}
    resumed = Request(EngineRequest("r", prompt, params, output_token_ids=output, **tags))
    sampled = Request(EngineRequest("s", prompt, params, **tags))
    child = sampled.fork_child(0)
    for token_id in output:
        sampled.append_output_token_ids([token_id])
        child.append_output_token_ids([token_id])
    assert resumed.thinking_left == sampled.thinking_left == child.thinking_left == left
