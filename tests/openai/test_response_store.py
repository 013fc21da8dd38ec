"""The response store keeps its bounds (count, bytes, age) and never answers with a record that
has expired or been evicted; a model store (plain lists) is the oracle for random sequences.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from pagedray.openai.response_store import ResponseStore


class FakeClock:
    """Seconds that pass only when a test says so."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _record(response_id: str, size: int = 0) -> dict[str, Any]:
    return {
        "response": {"id": response_id},
        "conversation": [{"role": "user", "content": "x" * size}],
    }


def _size(record: dict[str, Any]) -> int:
    return len(json.dumps(record))


def test_records_expire_ttl_after_their_put_even_when_read() -> None:
    clock = FakeClock()
    store = ResponseStore(ttl_s=10.0, clock=clock)
    store.put("a", _record("a"))
    clock.now += 5
    store.put("b", _record("b"))
    assert store.get("a") == _record("a")
    clock.now += 5  # a's ttl is up; the get above did not extend it
    assert store.get("a") is None and store.get("b") == _record("b")
    clock.now += 5
    assert store.get("b") is None
    assert store.stats() == {"num_responses": 0, "num_bytes": 0, "evicted": 0, "expired": 2}


def test_the_least_recently_used_record_is_evicted_by_count() -> None:
    store = ResponseStore(max_responses=2, clock=FakeClock())
    store.put("a", _record("a"))
    store.put("b", _record("b"))
    store.get("a")  # b is now the least recently used
    store.put("c", _record("c"))
    assert [store.get(key) is not None for key in "abc"] == [True, False, True]
    assert store.stats()["evicted"] == 1


def test_records_are_evicted_until_the_bytes_fit() -> None:
    one = _size(_record("a", 100))
    store = ResponseStore(max_bytes=3 * one, clock=FakeClock())
    for key in "abc":
        store.put(key, _record(key, 100))
    store.put("d", _record("d", 100 + one))  # two records' worth: a and b go
    assert [store.get(key) is not None for key in "abcd"] == [False, False, True, True]
    assert store.stats() == {
        "num_responses": 2,
        "num_bytes": one + _size(_record("d", 100 + one)),
        "evicted": 2,
        "expired": 0,
    }


def test_expired_records_go_before_any_live_one_is_evicted() -> None:
    clock = FakeClock()
    store = ResponseStore(max_responses=2, ttl_s=10.0, clock=clock)
    store.put("old", _record("old"))
    clock.now += 6
    store.put("live", _record("live"))
    clock.now += 5
    store.put("new", _record("new"))
    assert store.get("live") is not None
    assert store.stats()["expired"] == 1 and store.stats()["evicted"] == 0


def test_an_oversize_record_is_refused_and_changes_nothing() -> None:
    store = ResponseStore(max_bytes=100, clock=FakeClock())
    store.put("a", _record("a"))
    with pytest.raises(ValueError, match="bytes"):
        store.put("a", _record("a", 200))
    assert store.get("a") == _record("a")


def test_a_put_replaces_and_a_get_returns_a_copy() -> None:
    store = ResponseStore(clock=FakeClock())
    store.put("a", _record("a", 5))
    store.put("a", _record("a", 1))
    got = store.get("a")
    assert got == _record("a", 1) and store.stats()["num_bytes"] == _size(got)
    got["response"]["id"] = "changed"
    assert store.get("a") == _record("a", 1)
    assert store.delete("a") and not store.delete("a") and store.get("a") is None


KEYS = st.sampled_from("abcd")


class StoreMachine(RuleBasedStateMachine):
    """The store against a plain model: a list in use order, each entry with its put time."""

    @initialize(
        max_responses=st.integers(1, 4),
        max_bytes=st.integers(150, 800),
        ttl_s=st.sampled_from([5.0, 30.0]),
    )
    def setup(self, max_responses: int, max_bytes: int, ttl_s: float) -> None:
        self.clock = FakeClock()
        self.store = ResponseStore(max_responses, max_bytes, ttl_s, clock=self.clock)
        self.model: list[tuple[str, dict[str, Any], float]] = []  # least recently used first
        self.versions = 0  # each put's record is distinct, so a stale one cannot pass as new
        self.evicted = 0
        self.expired = 0

    def _live(self) -> None:
        """Drop expired entries from the model, as the store must before any answer."""
        live = [entry for entry in self.model if entry[2] + self.store.ttl_s > self.clock.now]
        self.expired += len(self.model) - len(live)
        self.model = live

    @rule(key=KEYS, size=st.one_of(st.integers(0, 30), st.integers(0, 600)))
    def put(self, key: str, size: int) -> None:
        self.versions += 1
        record = _record(key, size) | {"version": self.versions}
        if _size(record) > self.store.max_bytes:
            with pytest.raises(ValueError):
                self.store.put(key, record)
            return
        self.store.put(key, record)
        self._live()
        self.model = [entry for entry in self.model if entry[0] != key]
        self.model.append((key, record, self.clock.now))
        while len(self.model) > self.store.max_responses or self._model_bytes() > (
            self.store.max_bytes
        ):
            self.model.pop(0)
            self.evicted += 1

    @rule(key=KEYS)
    def get(self, key: str) -> None:
        self._live()
        expected = next((entry for entry in self.model if entry[0] == key), None)
        got = self.store.get(key)
        if expected is None:
            assert got is None
            return
        assert got == expected[1]
        assert expected[2] + self.store.ttl_s > self.clock.now  # never an expired record
        self.model.remove(expected)
        self.model.append(expected)

    @rule(key=KEYS)
    def delete(self, key: str) -> None:
        self._live()
        present = any(entry[0] == key for entry in self.model)
        assert self.store.delete(key) == present
        self.model = [entry for entry in self.model if entry[0] != key]

    @rule(seconds=st.sampled_from([1.0, 2.5, 5.0]))
    def advance(self, seconds: float) -> None:
        self.clock.now += seconds

    def _model_bytes(self) -> int:
        return sum(_size(entry[1]) for entry in self.model)

    @invariant()
    def bounds_hold_and_match_the_model(self) -> None:
        stats = self.store.stats()
        self._live()
        assert stats["num_responses"] <= self.store.max_responses
        assert stats["num_bytes"] <= self.store.max_bytes
        assert self.store.ids() == [entry[0] for entry in self.model]
        assert stats == {
            "num_responses": len(self.model),
            "num_bytes": self._model_bytes(),
            "evicted": self.evicted,
            "expired": self.expired,
        }


TestStoreMachine = StoreMachine.TestCase
TestStoreMachine.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
