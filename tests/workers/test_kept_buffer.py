"""The kept scratch tensor (workers/kept_buffer.py): reused while a step fits it, made anew only
when a step needs more rows or another width, dtype or device."""

from __future__ import annotations

import torch

from pagedray.workers.kept_buffer import KeptBuffer

CPU = torch.device("cpu")


def test_rows_reuse_one_storage_until_a_step_needs_more() -> None:
    kept = KeptBuffer()
    first = kept.rows(4, 10, torch.float32, CPU)
    assert first.shape == (4, 10) and first.is_contiguous()
    smaller = kept.rows(2, 10, torch.float32, CPU)
    assert smaller.shape == (2, 10) and smaller.is_contiguous()
    assert smaller.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
    grown = kept.rows(6, 10, torch.float32, CPU)
    assert grown.shape == (6, 10)
    assert grown.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
    again = kept.rows(3, 10, torch.float32, CPU)
    assert again.untyped_storage().data_ptr() == grown.untyped_storage().data_ptr()


def test_another_width_or_dtype_gets_a_tensor_of_its_own() -> None:
    kept = KeptBuffer()
    kept.rows(4, 10, torch.float32, CPU)
    wider = kept.rows(2, 12, torch.float32, CPU)
    assert wider.shape == (2, 12) and wider.is_contiguous()
    other = kept.rows(2, 12, torch.bfloat16, CPU)
    assert other.dtype == torch.bfloat16 and other.shape == (2, 12)
