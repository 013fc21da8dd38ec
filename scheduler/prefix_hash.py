"""Chained sha256 hashes of full KV blocks: the keys of the automatic prefix cache.

A block's hash covers its parent's hash, its token ids and extra keys (e.g. a tenant's
`cache_salt`), so equal hashes mean equal whole prefixes. sha256 over an explicit byte encoding
keeps hashes identical across processes and makes collisions infeasible to forge.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

BlockHash = bytes

# Stands in for the parent of the first block. It is shorter than any sha256 digest and is
# length-prefixed like a digest, so no real parent hash encodes to the same bytes.
_ROOT_MARKER = b"pagedray/root/v1"

# One tag byte per extra-key type, so e.g. the string "1" and the integer 1 hash differently.
_TAG_NONE = b"n"
_TAG_STR = b"s"
_TAG_INT = b"i"
_TAG_BYTES = b"b"
# Marks the LoRA adapter's name among a first block's extra keys.
_LORA_KEY = b"lora"


def hash_block_tokens(
    parent_hash: BlockHash | None,
    token_ids: Sequence[int],
    extra_keys: tuple = (),
) -> BlockHash:
    """The sha256 digest of one block, chained to its parent's hash.

    Args:
        parent_hash: Hash of the previous block, or None for the sequence's first block.
        token_ids: The block's token ids.
        extra_keys: Strings, ints, bytes or None that also distinguish the block
            (e.g. the cache salt).

    Returns:
        32 bytes, identical in every process for identical inputs.
    """
    digest = hashlib.sha256()
    parent = _ROOT_MARKER if parent_hash is None else parent_hash
    digest.update(_length_prefixed(parent))
    digest.update(struct.pack("<Q", len(token_ids)))
    digest.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    digest.update(struct.pack("<Q", len(extra_keys)))
    for key in extra_keys:
        digest.update(_encode_extra_key(key))
    return digest.digest()


def compute_block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    cache_salt: str | None,
    existing: list[BlockHash],
    lora_key: str | None = None,
) -> list[BlockHash]:
    """Hashes of the full blocks of `token_ids` past the `len(existing)` already hashed.

    Incremental: only the new full blocks are hashed, each chained to the one before. The salt
    and the LoRA adapter's key enter the first block only; chaining carries them into every
    later hash, so an adapter's K/V (which its q/k/v deltas change) is never the base model's.
    """
    num_full_blocks = len(token_ids) // block_size
    parent = existing[-1] if existing else None
    new_hashes: list[BlockHash] = []
    first_keys: tuple = () if cache_salt is None else (cache_salt,)
    if lora_key is not None:
        # Three keys where a salt alone is one: no salt can hash like an adapter.
        first_keys = (cache_salt, _LORA_KEY, lora_key)
    for block_idx in range(len(existing), num_full_blocks):
        start = block_idx * block_size
        extra_keys = first_keys if block_idx == 0 else ()
        parent = hash_block_tokens(parent, token_ids[start : start + block_size], extra_keys)
        new_hashes.append(parent)
    return new_hashes


def _length_prefixed(data: bytes) -> bytes:
    return struct.pack("<Q", len(data)) + data


def _encode_extra_key(key: object) -> bytes:
    if key is None:
        return _TAG_NONE
    if isinstance(key, str):
        # NOTE: surrogatepass keeps hashing total: a lone surrogate (refused at the edge, but
        # hashing runs inside the step) must never raise there.
        return _TAG_STR + _length_prefixed(key.encode("utf-8", "surrogatepass"))
    # NOTE: bool is an int subclass; it is encoded as 0/1 like the int it equals.
    if isinstance(key, int):
        return _TAG_INT + struct.pack("<q", key)
    if isinstance(key, bytes):
        return _TAG_BYTES + _length_prefixed(key)
    raise TypeError(f"extra key of unsupported type {type(key).__name__}: {key!r}")
