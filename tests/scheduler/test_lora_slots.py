"""The scheduler's LoRA slot table (scheduler/lora_slots.py), driven by random admissions,
steps (whose loads a rank applies, or fails, or that fail whole), finishes, preemptions and
forks: a sequence is admitted only once its adapter is loaded, and a rank that applied each
plan's loads then holds, in every running sequence's slot, that sequence's adapter; a step
never holds more adapters than slots; a slot a running sequence reads is never loaded over.
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
        if op == "admit" and slots.ready(name):
            req = Request(EngineRequest(str(next(ids)), [1, 2], SamplingParams(), lora_name=name))
            slots.acquire(req)
            running.append(req)
        elif op in ("step", "fail_load"):
            loads = slots.take_loads()
            failed = [load.slot for load in loads[:1]] if op == "fail_load" else []
            for load in loads:
                assert 0 <= load.slot < max_loras
                assert all(req.lora_slot != load.slot for req in running)  # none reads it
                rank[load.slot] = "(empty)" if load.slot in failed else load.name
            assert slots.loaded(loads, failed) == [load.name for load in loads[: len(failed)]]
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
            assert req.lora_slot is not None and rank[req.lora_slot] == req.lora_name
    for req in running:
        slots.release(req)
    assert slots.running_adapters() == []


def test_a_name_is_not_moved_to_another_path() -> None:
    slots = LoRASlots(1)
    slots.register("a", "/one")
    slots.register("a", "/one")
    with pytest.raises(ValueError, match="already loaded from '/one'"):
        slots.register("a", "/two")
