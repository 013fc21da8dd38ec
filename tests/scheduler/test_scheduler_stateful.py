"""Random add/step/abort sequences through EngineCore must keep the scheduler's invariants.

The stand-in executor rebuilds the workers' state from the plans alone and checks, every step,
that no sequence attends to KV that is not its own and that no slot is written twice. Every
request that is not aborted must finish with exactly the tokens a one-at-a-time run produces.
"""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from test_scheduler import StandInWorker, reference_outputs

from pagedray.scheduler.config import SchedulerConfig
from pagedray.scheduler.engine_core import EngineCore
from pagedray.scheduler.request import EngineRequest
from pagedray.scheduler.sampling_params import SamplingParams

SHARED_PREFIXES = ([1, 2, 3, 4, 5, 6, 7], [3, 3, 3, 3, 3], [])
EOS_TOKEN_IDS = (0,)
MAX_UNFINISHED = 6  # client requests in flight
MAX_TEARDOWN_STEPS = 1000


class SchedulerMachine(RuleBasedStateMachine):
    """An EngineCore over the stand-in executor, with a model of every request's outputs."""

    @initialize(
        # Small pools half the time, so preemption happens often.
        num_blocks=st.one_of(st.integers(min_value=8, max_value=12), st.integers(8, 32)),
        block_size=st.sampled_from([2, 3, 4]),
        max_model_len=st.integers(min_value=6, max_value=48),
        max_num_seqs=st.integers(min_value=3, max_value=8),
        max_num_batched_tokens=st.integers(min_value=3, max_value=24),
        enable_prefix_caching=st.booleans(),
        scheduling_policy=st.sampled_from(["fcfs", "priority"]),
    )
    def setup(
        self,
        num_blocks: int,
        block_size: int,
        max_model_len: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        enable_prefix_caching: bool,
        scheduling_policy: str,
    ) -> None:
        self.config = SchedulerConfig(
            max_model_len=max_model_len,
            block_size=block_size,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            enable_prefix_caching=enable_prefix_caching,
            scheduling_policy=scheduling_policy,  # type: ignore[arg-type]
        )
        self.worker = StandInWorker(block_size)
        self.engine = EngineCore(self.config, num_blocks, self.worker, EOS_TOKEN_IDS)
        self.scheduler = self.engine.scheduler
        self.kv = self.scheduler.kv_cache_manager
        self.requests: dict[str, EngineRequest] = {}
        # (req_id, choice) -> (output tokens so far, finish reason or None)
        self.outputs: dict[tuple[str, int], tuple[list[int], str | None]] = {}
        self.aborted: set[tuple[str, int]] = set()
        self.dropped: set[str] = set()  # sequence ids the workers must have forgotten
        self.next_id = 0

    # --- rules -------------------------------------------------------------------------------

    @precondition(lambda self: len(self._unfinished()) < MAX_UNFINISHED)
    @rule(
        prefix=st.sampled_from(SHARED_PREFIXES),
        suffix=st.lists(st.integers(min_value=1, max_value=12), max_size=12),
        cache_salt=st.sampled_from([None, None, "tenant"]),
        n=st.integers(min_value=1, max_value=3),
        max_tokens=st.integers(min_value=1, max_value=8),
        ignore_eos=st.booleans(),
        priority=st.integers(min_value=0, max_value=3),
    )
    def add_request(
        self,
        prefix: list[int],
        suffix: list[int],
        cache_salt: str | None,
        n: int,
        max_tokens: int,
        ignore_eos: bool,
        priority: int,
    ) -> None:
        prompt = (prefix + suffix) or [5]
        req_id = f"r{self.next_id}"
        self.next_id += 1
        params = SamplingParams(n=n, max_tokens=max_tokens, ignore_eos=ignore_eos)
        request = EngineRequest(req_id, prompt, params, float(self.next_id), priority, cache_salt)
        if len(prompt) > self.scheduler.max_model_len:
            try:
                self.engine.add_request(request)
            except ValueError:
                return
            raise AssertionError("a prompt longer than max_model_len was accepted")
        self.engine.add_request(request)
        self.requests[req_id] = request
        for choice in range(n):
            self.outputs[(req_id, choice)] = ([], None)

    @precondition(lambda self: self.engine.has_unfinished_requests())
    @rule(num_steps=st.integers(min_value=1, max_value=4))
    def step(self, num_steps: int) -> None:
        for _ in range(num_steps):
            self._step()

    @precondition(lambda self: self._unfinished())
    @rule(pick=st.integers(min_value=0), whole=st.booleans(), skip=st.integers(0, 2))
    def abort(self, pick: int, whole: bool, skip: int) -> None:
        """Abort a client request, or one sequence of a forked one (a third of the time)."""
        if skip:
            return
        req_id = sorted(self._unfinished())[pick % len(self._unfinished())]
        children = self.scheduler.children.get(req_id, [])
        target = req_id if whole or not children else children[pick % len(children)]
        seq_ids = children if target == req_id and children else [target]
        self.dropped |= {seq_id for seq_id in seq_ids if seq_id in self.worker.seqs}
        self.engine.abort_requests([target])
        for seq_id in seq_ids:
            assert seq_id not in self.scheduler.requests
            assert not self.kv.get_block_ids(seq_id), f"{seq_id} kept blocks after its abort"
        for (out_id, choice), (_, reason) in self.outputs.items():
            hit = target == req_id or target.endswith(f"#{choice}")
            if out_id == req_id and reason is None and hit:
                self.aborted.add((out_id, choice))

    # --- invariants --------------------------------------------------------------------------

    @invariant()
    def kv_cache_consistent(self) -> None:
        if not hasattr(self, "kv"):
            return
        self.kv.check_invariants()

    @invariant()
    def blocks_held_only_by_live_sequences(self) -> None:
        if not hasattr(self, "kv"):
            return
        running_ids = {req.req_id for req in self.scheduler.running}
        assert set(self.kv.req_to_blocks) == running_ids
        assert all(req.req_id not in self.kv.req_to_blocks for req in self.scheduler.waiting)
        referenced = {
            block_id for req_id in running_ids for block_id in self.kv.get_block_ids(req_id)
        }
        held = {block.block_id for block in self.kv.block_pool.blocks if block.ref_cnt > 0}
        assert held == referenced
        assert len(self.scheduler.running) <= self.config.max_num_seqs

    @invariant()
    def workers_mirror_the_scheduler(self) -> None:
        """Every running sequence the workers hold has the scheduler's table and tokens."""
        if not hasattr(self, "kv"):
            return
        for req in self.scheduler.running:
            seq = self.worker.seqs.get(req.req_id)
            if seq is None:
                continue  # forked or admitted after the last plan
            assert seq.block_ids == self.kv.get_block_ids(req.req_id), req.req_id
            assert seq.token_ids == req.all_token_ids[: len(seq.token_ids)], req.req_id
            assert seq.num_computed_tokens == req.num_computed_tokens, req.req_id

    # --- teardown ----------------------------------------------------------------------------

    def teardown(self) -> None:
        if not hasattr(self, "engine"):
            return
        for _ in range(MAX_TEARDOWN_STEPS):
            if not self.engine.has_unfinished_requests():
                break
            self._step()
        assert not self.engine.has_unfinished_requests(), "requests never finished"
        self._step()  # hands the last finished ids to the workers
        assert self.worker.seqs == {}
        self.kv.check_invariants()
        assert self.kv.num_free_blocks == self.kv.num_blocks, "blocks leaked"
        assert not self.kv.req_to_blocks and not self.kv.req_to_block_hashes
        assert not self.scheduler.requests and not self.scheduler.children
        assert not self.scheduler._queue_keys and not self.scheduler.worker_view.num_tokens_sent
        for req_id, request in self.requests.items():
            want = reference_outputs(
                request.prompt_token_ids,
                request.sampling_params,
                self.scheduler.max_model_len,
                EOS_TOKEN_IDS,
            )
            for choice, (tokens, reason) in enumerate(want):
                got = self.outputs[(req_id, choice)]
                if (req_id, choice) in self.aborted:
                    assert got[1] is None and tokens[: len(got[0])] == got[0]
                else:
                    assert got == (tokens, reason), f"{req_id}#{choice}"

    # --- helpers -----------------------------------------------------------------------------

    def _step(self) -> None:
        num_calls = self.worker.num_calls
        outputs = self.engine.step()
        if self.worker.num_calls == num_calls:
            assert not outputs
            return
        plan = self.worker.last_plan
        assert plan is not None
        assert plan.total_num_scheduled_tokens <= self.config.max_num_batched_tokens
        assert not self.dropped & set(self.worker.seqs), "the workers kept an aborted sequence"
        self.dropped.clear()
        for out in outputs:
            key = (out.req_id, out.choice_index)
            tokens, reason = self.outputs[key]
            assert reason is None and key not in self.aborted, f"{key}: output after its end"
            self.outputs[key] = (tokens + out.new_token_ids, out.finish_reason)

    def _unfinished(self) -> set[str]:
        return {
            req_id
            for (req_id, choice), (_, reason) in self.outputs.items()
            if reason is None and (req_id, choice) not in self.aborted
        }


TestSchedulerStateful = SchedulerMachine.TestCase
TestSchedulerStateful.settings = settings(
    max_examples=150,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
