"""Prefix hashes must be deterministic, chained, incremental and separated by cache salt."""

from __future__ import annotations

import hashlib
import struct
import subprocess
import sys

import pytest

from pagedray.scheduler.prefix_hash import compute_block_hashes, hash_block_tokens


def test_hash_is_sha256_digest_and_deterministic() -> None:
    first = hash_block_tokens(None, [1, 2, 3, 4])
    assert isinstance(first, bytes) and len(first) == hashlib.sha256().digest_size
    assert hash_block_tokens(None, [1, 2, 3, 4]) == first
    assert hash_block_tokens(None, [1, 2, 3, 5]) != first
    assert hash_block_tokens(None, [4, 3, 2, 1]) != first


def test_hash_is_stable_across_processes() -> None:
    # A fresh interpreter has a different str-hash seed; the digest must not change.
    code = (
        "from pagedray.scheduler.prefix_hash import hash_block_tokens as h;"
        "print(h(h(None, [7, 8], ('salt',)), [9, 10], ('x', 3, None, b'k')).hex())"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.strip()
    local = hash_block_tokens(
        hash_block_tokens(None, [7, 8], ("salt",)), [9, 10], ("x", 3, None, b"k")
    )
    assert out == local.hex()


def test_parent_and_extra_keys_change_the_hash() -> None:
    root = hash_block_tokens(None, [1, 2])
    assert hash_block_tokens(root, [3, 4]) != hash_block_tokens(None, [3, 4])
    assert hash_block_tokens(None, [1, 2], ("a",)) != root
    assert hash_block_tokens(None, [1, 2], ("a",)) != hash_block_tokens(None, [1, 2], ("b",))
    # Typed, length-prefixed keys: no ambiguity between "1" and 1, or ("ab",) and ("a", "b").
    assert hash_block_tokens(None, [1], ("1",)) != hash_block_tokens(None, [1], (1,))
    assert hash_block_tokens(None, [1], ("ab",)) != hash_block_tokens(None, [1], ("a", "b"))
    # Large and negative token ids are packed as int64, not truncated.
    assert hash_block_tokens(None, [2**40]) != hash_block_tokens(None, [0])
    assert hash_block_tokens(None, [-1]) != hash_block_tokens(None, [2**63 - 1])


def test_unsupported_extra_key_type_is_rejected() -> None:
    with pytest.raises(TypeError):
        hash_block_tokens(None, [1], (1.5,))


def test_compute_block_hashes_only_full_blocks_and_chained() -> None:
    tokens = list(range(10))
    hashes = compute_block_hashes(tokens, 4, None, [])
    assert len(hashes) == 2  # tokens 8, 9 form a partial block: not hashed
    assert hashes[0] == hash_block_tokens(None, [0, 1, 2, 3])
    assert hashes[1] == hash_block_tokens(hashes[0], [4, 5, 6, 7])


def test_compute_block_hashes_is_incremental() -> None:
    tokens = list(range(6))
    existing = compute_block_hashes(tokens, 4, "t", [])
    assert len(existing) == 1
    tokens += [6, 7, 8, 9, 10, 11]
    more = compute_block_hashes(tokens, 4, "t", existing)
    assert len(more) == 2
    assert existing + more == compute_block_hashes(tokens, 4, "t", [])
    assert compute_block_hashes(tokens, 4, "t", existing + more) == []


def test_cache_salt_changes_every_block() -> None:
    tokens = list(range(12))
    plain = compute_block_hashes(tokens, 4, None, [])
    salted_a = compute_block_hashes(tokens, 4, "tenant-a", [])
    salted_b = compute_block_hashes(tokens, 4, "tenant-b", [])
    for a, b, c in zip(plain, salted_a, salted_b):
        assert len({a, b, c}) == 3
    # The salt enters the first block only; later blocks differ through the chain.
    assert salted_a[1] == hash_block_tokens(salted_a[0], [4, 5, 6, 7])
    assert salted_a[0] == hash_block_tokens(None, [0, 1, 2, 3], ("tenant-a",))


def test_token_packing_matches_int64() -> None:
    # Pin the encoding so a refactor cannot silently change every hash (cache keys on disk/logs).
    expected = hashlib.sha256()
    marker = b"pagedray/root/v1"
    expected.update(struct.pack("<Q", len(marker)) + marker)
    expected.update(struct.pack("<Q", 2) + struct.pack("<2q", 5, 6))
    expected.update(struct.pack("<Q", 0))
    assert hash_block_tokens(None, [5, 6]) == expected.digest()


def test_a_lone_surrogate_salt_hashes_instead_of_raising() -> None:
    """Hashing runs inside the engine step: it must be total over every str, even invalid
    Unicode (refused at the edge), and keep such a salt apart from every other."""
    odd = compute_block_hashes(list(range(8)), 4, "\ud800", [])
    assert len(odd) == 2
    assert odd != compute_block_hashes(list(range(8)), 4, "\ud801", [])
    assert odd != compute_block_hashes(list(range(8)), 4, None, [])
