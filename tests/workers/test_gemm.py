"""The CPU GEMM dispatcher: oneDNN where it serves, F.linear elsewhere; fp32 up to rounding."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedray.workers.layers import gemm


@settings(max_examples=25, deadline=None)
@given(
    rows=st.integers(0, 70),
    in_features=st.integers(1, 300),
    out_features=st.integers(1, 300),
    with_bias=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_fp32_matches_float64_reference(
    rows: int, in_features: int, out_features: int, with_bias: bool, seed: int
) -> None:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, in_features, generator=generator)
    weight = torch.randn(out_features, in_features, generator=generator)
    bias = torch.randn(out_features, generator=generator) if with_bias else None
    with torch.inference_mode():
        got = gemm.linear(x, weight, bias)
    want = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    assert got.dtype == torch.float32 and got.shape == want.shape
    # fp32 accumulation over in_features products of N(0, 1) values: rounding only.
    torch.testing.assert_close(got.double(), want, atol=2e-6 * in_features, rtol=1e-5)


def test_strided_input_and_3d_input() -> None:
    weight = torch.randn(48, 32)
    wide = torch.randn(5, 64)[:, :32]  # a column slice: rows not contiguous
    torch.testing.assert_close(gemm.linear(wide, weight), F.linear(wide, weight))
    batched = torch.randn(2, 3, 32)  # not 2-D: served by F.linear
    torch.testing.assert_close(gemm.linear(batched, weight), F.linear(batched, weight))


def test_fp32_goes_through_onednn_on_this_machine() -> None:
    if not torch.backends.mkldnn.is_available():
        pytest.skip("torch built without oneDNN")
    assert torch.float32 in gemm._onednn_dtypes()


def test_env_forces_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    gemm._onednn_dtypes.cache_clear()
    monkeypatch.setenv("PAGEDRAY_CPU_GEMM", "torch")
    try:
        assert gemm._onednn_dtypes() == frozenset()
        x, weight = torch.randn(3, 8), torch.randn(4, 8)
        assert torch.equal(gemm.linear(x, weight), F.linear(x, weight))
    finally:
        gemm._onednn_dtypes.cache_clear()


def test_bf16_close_to_fp32() -> None:
    x, weight = torch.randn(16, 64), torch.randn(32, 64)
    got = gemm.linear(x.bfloat16(), weight.bfloat16())
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), F.linear(x, weight), atol=0.5, rtol=0.05)
