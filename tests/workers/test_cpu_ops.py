"""The C element-wise ops against the torch code they replace, for any shape hypothesis finds.

Every bf16 rounding step of the torch code is mirrored, so the rotation, the K/V store and the
residual sum are bit-exact in bf16; the norm and SiLU may land one bf16 step away where a float32
intermediate differs in its last bit. float32 results agree within rounding."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedray.attention import cpu_kernels, torch_ref
from pagedray.workers.layers import cpu_ops
from pagedray.workers.layers.norm import RMSNorm
from pagedray.workers.layers.rotary import RotaryEmbedding, _rotate

pytestmark = pytest.mark.skipif(
    not cpu_kernels.available(), reason="no working C compiler: the CPU kernels cannot be built"
)
DTYPES = st.sampled_from([torch.float32, torch.bfloat16])


def _check(got: torch.Tensor, want: torch.Tensor, exact_bf16: bool = True) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    if want.dtype == torch.bfloat16 and exact_bf16:
        assert torch.equal(got, want)
    elif want.dtype == torch.bfloat16:
        # A float32 intermediate a last bit apart from torch's (a sum in another order, an
        # exponential other than Sleef's) can round to a neighbouring bf16: a step or two.
        torch.testing.assert_close(got, want, atol=1e-6, rtol=2**-6)
    else:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(0, 40), hidden=st.integers(1, 300), dtype=DTYPES, seed=st.integers(0, 99))
def test_add_rms_norm_matches_torch(rows: int, hidden: int, dtype: torch.dtype, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    norm = RMSNorm(hidden, 1e-5, dtype)
    norm.weight.data = (torch.rand(hidden, generator=gen) + 0.5).to(dtype)
    x = (torch.randn(rows, hidden, generator=gen) * 3).to(dtype)
    residual = torch.randn(rows, hidden, generator=gen).to(dtype)
    normed, summed = cpu_ops.rms_norm(x, norm.weight, norm.eps, residual)
    assert summed is not None
    _check(summed, x + residual)
    _check(normed, norm._norm(x + residual), exact_bf16=False)
    _check(cpu_ops.rms_norm(x, norm.weight, norm.eps)[0], norm._norm(x), exact_bf16=False)
    # The module takes the C path for what it serves: same answers.
    _check(norm.add_and_norm(x, residual)[0], norm._norm(x + residual), exact_bf16=False)


def test_rms_norm_reads_strided_rows() -> None:
    wide = torch.randn(6, 96)
    x = wide[:, :64]  # rows 96 apart
    norm = RMSNorm(64)
    _check(cpu_ops.rms_norm(x, norm.weight, norm.eps)[0], norm._norm(x))


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(0, 40), inter=st.integers(1, 200), dtype=DTYPES, seed=st.integers(0, 99))
def test_silu_mul_matches_torch(rows: int, inter: int, dtype: torch.dtype, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    gate_up = (torch.randn(rows, 2 * inter, generator=gen) * 4).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    _check(cpu_ops.silu_mul(gate_up), F.silu(gate) * up, exact_bf16=False)


@settings(max_examples=30, deadline=None)
@given(
    tokens=st.integers(1, 24),
    kv_heads=st.integers(1, 3),
    group=st.integers(1, 3),
    head_dim=st.sampled_from([8, 64, 80, 128]),
    dtype=DTYPES,
    seed=st.integers(0, 99),
)
def test_rope_and_store_matches_rotate_then_store(
    tokens: int, kv_heads: int, group: int, head_dim: int, dtype: torch.dtype, seed: int
) -> None:
    gen = torch.Generator().manual_seed(seed)
    heads, block_size, num_blocks = kv_heads * group, 4, 16
    rotary = RotaryEmbedding(head_dim, 512, 10000.0)
    positions = torch.randint(0, 512, (tokens,), generator=gen)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    slots[torch.rand(tokens, generator=gen) < 0.2] = -1  # padding rows store nothing
    shape = (num_blocks, block_size, kv_heads, head_dim)
    want_k, want_v = torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)
    got_k, got_v = torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)

    cos, sin = rotary.cos_cache[positions].unsqueeze(1), rotary.sin_cache[positions].unsqueeze(1)
    qk = _rotate(qkv[:, : (heads + kv_heads) * head_dim].view(tokens, -1, head_dim), cos, sin)
    v = qkv[:, (heads + kv_heads) * head_dim :].view(tokens, kv_heads, head_dim)
    torch_ref.store_kv(qk[:, heads:], v, want_k, want_v, slots)

    q = cpu_ops.rope_and_store(
        qkv.clone(), heads, kv_heads, head_dim, positions,
        rotary.cos_cache, rotary.sin_cache, got_k, got_v, slots,
    )  # fmt: skip
    _check(q, qk[:, :heads])
    _check(got_k, want_k)
    _check(got_v, want_v)


def test_serves_only_what_the_kernels_take() -> None:
    assert cpu_ops.serves(torch.randn(3, 8))
    assert cpu_ops.serves(torch.randn(3, 8, dtype=torch.bfloat16))
    assert not cpu_ops.serves(torch.randn(3, 8, dtype=torch.float16))
    assert not cpu_ops.serves(torch.randn(2, 3, 8))  # 3-D: the torch code
    assert not cpu_ops.serves(torch.randn(8, 3).t())  # columns not contiguous


def test_rope_refuses_a_position_past_its_tables() -> None:
    rotary = RotaryEmbedding(8, 16, 10000.0)
    qkv = torch.randn(2, 3 * 8)
    caches = torch.zeros(4, 4, 1, 8), torch.zeros(4, 4, 1, 8)
    positions, slots = torch.tensor([3, 16]), torch.tensor([0, 1])
    with pytest.raises(ValueError, match="outside the rotary tables"):
        cpu_ops.rope_and_store(
            qkv, 1, 1, 8, positions, rotary.cos_cache, rotary.sin_cache, *caches, slots
        )
    assert not caches[0].any()  # nothing written
