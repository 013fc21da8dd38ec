"""The host KV tier's records: what one handle publishes every handle on the file finds; leased
slots are never reused; eviction is a clock that spares a block found since it last passed."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedray.scheduler import host_kv_tier
from pagedray.scheduler.block_pool import KVCacheBlock
from pagedray.scheduler.host_kv_tier import VALID, HostKVTier, create_or_open, read_layout
from pagedray.scheduler.kv_cache_manager import KVCacheManager

SLOT_BYTES = 64


def block_hash(i: int) -> bytes:
    # Digests that end in zero bytes too: a record must keep all 32.
    return hashlib.sha256(str(i).encode()).digest()[:30] + b"\0\0"


def tier_file(tmp_path: Path, num_slots: int) -> str:
    path = str(tmp_path / "tier")
    create_or_open(path, num_slots, SLOT_BYTES)
    return path


def save(tier: HostKVTier, hashes: list[bytes]) -> list[int]:
    reserved = tier.reserve(hashes)
    tier.publish([slot for _, slot in reserved])
    return [slot for _, slot in reserved]


def test_what_one_handle_publishes_the_other_finds(tmp_path: Path) -> None:
    path = tier_file(tmp_path, 8)
    writer, reader = HostKVTier(path), HostKVTier(path)
    hashes = [block_hash(i) for i in range(3)]
    reserved = writer.reserve(hashes)
    assert [h for h, _ in reserved] == hashes
    assert reader.lookup(hashes) == [], "a slot being written is not found"
    writer.publish([slot for _, slot in reserved])
    assert reader.lookup(hashes) == [slot for _, slot in reserved]
    # The leading run only: a missing block ends it.
    assert reader.lookup([hashes[0], block_hash(99), hashes[2]]) == [reserved[0][1]]
    assert writer.reserve(hashes) == [], "the node keeps one copy of a block"
    assert reader.stats()["host_tier_num_blocks"] == 3


def test_a_failed_write_frees_its_slots(tmp_path: Path) -> None:
    tier = HostKVTier(tier_file(tmp_path, 4))
    reserved = tier.reserve([block_hash(0)])
    tier.release([slot for _, slot in reserved])
    assert tier.lookup([block_hash(0)]) == []
    assert tier.reserve([block_hash(0)]) != [], "a released block can be saved again"


def test_leased_slots_are_not_reused_and_the_first_saved_go_first(tmp_path: Path) -> None:
    tier = HostKVTier(tier_file(tmp_path, 4))
    slots = save(tier, [block_hash(i) for i in range(4)])
    leased = tier.lookup([block_hash(0)])  # the oldest, but about to be loaded
    # Expire no lease but the lookup's: the writes' leases ended at publish.
    taken = tier.reserve([block_hash(10), block_hash(11), block_hash(12), block_hash(13)])
    assert len(taken) == 3 and leased[0] not in [slot for _, slot in taken]
    assert {slot for _, slot in taken} == set(slots) - set(leased)
    assert tier.lookup([block_hash(0)]) == leased


def test_a_block_found_since_the_clock_passed_is_spared_once(tmp_path: Path) -> None:
    tier = HostKVTier(tier_file(tmp_path, 3))
    save(tier, [block_hash(i) for i in range(3)])
    (slot0,) = tier.lookup([block_hash(0)])
    expire_leases(tier)
    ((_, taken),) = tier.reserve([block_hash(7)])
    assert taken != slot0 and tier.lookup([block_hash(0)]) == [slot0]
    assert tier.lookup([block_hash(1)]) == [], "block 1 was next, and not found since"
    expire_leases(tier)
    ((_, again),) = tier.reserve([block_hash(8)])
    assert again != slot0, "the clock passed block 0 once, clearing its mark, and takes block 2"
    assert tier.lookup([block_hash(2)]) == []


def test_a_handle_far_behind_rebuilds_its_mirror(tmp_path: Path) -> None:
    num_slots = host_kv_tier.LOG_LEN + 100
    path = tier_file(tmp_path, num_slots)
    late, busy = HostKVTier(path), HostKVTier(path)
    hashes = [block_hash(i) for i in range(host_kv_tier.LOG_LEN + 50)]
    slots = save(busy, hashes)  # two changes a slot: far more than the log holds
    assert late.lookup(hashes) == slots


def test_a_file_of_another_slot_size_is_replaced_and_one_of_the_same_kept(tmp_path: Path) -> None:
    path = str(tmp_path / "tier")
    create_or_open(path, 4, SLOT_BYTES)
    save(HostKVTier(path), [block_hash(0)])
    assert create_or_open(path, 16, SLOT_BYTES).num_slots == 4, "a second opener adopts it"
    assert HostKVTier(path).lookup([block_hash(0)]) != []
    assert create_or_open(path, 16, 2 * SLOT_BYTES).num_slots == 16
    assert HostKVTier(path).lookup([block_hash(0)]) == []
    assert read_layout(path).slot_bytes == 2 * SLOT_BYTES


def test_no_slot_is_handed_out_that_memory_cannot_back(tmp_path: Path, monkeypatch) -> None:
    """A full filesystem (a small /dev/shm): the block is not saved, and no rank ever writes
    into a page that does not exist (which would kill it with SIGBUS)."""
    tier = HostKVTier(tier_file(tmp_path, 4))
    save(tier, [block_hash(0)])

    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(host_kv_tier.os, "posix_fallocate", full)
    assert tier.reserve([block_hash(1), block_hash(2)]) == []
    assert tier.lookup([block_hash(0)]) != [], "what was saved stays"


def expire_leases(tier: HostKVTier) -> None:
    tier._records["lease_until"][:] = 0.0


# One operation on the tier: (handle, op, block numbers).
OPS = st.lists(
    st.tuples(
        st.integers(0, 1),
        st.sampled_from(["save", "fail", "lookup", "expire"]),
        st.lists(st.integers(0, 11), min_size=1, max_size=5),
    ),
    max_size=40,
)


@settings(max_examples=60, deadline=None)
@given(ops=OPS)
def test_handles_agree_and_never_hand_out_a_leased_slot(tmp_path_factory, ops) -> None:
    path = tier_file(tmp_path_factory.mktemp("tier"), 6)
    handles = [HostKVTier(path), HostKVTier(path)]
    handles[1].record_events()
    routed: set[bytes] = set()  # a router's copy of the tier, from handle 1's events
    leased: dict[int, bytes] = {}  # slot -> the block a lookup leased it for
    for who, op, blocks in ops:
        tier, hashes = handles[who], [block_hash(b) for b in blocks]
        if op in ("save", "fail"):
            reserved = tier.reserve(hashes)
            assert not {slot for _, slot in reserved} & set(leased), "a leased slot was reused"
            slots = [slot for _, slot in reserved]
            tier.publish(slots) if op == "save" else tier.release(slots)
        elif op == "lookup":
            found = tier.lookup(hashes)
            for slot, wanted in zip(found, hashes):
                assert tier._records["hash"][slot].tobytes() == wanted
                leased[slot] = wanted
        else:
            expire_leases(tier)
            leased.clear()
        for slot, wanted in leased.items():
            assert handles[1 - who]._records["hash"][slot].tobytes() == wanted
        handles[1].take_events().apply(routed)
    stats = [handle.stats()["host_tier_num_blocks"] for handle in handles]
    records = handles[0]._records
    in_file = {
        records["hash"][slot].tobytes() for slot in np.flatnonzero(records["state"] == VALID)
    }
    assert stats[0] == stats[1] == len(in_file) <= 6
    assert routed == in_file, "what the events told is what the tier holds"
    for handle in handles:
        handle.close()


def test_empty_requests_touch_nothing(tmp_path: Path) -> None:
    tier = HostKVTier(tier_file(tmp_path, 2))
    assert tier.lookup([]) == [] and tier.reserve([]) == []
    tier.publish([])
    tier.release([])
    assert tier.stats()["host_tier_num_blocks"] == 0


def test_a_block_the_host_tier_drops_goes_down_to_the_disk_tier(tmp_path: Path) -> None:
    host_path = tier_file(tmp_path, 2)
    disk_path = str(tmp_path / "disk")
    create_or_open(disk_path, 8, SLOT_BYTES)
    disk = HostKVTier(disk_path, name="disk")
    host = HostKVTier(host_path, lower=disk)
    (first,) = save(host, [block_hash(0)])
    payload = bytes(range(SLOT_BYTES))
    os.pwrite(host._fd, payload, host.layout.data_offset + first * SLOT_BYTES)
    save(host, [block_hash(1), block_hash(2)])  # the clock comes round to block 0's slot
    assert host.lookup([block_hash(0)]) == []
    (below,) = disk.lookup([block_hash(0)])
    assert os.pread(disk._fd, SLOT_BYTES, disk.layout.data_offset + below * SLOT_BYTES) == payload
    stats = host.stats()
    assert stats["host_tier_num_blocks"] == 2 and stats["disk_tier_num_blocks"] == 1
    assert stats["disk_tier_saved_blocks"] == 1, "a block moved down counts as the disk's save"


def test_the_disk_tiers_events_come_nested_in_the_host_tiers(tmp_path: Path) -> None:
    """A router weighs a block on disk apart from one in host memory: the host tier's delta
    carries the disk tier's as its own `tier`, a snapshot first, then what moved down."""
    disk_path = str(tmp_path / "disk")
    create_or_open(disk_path, 8, SLOT_BYTES)
    host = HostKVTier(tier_file(tmp_path, 2), lower=HostKVTier(disk_path, name="disk"))
    host.record_events()
    first = host.take_events()
    assert first.cleared and first.tier is not None and first.tier.cleared
    save(host, [block_hash(0), block_hash(1)])
    save(host, [block_hash(2)])  # block 0 goes down to the disk
    delta = host.take_events()
    assert delta.stored == [block_hash(1), block_hash(2)] and delta.removed == [block_hash(0)]
    assert delta.tier is not None and delta.tier.stored == [block_hash(0)]
    assert not host.take_events()


def test_a_write_whose_writer_died_does_not_block_the_block_for_good(tmp_path: Path) -> None:
    path = tier_file(tmp_path, 4)
    dead, alive = HostKVTier(path), HostKVTier(path)
    dead.reserve([block_hash(0)])  # and never publishes: its process died mid-step
    assert alive.reserve([block_hash(0)]) == [], "a live write is not doubled"
    expire_leases(alive)
    (retry,) = alive.reserve([block_hash(0)])
    alive.publish([retry[1]])
    assert HostKVTier(path).lookup([block_hash(0)]) == [retry[1]]


def test_a_hash_evicted_and_computed_in_one_plan_is_saved_from_the_evicted_block(
    tmp_path: Path,
) -> None:
    """Evicted while planning, then missed by a request admitted after it, which computes it
    into a new block: the save must read the evicted block (intact before the forward pass),
    not the new one (written only by it)."""
    manager = KVCacheManager(8, 4, host_tier=HostKVTier(tier_file(tmp_path, 4)))
    manager.block_pool.evicted = [(5, block_hash(0))]
    recomputed = KVCacheBlock(block_id=7, block_hash=block_hash(0))
    before, after = manager.take_saves([recomputed])
    assert [block for block, _ in before] == [5] and after == []


def test_events_tell_what_any_handle_saved_and_the_clock_dropped(tmp_path: Path) -> None:
    path = tier_file(tmp_path, 2)
    writer, watcher = HostKVTier(path), HostKVTier(path)
    save(writer, [block_hash(0)])
    watcher.record_events()
    first = watcher.take_events()
    assert first.cleared and first.stored == [block_hash(0)], "a snapshot to start from"
    assert not watcher.take_events()
    save(writer, [block_hash(1), block_hash(2)])  # two slots: the clock drops one
    delta = watcher.take_events()
    assert not delta.cleared and set(delta.stored) == {block_hash(1), block_hash(2)}
    assert delta.removed == [block_hash(0)]


def test_a_block_saved_twice_is_kept_once(tmp_path: Path) -> None:
    """A writer whose lease lapsed (slow, not dead) publishes after another saved the same
    block: the tier keeps one copy, so the count and the routers' events stay right."""
    path = tier_file(tmp_path, 4)
    slow, quick = HostKVTier(path), HostKVTier(path)
    ((_, late_slot),) = slow.reserve([block_hash(0)])
    expire_leases(slow)
    (slot,) = save(quick, [block_hash(0)])
    slow.publish([late_slot])
    assert slow.num_saved == 0 and quick.num_saved == 1
    assert slow.stats()["host_tier_num_blocks"] == 1
    assert slow.lookup([block_hash(0)]) == [slot]
