"""EngineCore's step around the executor: what a step that fails leaves behind."""

from __future__ import annotations

import pytest
from test_scheduler import StandInWorker

from pagedray.scheduler.config import SchedulerConfig
from pagedray.scheduler.engine_core import EngineCore
from pagedray.scheduler.messages import ModelRunnerOutput, SchedulerOutput
from pagedray.scheduler.request import EngineRequest
from pagedray.scheduler.sampling_params import SamplingParams


class FailsOnce(StandInWorker):
    """Takes the first plan in, then fails before its forward pass writes any KV."""

    failed = False

    def execute_model(self, plan: SchedulerOutput) -> ModelRunnerOutput:
        if not self.failed:
            self.failed = True
            self._update_states(plan)
            raise RuntimeError("the step failed")
        return super().execute_model(plan)


def test_blocks_of_a_failed_step_are_not_left_in_the_prefix_cache() -> None:
    """Blocks are indexed when planned; the offline `LLM` aborts and is used again after a
    failed call, so a prompt sent again must compute its prefix, not read KV never written
    (the stand-in executor fails any read of a slot that does not hold its own prefix)."""
    worker = FailsOnce(4)
    engine = EngineCore(SchedulerConfig(block_size=4, max_model_len=64), 16, worker)
    prompt = list(range(10))
    engine.add_request(EngineRequest("a", prompt, SamplingParams(max_tokens=2), 1.0))
    with pytest.raises(RuntimeError, match="the step failed"):
        engine.step()
    assert engine.scheduler.kv_cache_manager.block_pool.num_cached_blocks == 0
    engine.abort_requests(["a"])
    engine.add_request(EngineRequest("b", prompt, SamplingParams(max_tokens=2), 2.0))
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert [len(o.new_token_ids) for o in outputs if o.req_id == "b"] == [1, 1]
    assert engine.scheduler.stats()["prefix_cache_hits"] == 0
    engine.scheduler.kv_cache_manager.check_invariants()
