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


def test_packed_weight_gives_the_same_products() -> None:
    weight, bias = torch.randn(96, 48), torch.randn(96)
    packed = gemm.pack(weight)
    if packed is None:
        pytest.skip("oneDNN does not serve float32 here")
    for rows in (1, 4, 33):
        x = torch.randn(rows, 48)
        torch.testing.assert_close(
            gemm.linear(x, torch.empty(0), bias, packed), F.linear(x, weight, bias)
        )
    batched = torch.randn(2, 3, 48)  # not 2-D: unpacked on the spot, still right
    torch.testing.assert_close(
        gemm.linear(batched, torch.empty(0), None, packed), F.linear(batched, weight)
    )


def test_pack_module_weights_releases_only_unshared_weights() -> None:
    if gemm.pack(torch.randn(4, 4)) is None:
        pytest.skip("oneDNN does not serve float32 here")

    class Projection(torch.nn.Module):
        def __init__(self, weight: torch.nn.Parameter) -> None:
            super().__init__()
            self.weight = weight
            self.packed_weight: torch.Tensor | None = None

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return gemm.linear(x, self.weight, None, self.packed_weight)

    shared = torch.nn.Parameter(torch.randn(8, 16), requires_grad=False)
    model = torch.nn.Module()
    model.own = Projection(torch.nn.Parameter(torch.randn(8, 16), requires_grad=False))
    model.embedding = torch.nn.Embedding(8, 16)
    model.embedding.weight = shared
    model.tied = Projection(shared)  # as a tied LM head shares the embedding's weight
    x = torch.randn(3, 16)
    before = {name: getattr(model, name)(x) for name in ("own", "tied")}
    assert gemm.pack_module_weights(model) == 2
    assert model.own.weight.numel() == 0  # released: the packed copy serves
    assert model.tied.weight.shape == (8, 16)  # the embedding still reads it
    for name, want in before.items():
        torch.testing.assert_close(getattr(model, name)(x), want)


def test_warm_up_runs_each_packed_shape_once_per_row_count() -> None:
    if gemm.pack(torch.randn(4, 4)) is None:
        pytest.skip("oneDNN does not serve float32 here")
    model = torch.nn.Module()
    for name, shape in (("a", (8, 16)), ("b", (8, 16)), ("c", (24, 8))):  # a and b: one shape
        module = torch.nn.Module()
        module.weight = torch.nn.Parameter(torch.randn(*shape), requires_grad=False)
        module.packed_weight = None
        setattr(model, name, module)
    assert gemm.warm_up(model, 5, 60.0) == 0  # nothing packed yet
    gemm.pack_module_weights(model)
    assert gemm.warm_up(model, 5, 60.0) == 2 * 5
    assert gemm.warm_up(model, 5, 0.0) == 0  # no time: nothing
