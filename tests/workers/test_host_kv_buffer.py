"""A rank's copies between its KV pool and the host tier: bit-identical, each rank in its own
part of a slot, and a tier file per model layout and arithmetic."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pagedray.scheduler.host_kv_tier import create_or_open
from pagedray.workers.host_kv_buffer import HostKVBuffer, open_tier, tier_bytes, tier_path

# [layers, K/V, blocks, block size, heads, head dim]
SHAPE = (3, 2, 10, 4, 2, 8)


def pool(dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(seed)).to(dtype)


def tier_for(tmp_path: Path, kv_cache: torch.Tensor, tp: int, num_slots: int = 6) -> str:
    slot_bytes = kv_cache[:, :, 0].numel() * kv_cache.element_size() * tp
    path = str(tmp_path / "tier")
    create_or_open(path, num_slots, slot_bytes)
    return path


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_blocks_come_back_bit_identical(tmp_path: Path, dtype: torch.dtype) -> None:
    source, target = pool(dtype, 0), torch.zeros(SHAPE, dtype=dtype)
    buffer = HostKVBuffer(tier_for(tmp_path, source, tp=1), 0, 1, source)
    buffer.save(source, [(7, 0), (2, 5), (9, 3)])
    buffer.load(target, [(5, 1), (0, 4), (3, 8)])
    for src, dst in [(2, 1), (7, 4), (9, 8)]:
        assert torch.equal(target[:, :, dst], source[:, :, src])
    untouched = [b for b in range(SHAPE[2]) if b not in (1, 4, 8)]
    assert not target[:, :, untouched].any()


def test_each_rank_keeps_its_own_shard_of_a_slot(tmp_path: Path) -> None:
    shards = [pool(torch.float32, rank) for rank in range(2)]
    path = tier_for(tmp_path, shards[0], tp=2)
    buffers = [HostKVBuffer(path, rank, 2, shards[rank]) for rank in range(2)]
    for rank in range(2):
        buffers[rank].save(shards[rank], [(3, 1)])
    # Reopened, as a restarted rank would.
    for rank in range(2):
        target = torch.zeros(SHAPE)
        HostKVBuffer(path, rank, 2, target).load(target, [(1, 0)])
        assert torch.equal(target[:, :, 0], shards[rank][:, :, 3])


def test_a_buffer_refuses_a_tier_of_another_block_size(tmp_path: Path) -> None:
    kv_cache = pool(torch.float32, 0)
    path = tier_for(tmp_path, kv_cache, tp=2)
    with pytest.raises(ValueError, match="slots of"):
        HostKVBuffer(path, 0, 1, kv_cache)


def test_each_model_layout_and_arithmetic_has_its_own_tier(tmp_path: Path, tiny_llama: str) -> None:
    """The tier file outlives its engines: one computed by another build or setting must not
    hand its blocks to a stream that goes on token-exact."""
    shape = (3, 2, 4, 2, 8)
    exact = "cpu exact rows, kernels k1, torch 2.13.0"
    base = tier_path(tiny_llama, torch.float32, shape, 1, exact)
    assert base == tier_path(tiny_llama, torch.float32, shape, 1, exact)
    others = {
        tier_path(tiny_llama, torch.bfloat16, shape, 1, exact),
        tier_path(tiny_llama, torch.float32, (3, 2, 16, 2, 8), 1, exact),
        tier_path(tiny_llama, torch.float32, shape, 2, exact),
        tier_path(str(tmp_path), torch.float32, shape, 1, exact),
        tier_path(tiny_llama, torch.float32, shape, 1, "cpu by path, kernels k1, torch 2.13.0"),
        tier_path(tiny_llama, torch.float32, shape, 1, "cpu exact rows, kernels k2, torch 2.13.0"),
    }
    assert base not in others and len(others) == 6


def test_the_size_is_as_asked_or_a_share_of_free_memory(tmp_path: Path) -> None:
    assert tier_bytes(0, tmp_path) == 0
    assert tier_bytes(0.5, tmp_path) == 2**29
    assert 0 < tier_bytes(None, tmp_path) <= 8 * 2**30


def test_opening_a_tier_names_what_the_others_hold(
    tmp_path: Path, tiny_llama: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Another build's tier file stays in /dev/shm: the log says how much it holds."""
    (tmp_path / "pagedray-kv-0123456789abcdef-0123456789ab.tier").write_bytes(b"x" * 65536)
    with caplog.at_level("WARNING"):
        opened = open_tier(tiny_llama, 0.001, 0, 1, pool(torch.float32, 0), "k", tmp_path)
    assert opened is not None
    assert "1 other KV tier files" in caplog.text
