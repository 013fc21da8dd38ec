"""The scheduler's LoRA slot table (scheduler/lora_slots.py), driven by random admissions,
steps (whose loads a rank applies, or fails, or that fail whole), finishes, preemptions and
forks: a sequence is admitted only once its adapter is loaded, and a rank that applied each
plan's loads then holds, in every running sequence's slot, that sequence's adapter; a step
never holds more adapters than slots; a slot a running sequence reads is never loaded over;
once nothing runs, every adapter is ready after one load (none is left loading).
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedray.scheduler.lora_slots import LoRASlots
from pagedray.scheduler.request import EngineRequest, Request
from pagedray.scheduler.sampling_params import SamplingParams

ADAPTERS = ["a", "b", "c", "d"]
OPS = st.lists(
    st.tuples(
        st.sampled_from(["admit", "admit", "step", "fail_load", "lost_step", "end", "fork"]),
        st.integers(0, 7),
    ),
    max_size=80,
)


@settings(max_examples=300, deadline=None)
@given(max_loras=st.integers(1, 3), ops=OPS)
def test_every_running_sequence_finds_its_adapter_in_its_slot(max_loras: int, ops) -> None:
    slots = LoRASlots(max_loras)
    for name in ADAPTERS:
        slots.register(name, f"/adapters/{name}")
    rank: dict[int, str] = {}  # what a rank's slots hold, from the loads it ran
    running: list[Request] = []
    ids = itertools.count()

    for op, pick in ops:
        name = ADAPTERS[pick % len(ADAPTERS)]
        if op == "admit" and slots.ready(slots.adapter_id(name) or ""):
            req = Request(EngineRequest(str(next(ids)), [1, 2], SamplingParams(), lora_name=name))
            req.lora_id = slots.adapter_id(name)  # as Scheduler.add_request sets it
            slots.acquire(req)
            running.append(req)
        elif op in ("step", "fail_load"):
            loads = slots.take_loads()
            failed = [load.slot for load in loads[:1]] if op == "fail_load" else []
            for load in loads:
                assert 0 <= load.slot < max_loras
                assert all(req.lora_slot != load.slot for req in running)  # none reads it
                rank[load.slot] = "(empty)" if load.slot in failed else load.adapter
            assert slots.loaded(loads, failed) == [load.adapter for load in loads[: len(failed)]]
        elif op == "lost_step":
            slots.lost(slots.take_loads())
        elif op == "end" and running:  # a finish or a preemption: the same to the slots
            slots.release(running.pop(pick % len(running)))
        elif op == "fork" and running:
            parent = running.pop(pick % len(running))
            children = [parent.fork_child(i) for i in range(2)]
            slots.fork(parent, children)
            running += children
        assert len({req.lora_name for req in running}) <= max_loras
        for req in running:
            assert req.lora_slot is not None and rank[req.lora_slot] == req.lora_id
    for req in running:
        slots.release(req)
    assert slots.running_adapters() == []
    # Nothing runs: each adapter is ready after at most one load, and none stays loading.
    slots.lost(slots.take_loads())
    for name in ADAPTERS:
        adapter = slots.adapter_id(name) or ""
        if not slots.ready(adapter):
            assert not slots.waits_for_slot(adapter)  # a slot took it: it is loading
            assert slots.loaded(slots.take_loads(), []) == []
        assert slots.ready(adapter) and not slots.waits_for_slot(adapter)


def test_a_name_is_not_moved_to_another_path() -> None:
    slots = LoRASlots(1)
    slots.register("a", "/one")
    slots.register("a", "/one")
    with pytest.raises(ValueError, match="already loaded from '/one'"):
        slots.register("a", "/two")


def test_a_request_whose_adapter_finds_no_slot_waits_a_bounded_time() -> None:
    """One slot, a request of adapter "a" arriving every step (so "a" always runs), and one of
    "b": others pass it to fill the batch, but after `LORA_MAX_SLOT_WAITS` steps new "a"
    requests wait, the slot drains, and "b" runs."""
    from test_scheduler import StandInWorker

    from pagedray.scheduler.config import SchedulerConfig
    from pagedray.scheduler.scheduler import LORA_MAX_SLOT_WAITS, Scheduler

    config = SchedulerConfig(max_model_len=64, max_num_seqs=16, enable_lora=True, max_loras=1)
    scheduler, worker = Scheduler(config, num_kv_blocks=256), StandInWorker(block_size=16)
    assert scheduler.lora_slots is not None
    for name in ("a", "b"):
        scheduler.lora_slots.register(name, f"/adapters/{name}")
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    ids = itertools.count()

    def add(name: str) -> str:
        req_id = f"{name}{next(ids)}"
        scheduler.add_request(Request(EngineRequest(req_id, [1, 2, 3], params, lora_name=name)))
        return req_id

    add("a")
    b = add("b")
    steps, ran = 0, False
    while not ran and steps < 4 * LORA_MAX_SLOT_WAITS:
        add("a")
        plan = scheduler.schedule()
        output = worker.execute_model(plan)
        scheduler.lora_loads_done(plan, output)
        scheduler.update_from_output(plan, output)
        steps, ran = steps + 1, b in plan.num_scheduled_tokens
    assert ran and LORA_MAX_SLOT_WAITS <= steps <= LORA_MAX_SLOT_WAITS + 8
