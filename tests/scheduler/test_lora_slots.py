"""The scheduler's LoRA slot table (scheduler/lora_slots.py), driven by random admissions,
finishes, preemptions, forks and unregistrations: a rank that applies each plan's loads in
order always holds, in every running sequence's slot, that sequence's adapter; a step never
holds more adapters than slots; a slot a running sequence reads is never loaded over.
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
        st.sampled_from(["admit", "finish", "fork", "unregister", "register", "step"]),
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
    rank: dict[int, str] = {}  # what a rank's slots hold, from the loads it was sent
    running: list[Request] = []
    ids = itertools.count()

    def apply_loads() -> None:
        for load in slots.take_loads():
            assert 0 <= load.slot < max_loras
            # Nothing running reads the slot it replaces.
            assert all(req.lora_slot != load.slot for req in before)
            rank[load.slot] = load.name

    for op, pick in ops:
        before = list(running)
        name = ADAPTERS[pick % len(ADAPTERS)]
        if op == "admit" and slots.knows(name) and slots.can_hold(name):
            req = Request(EngineRequest(str(next(ids)), [1, 2], SamplingParams(), lora_name=name))
            slots.acquire(req)
            running.append(req)
        elif op == "finish" and running:
            slots.release(running.pop(pick % len(running)))
        elif op == "fork" and running:
            parent = running.pop(pick % len(running))
            children = [parent.fork_child(i) for i in range(2)]
            slots.fork(parent, children)
            running += children
        elif op == "unregister":
            slots.unregister(name)
        elif op == "register":
            slots.register(name, f"/adapters/{name}")
        apply_loads()
        in_use = {req.lora_name for req in running}
        assert len(in_use) <= max_loras
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
