"""The node's host KV tier: blocks evicted from any engine's pool, kept in one shared file.

Every engine of the same model layout on a node (its replicas, and their restarts) opens the
same file, in shared memory by default (`/dev/shm`), so the node keeps one copy of a block
whatever the number of replicas, and a replica that starts finds what the others evicted. The
file holds a header, a ring log of changed slots, one record per slot (block hash, state, last
use, lease) and then the slots' KV bytes. This module owns the records (plain Python and numpy;
the scheduler's side); the ranks copy the bytes (workers/host_kv_buffer.py).

Processes coordinate with `flock` on the file and with leases instead of references: a slot that
a lookup returned, or one being written, is not reused until its lease lapses, so a process that
dies holding one leaks nothing for longer than a lease. Each process mirrors the hash -> slot
map and catches up from the ring log, so a lookup costs what changed since its last one.
"""

from __future__ import annotations

import dataclasses
import fcntl
import mmap
import os
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

from pagedray.scheduler.kv_events import KVCacheDelta, KVEventRecorder
from pagedray.scheduler.prefix_hash import BlockHash

MAGIC = b"PDKVTR02"
HEADER_BYTES = 4096
LOG_LEN = 8192  # changed slots kept for mirrors to catch up; further behind, they rebuild
PAGE = 4096
# A slot returned by a lookup stays unevictable this long: its load runs in the next step.
LOAD_LEASE_S = 30.0
# A slot being written: the step that writes it and the commit after it.
WRITE_LEASE_S = 120.0

FREE, WRITING, VALID = 0, 1, 2

_HEADER = np.dtype(
    [
        ("magic", "S8"),
        ("num_slots", "<i8"),
        ("slot_bytes", "<i8"),
        ("gen", "<i8"),  # changes logged so far
        ("hand", "<i8"),  # the eviction clock's next slot
    ]
)
_RECORD = np.dtype(
    [
        ("hash", "u1", (32,)),
        ("state", "<i8"),
        ("referenced", "<i8"),  # found since the clock last passed: spared once
        ("lease_until", "<f8"),  # time.time() before which the slot is not reused
    ]
)


@dataclass(frozen=True)
class TierLayout:
    """Where each part of a tier file lies, from its slot count and bytes per slot."""

    num_slots: int
    slot_bytes: int  # every rank's shard of one block, rank after rank

    @property
    def log_offset(self) -> int:
        return HEADER_BYTES

    @property
    def records_offset(self) -> int:
        return HEADER_BYTES + LOG_LEN * 8

    @property
    def data_offset(self) -> int:
        end = self.records_offset + self.num_slots * _RECORD.itemsize
        return -(-end // PAGE) * PAGE

    @property
    def file_bytes(self) -> int:
        return self.data_offset + self.num_slots * self.slot_bytes


def create_or_open(path: str, num_slots: int, slot_bytes: int) -> TierLayout:
    """The layout of the tier file at `path`, creating it (sparse: memory is taken as blocks are
    written) with `num_slots` slots if it does not exist. An existing file of the same slot size
    keeps its own slot count; one of another slot size is replaced."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        existing = _read_layout(fd)
        if existing is not None and existing.slot_bytes == slot_bytes:
            return existing
        layout = TierLayout(num_slots, slot_bytes)
        os.ftruncate(fd, 0)
        os.ftruncate(fd, layout.file_bytes)
        header = np.zeros(1, _HEADER)
        header[0] = (MAGIC, num_slots, slot_bytes, 0, 0)
        os.pwrite(fd, header.tobytes(), 0)
        return layout
    finally:
        os.close(fd)  # closing drops the lock


def read_layout(path: str) -> TierLayout:
    fd = os.open(path, os.O_RDONLY)
    try:
        layout = _read_layout(fd)
    finally:
        os.close(fd)
    if layout is None:
        raise ValueError(f"{path}: not a pagedray KV tier file")
    return layout


def _read_layout(fd: int) -> TierLayout | None:
    raw = os.pread(fd, _HEADER.itemsize, 0)
    if len(raw) < _HEADER.itemsize:
        return None
    header = np.frombuffer(raw, _HEADER)[0]
    if bytes(header["magic"]) != MAGIC:
        return None
    return TierLayout(int(header["num_slots"]), int(header["slot_bytes"]))


class HostKVTier:
    """The scheduler's handle on the node's host tier: find, reserve and publish slots.

    Not thread-safe: one scheduler uses it, from its stepping thread.
    """

    def __init__(self, path: str, name: str = "host", lower: HostKVTier | None = None) -> None:
        """`name` prefixes its stats ("host", "disk"); `lower`: the tier a block this one
        evicts goes down to (the disk tier below the host's), None: evicted blocks are gone."""
        self.path = path
        self.name = name
        self.lower = lower
        self.layout = read_layout(path)
        if lower is not None and lower.layout.slot_bytes != self.layout.slot_bytes:
            raise ValueError(f"{lower.path}: its slots differ in size from {path}'s")
        # A file object rather than a bare descriptor: an engine dropped without `close` frees it.
        self._file = open(path, "r+b")  # noqa: SIM115 - held for the handle's life
        self._fd = self._file.fileno()
        # Only the metadata is mapped here; the ranks copy the slots' bytes (pread/pwrite).
        self._map = mmap.mmap(self._fd, self.layout.data_offset)
        self._header = np.ndarray((1,), _HEADER, self._map, 0)
        self._log = np.ndarray((LOG_LEN,), "<i8", self._map, self.layout.log_offset)
        self._records = np.ndarray(
            (self.layout.num_slots,), _RECORD, self._map, self.layout.records_offset
        )
        self._gen = 0
        self._slot_hash: dict[int, BlockHash] = {}  # this process's mirror: VALID and WRITING
        self._hash_slot: dict[BlockHash, int] = {}
        self._valid: set[int] = set()  # slots the mirror saw VALID: stats count them per step
        self.events: KVEventRecorder | None = None  # VALID hashes gained and lost, for routers
        self.num_saved = 0  # blocks this engine wrote into the tier
        with self._locked():
            self._rebuild()

    @property
    def num_slots(self) -> int:
        return self.layout.num_slots

    def lookup(self, block_hashes: Sequence[BlockHash]) -> list[int]:
        """Slots holding the leading run of `block_hashes`, leased for their load."""
        if not block_hashes:
            return []
        slots: list[int] = []
        with self._locked():
            self._catch_up()
            now = time.time()
            for block_hash in block_hashes:
                slot = self._hash_slot.get(block_hash)
                if slot is None or self._records["state"][slot] != VALID:
                    break
                leases = self._records["lease_until"]
                leases[slot] = max(float(leases[slot]), now + LOAD_LEASE_S)
                self._records["referenced"][slot] = 1
                slots.append(slot)
        return slots

    def reserve(self, block_hashes: Sequence[BlockHash]) -> list[tuple[BlockHash, int]]:
        """Slots to write these blocks into (those already in the tier are skipped), fewer when
        too many are leased. Eviction is a clock (second chance): the hand goes round the slots
        taking the first that is not leased, sparing once a block found since it last passed,
        so a step's saves cost what they take, not a scan of the tier."""
        if not block_hashes:
            return []
        with self._locked():
            self._catch_up()
            now = time.time()
            records = self._records
            wanted = list(dict.fromkeys(h for h in block_hashes if not self._held(h, now)))
            if not wanted:
                return []
            taken: list[tuple[BlockHash, int]] = []
            for block_hash in wanted:
                slot = self._clock_victim(now)
                if slot is None or not self._backed(slot):
                    break
                taken.append((block_hash, slot))
                if self.lower is not None and records["state"][slot] == VALID:
                    self._demote(slot)
                records["hash"][slot] = np.frombuffer(block_hash, np.uint8)
                records["state"][slot] = WRITING
                records["referenced"][slot] = 0
                records["lease_until"][slot] = now + WRITE_LEASE_S
                self._changed(slot)
            self._catch_up()
        return taken

    def _held(self, block_hash: BlockHash, now: float) -> bool:
        """Whether the tier has this block or a live writer is saving it (a write whose lease
        lapsed, its process dead, does not count: the block may be saved again)."""
        slot = self._hash_slot.get(block_hash)
        if slot is None:
            return False
        return self._records["state"][slot] == VALID or self._records["lease_until"][slot] > now

    def _demote(self, slot: int) -> None:
        """Copy the block this tier is about to drop into the tier below (the lock is held; the
        lower's is taken inside it, always in this order). The kernel copies file to file."""
        assert self.lower is not None
        block_hash = self._records["hash"][slot].tobytes()
        reserved = self.lower.reserve([block_hash])
        if not reserved:
            return  # there already, or every slot below is leased
        ((_, target),) = reserved
        size = self.layout.slot_bytes
        source = self.layout.data_offset + slot * size
        dest = self.lower.layout.data_offset + target * size
        try:
            _copy_range(self._fd, self.lower._fd, size, source, dest)
        except OSError:
            self.lower.release([target])
            return
        self.lower.publish([target])

    def _clock_victim(self, now: float) -> int | None:
        """The next slot the clock may reuse (the lock is held); None when every slot is leased."""
        records, num_slots = self._records, self.num_slots
        hand = int(self._header["hand"][0])
        for _ in range(2 * num_slots):  # one pass clears every spared slot's mark
            slot, hand = hand, (hand + 1) % num_slots
            if records["lease_until"][slot] > now:
                continue
            if records["referenced"][slot]:
                records["referenced"][slot] = 0
                continue
            self._header["hand"][0] = hand
            return slot
        self._header["hand"][0] = hand
        return None

    def publish(self, slots: Sequence[int]) -> None:
        """The ranks wrote these reserved slots: make them findable."""
        self._finish_writes(slots, VALID)

    def release(self, slots: Sequence[int]) -> None:
        """The step that was to write these reserved slots failed: free them."""
        self._finish_writes(slots, FREE)

    def stats(self) -> dict[str, float]:
        """Blocks held on the node (all engines), and what this engine saved; the lower tier's
        too (its saved blocks are those this engine moved down)."""
        with self._locked():
            self._catch_up()
        num_valid = len(self._valid)
        prefix = f"{self.name}_tier"
        stats: dict[str, float] = {
            f"{prefix}_num_blocks": num_valid,
            f"{prefix}_capacity_blocks": self.num_slots,
            f"{prefix}_bytes": num_valid * self.layout.slot_bytes,
            f"{prefix}_saved_blocks": self.num_saved,
        }
        return stats | (self.lower.stats() if self.lower is not None else {})

    def record_events(self) -> None:
        """From now on keep the blocks the tier gains and loses (`take_events`), starting
        from a snapshot: an engine publishes them to cache-aware routers beside its pool's
        (and the tier's below, nested: `take_events`)."""
        if self.lower is not None:
            self.lower.record_events()
        if self.events is None:
            self.events = KVEventRecorder(self.num_slots)
            self.events.cleared()
            for block_hash in self._valid_hashes():
                self.events.stored(block_hash)

    def take_events(self) -> KVCacheDelta:
        """The tier's changes since last asked (by any engine of the node), as this process
        catches up with them, with the tier's below as its `tier`; `record_events` first."""
        assert self.events is not None, "record_events first"
        with self._locked():
            self._catch_up()
        # A generator: read only by a recorder that overflowed (a snapshot), not every step.
        delta = self.events.take(self._valid_hashes())
        if self.lower is None:
            return delta
        return dataclasses.replace(delta, tier=self.lower.take_events())

    def _valid_hashes(self) -> Iterator[BlockHash]:
        return (self._slot_hash[slot] for slot in self._valid)

    def read_slot(self, slot: int) -> bytes:
        """A published slot's bytes, for an engine on another node (scheduler/kv_transfer.py);
        the caller holds its lease (`lookup`)."""
        offset = self.layout.data_offset + slot * self.layout.slot_bytes
        data = os.pread(self._fd, self.layout.slot_bytes, offset)
        if len(data) != self.layout.slot_bytes:
            raise OSError(f"{self.path}: slot {slot} is short ({len(data)} bytes)")
        return data

    def write_slot(self, slot: int, data: bytes) -> None:
        """Fill a reserved slot with a block from another node's tier, as a rank would."""
        if len(data) != self.layout.slot_bytes:
            raise ValueError(f"a block of {len(data)} bytes for slots of {self.layout.slot_bytes}")
        offset = self.layout.data_offset + slot * self.layout.slot_bytes
        view = memoryview(data)
        while view:  # a write to a file may be short
            written = os.pwrite(self._fd, view, offset)
            view, offset = view[written:], offset + written

    def close(self) -> None:
        for view in ("_header", "_log", "_records"):
            setattr(self, view, None)
        self._map.close()
        self._file.close()

    def _backed(self, slot: int) -> bool:
        """Give a slot its memory before a rank writes it: a write into a sparse file whose
        filesystem is full would kill the rank (SIGBUS); this fails instead, and the block is
        not saved. A no-op for a slot written before."""
        offset = self.layout.data_offset + slot * self.layout.slot_bytes
        try:
            os.posix_fallocate(self._fd, offset, self.layout.slot_bytes)
        except OSError:
            return False
        return True

    def _finish_writes(self, slots: Sequence[int], state: int) -> None:
        if not slots:
            return
        published = 0
        with self._locked():
            self._catch_up()
            records = self._records
            for slot in slots:
                final = state
                if state == VALID:
                    holder = self._hash_slot.get(records["hash"][slot].tobytes())
                    if holder not in (None, slot) and records["state"][holder] == VALID:
                        final = FREE  # saved meanwhile by another whose lease on it had lapsed
                    else:
                        published += 1
                records["state"][slot] = final
                records["lease_until"][slot] = 0.0
                self._changed(slot)
            self._catch_up()
        self.num_saved += published

    @contextmanager
    def _locked(self) -> Iterator[None]:
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    def _changed(self, slot: int) -> None:
        """Log a slot's change for every mirror (the lock is held)."""
        gen = int(self._header["gen"][0])
        self._log[gen % LOG_LEN] = slot
        self._header["gen"][0] = gen + 1

    def _catch_up(self) -> None:
        """Bring this process's mirror to the file's state (the lock is held)."""
        gen = int(self._header["gen"][0])
        if gen - self._gen > LOG_LEN or gen < self._gen:
            self._rebuild()
            return
        for pos in range(self._gen, gen):
            self._mirror(int(self._log[pos % LOG_LEN]))
        self._gen = gen

    def _rebuild(self) -> None:
        self._slot_hash.clear()
        self._hash_slot.clear()
        self._valid.clear()
        if self.events is not None:
            self.events.cleared()
        for slot in np.flatnonzero(self._records["state"] != FREE):
            self._mirror(int(slot))
        self._gen = int(self._header["gen"][0])

    def _mirror(self, slot: int) -> None:
        old = self._slot_hash.pop(slot, None)
        if old is not None and self._hash_slot.get(old) == slot:
            del self._hash_slot[old]
        if slot in self._valid:
            self._valid.discard(slot)
            if self.events is not None and old is not None:
                self.events.removed(old)
        state = self._records["state"][slot]
        if state == FREE:
            return
        block_hash = self._records["hash"][slot].tobytes()
        if state == VALID:
            self._valid.add(slot)
            if self.events is not None:
                self.events.stored(block_hash)
        self._slot_hash[slot] = block_hash
        self._hash_slot[block_hash] = slot


def _copy_range(source_fd: int, dest_fd: int, size: int, source: int, dest: int) -> None:
    """`size` bytes from one file's offset to another's, in the kernel where it can."""
    done = 0
    try:
        while done < size:
            copied = os.copy_file_range(source_fd, dest_fd, size - done, source + done, dest + done)
            if copied == 0:
                raise OSError(f"copy_file_range stopped at {done} of {size} bytes")
            done += copied
    except OSError:
        if done:
            raise
        os.pwrite(dest_fd, os.pread(source_fd, size, source), dest)  # across filesystems
