"""Blocks handed from the engine that holds them to one that would compute them (a pull).

When the router sends a request away from the replica whose pool holds its prefix (that one is
too loaded), the receiving engine asks the holder for the blocks instead of computing them. The
holder saves them into its node's host tier (they are in its pool, not necessarily in the
tier), and the receiver loads them from there as any tier hit. Both engines on one node share
the tier: nothing more moves. An engine on another node gets the blocks' bytes in the answer
and writes them into its own node's tier first (a slot's bytes are the same layout there:
the tier file is per model layout).

Plain data and functions over the scheduler's structures; the engines' event loops apply them
between runs of steps (engine/kv_handoffs.py), the one time the tier and the pool are theirs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import PurePath

from pagedray.scheduler.host_kv_tier import HostKVTier
from pagedray.scheduler.kv_cache_manager import KVCacheManager
from pagedray.scheduler.prefix_hash import BlockHash


@dataclass(frozen=True)
class TierAddress:
    """Which tier file an engine uses: engines with equal addresses share their blocks."""

    node_id: str
    path: str

    def same_blocks_as(self, other: TierAddress) -> bool:
        """Whether the other engine's blocks are the bits this one computes: the names of their
        tier files end in one arithmetic's digest (workers/host_kv_buffer.py's tier_path; the
        rest of a name digests the model's path too, which may differ between nodes)."""
        return _arithmetic_digest(self.path) == _arithmetic_digest(other.path)


def _arithmetic_digest(tier_path: str) -> str:
    return PurePath(tier_path).stem.rsplit("-", 1)[-1]


@dataclass
class KVExport:
    """A holder's answer to a pull: the leading blocks asked for that its node's tier now
    holds, with their bytes when the puller's tier is another (`payloads[i]` is block i's)."""

    block_hashes: list[BlockHash]
    payloads: list[bytes] | None = None


def offer_cached_prefix(manager: KVCacheManager, block_hashes: Sequence[BlockHash]) -> int:
    """Hand the leading run of `block_hashes` that the pool caches to the next plan's saves
    (the tier skips those it has); returns how many blocks that run has."""
    blocks = []
    for block_hash in block_hashes:
        block = manager.block_pool.get_cached_block(block_hash)
        if block is None:
            break
        blocks.append((block.block_id, block_hash))
    if blocks:
        manager.offer_for_saving(blocks)
    return len(blocks)


def export_from_tier(
    tier: HostKVTier, block_hashes: Sequence[BlockHash], with_bytes: bool
) -> KVExport:
    """The leading run of `block_hashes` in `tier`, leased (`lookup`), with their bytes if
    `with_bytes`."""
    slots = tier.lookup(block_hashes)
    payloads = [tier.read_slot(slot) for slot in slots] if with_bytes else None
    return KVExport(list(block_hashes[: len(slots)]), payloads)


def import_into_tier(tier: HostKVTier, export: KVExport) -> int:
    """Write an export's blocks (with bytes) that `tier` lacks into it, findable at once;
    returns how many were written."""
    if not export.payloads:
        return 0
    payload_of = dict(zip(export.block_hashes, export.payloads))
    reserved = tier.reserve(export.block_hashes)
    slots = [slot for _, slot in reserved]
    try:
        for block_hash, slot in reserved:
            tier.write_slot(slot, payload_of[block_hash])
    except BaseException:
        tier.release(slots)
        raise
    tier.publish(slots)
    # Leased for the load at admission, a moment later: the node's other engines' saves must
    # not take the slots first (a same-node pull's blocks hold the holder's lookup's lease).
    tier.lookup(export.block_hashes)
    return len(slots)
