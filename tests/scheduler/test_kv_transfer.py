"""Which engines may hand each other blocks (scheduler/kv_transfer.py): those whose tier files
have one name, that is one model layout and one arithmetic, on whatever node."""

from __future__ import annotations

from pathlib import Path

import torch

from pagedray.scheduler.kv_transfer import TierAddress
from pagedray.workers.host_kv_buffer import tier_path


def test_engines_share_blocks_only_with_one_arithmetic(tiny_llama: str, tmp_path: Path) -> None:
    shape = (3, 2, 4, 2, 8)

    def address(node: str, arithmetic: str, directory: str, model: str = tiny_llama) -> TierAddress:
        path = tier_path(model, torch.float32, shape, 1, arithmetic, Path(directory))
        return TierAddress(node, str(path))

    here = address("node-a", "cpu exact rows, kernels k1", "/dev/shm")
    assert here.same_blocks_as(address("node-a", "cpu exact rows, kernels k1", "/dev/shm"))
    # Another node, the model and its tier elsewhere: the same bits, sent as bytes.
    elsewhere = address("node-b", "cpu exact rows, kernels k1", "/tmp", str(tmp_path))
    assert here.same_blocks_as(elsewhere) and here.path != elsewhere.path
    assert not here.same_blocks_as(address("node-a", "cpu by path, kernels k1", "/dev/shm"))
    assert not here.same_blocks_as(address("node-b", "cpu exact rows, kernels k2", "/tmp"))
