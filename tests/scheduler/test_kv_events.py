"""KV deltas fold a window of index changes into their net effect, and a recorder left unread
falls back to a snapshot rather than growing (scheduler/kv_events.py)."""

from __future__ import annotations

import pickle

from hypothesis import given
from hypothesis import strategies as st

from pagedray.scheduler.block_pool import BlockPool
from pagedray.scheduler.kv_events import KVCacheDelta, KVEventRecorder

H = [bytes([i]) * 32 for i in range(16)]


def test_a_hash_removed_stored_and_removed_again_is_gone() -> None:
    recorder = KVEventRecorder(num_blocks=4)
    view = {H[0], H[1]}
    recorder.removed(H[0])
    recorder.stored(H[0])
    recorder.removed(H[0])
    recorder.stored(H[2])
    recorder.removed(H[2])  # stored and gone within the window: removing it is harmless
    delta = recorder.take(index=[H[1]])
    delta.apply(view)
    assert view == {H[1]}
    assert not recorder.take(index=[H[1]])  # nothing since


def test_clear_then_store_keeps_only_what_came_after() -> None:
    recorder = KVEventRecorder(num_blocks=4)
    recorder.stored(H[0])
    recorder.cleared()
    recorder.stored(H[3])
    delta = recorder.take(index=[H[3]])
    assert delta == KVCacheDelta(stored=[H[3]], removed=[], cleared=True)
    view = {H[1], H[2]}
    delta.apply(view)
    assert view == {H[3]}


def test_an_unread_recorder_hands_out_a_snapshot() -> None:
    recorder = KVEventRecorder(num_blocks=1)
    for block_hash in H[:3]:  # more removals than the pool has blocks
        recorder.stored(block_hash)
        recorder.removed(block_hash)
    assert not recorder._removed  # bounded: overflowed, nothing more kept
    delta = recorder.take(index=[H[5]])
    assert delta == KVCacheDelta(stored=[H[5]], removed=[], cleared=True)
    view = set(H[:3]) | {H[6]}
    delta.apply(view)
    assert view == {H[5]}


def test_changes_after_an_overflow_are_in_the_snapshot() -> None:
    recorder = KVEventRecorder(num_blocks=1)
    for block_hash in H[:3]:
        recorder.stored(block_hash)
        recorder.removed(block_hash)
    recorder.cleared()
    recorder.stored(H[7])
    recorder.removed(H[7])
    recorder.stored(H[8])
    view = {H[0], H[9]}
    recorder.take(index=[H[8]]).apply(view)
    assert view == {H[8]}
    assert recorder.take(index=[H[8]]) == KVCacheDelta()  # back to deltas, and none since


def test_a_delta_survives_pickling() -> None:
    """Deltas cross processes (engine replica to router) as they are."""
    delta = KVCacheDelta(stored=[H[1], H[2]], removed=[H[3]], cleared=True)
    assert pickle.loads(pickle.dumps(delta)) == delta


OPS = ["store"] * 4 + ["remove"] * 4 + ["clear", "take", "take"]


@given(ops=st.lists(st.tuples(st.sampled_from(OPS), st.sampled_from(H)), max_size=80))
def test_replayed_deltas_track_any_sequence_of_changes(ops: list[tuple[str, bytes]]) -> None:
    """The recorder's contract with its caller, the index: `stored` only for an absent hash,
    `removed` only for a present one. A view fed deltas equals the index after every take."""
    recorder = KVEventRecorder(num_blocks=1)  # small: overflows into snapshots on the way
    index: set[bytes] = set()
    view: set[bytes] = set()
    for op, block_hash in ops:
        if op == "store" and block_hash not in index:
            index.add(block_hash)
            recorder.stored(block_hash)
        elif op == "remove" and block_hash in index:
            index.discard(block_hash)
            recorder.removed(block_hash)
        elif op == "clear":
            index.clear()
            recorder.cleared()
        elif op == "take":
            recorder.take(index).apply(view)
            assert view == index
    recorder.take(index).apply(view)
    assert view == index


def test_a_pool_records_nothing_unless_asked() -> None:
    assert BlockPool(4, enable_caching=True).kv_events is None
