"""Rotary position embedding, neox style (rotate_half) as in HF Llama, by explicit positions.

A ragged batch mixes tokens of many sequences at unrelated positions, so cos/sin are precomputed
for every position up to max_position_embeddings and gathered per token rather than derived from
a [batch, seq] layout.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn


def compute_inv_freq(
    head_dim: int, rope_theta: float, rope_scaling: dict[str, Any] | None
) -> torch.Tensor:  # [head_dim // 2] float32
    """Inverse frequencies, bit-for-bit as transformers computes them for each rope type."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float) / head_dim
    inv_freq = 1.0 / (rope_theta**exponents)
    if rope_scaling is None:
        return inv_freq
    rope_type = rope_scaling["rope_type"]
    if rope_type == "linear":
        return inv_freq / rope_scaling["factor"]
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, rope_scaling)
    raise ValueError(f"unsupported rope type {rope_type!r}")


def _llama3_inv_freq(inv_freq: torch.Tensor, rope_scaling: dict[str, Any]) -> torch.Tensor:
    # Follows transformers' _compute_llama3_parameters step for step (same ops, same order), so
    # the frequencies match exactly: long wavelengths are divided by `factor`, short ones kept,
    # and the band between interpolated smoothly.
    factor = rope_scaling["factor"]
    low_freq_factor = rope_scaling["low_freq_factor"]
    high_freq_factor = rope_scaling["high_freq_factor"]
    old_context_len = rope_scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor

    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth_factor = (old_context_len / wavelen - low_freq_factor) / (
        high_freq_factor - low_freq_factor
    )
    smoothed_inv_freq = (
        1 - smooth_factor
    ) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
    is_medium_freq = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium_freq, smoothed_inv_freq, inv_freq_llama)


class RotaryEmbedding(nn.Module):
    """Rotates q and k by their token's position; one instance is shared by all layers."""

    cos_cache: torch.Tensor  # [max_pos, head_dim // 2], a buffer
    sin_cache: torch.Tensor

    def __init__(
        self,
        head_dim: int,
        max_position_embeddings: int,
        rope_theta: float,
        rope_scaling: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        inv_freq = compute_inv_freq(head_dim, rope_theta, rope_scaling)  # [head_dim // 2]
        positions = torch.arange(max_position_embeddings, dtype=torch.int64).float()
        freqs = torch.outer(positions, inv_freq.to(positions.device))  # [max_pos, head_dim // 2]
        # float32 like HF, cast to the activations' dtype at lookup as HF does before multiplying.
        self.register_buffer("cos_cache", freqs.cos(), persistent=False)
        self.register_buffer("sin_cache", freqs.sin(), persistent=False)
        self._positions: torch.Tensor | None = None
        self._cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None
        self._float32: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def forward(
        self,
        positions: torch.Tensor,  # [num_tokens] int64
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self._lookup(positions)
        return _rotate(query, cos, sin), _rotate(key, cos, sin)

    def rotate(
        self,
        positions: torch.Tensor,  # [num_tokens] int64
        heads: torch.Tensor,  # [num_tokens, num_heads, head_dim]: q and k heads side by side
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim], contiguous
        """Rotate several heads in one pass: q and k together when they sit side by side."""
        cos, sin = self._lookup(positions)
        return _rotate(heads, cos, sin)

    def float32_tables(self) -> tuple[torch.Tensor, torch.Tensor]:  # [max_pos, head_dim // 2]
        """cos and sin as contiguous float32 tables, made once (the C rotation's input). A model
        cast to bf16 holds its tables rounded to bf16, as HF's cast at lookup rounds them: the
        float32 copy keeps exactly those values."""
        # Keyed by the table itself: a later .to() (another device or dtype) replaces it.
        if self._float32 is None or self._float32[0] is not self.cos_cache:
            self._float32 = (
                self.cos_cache,
                self.cos_cache.float().contiguous(),
                self.sin_cache.float().contiguous(),
            )
        return self._float32[1], self._float32[2]

    def _lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # Every layer rotates by the same positions tensor: look the tables up once a forward.
        if positions is not self._positions or self._cos_sin is None:
            cos = self.cos_cache[positions].unsqueeze(1)  # [num_tokens, 1, head_dim // 2]
            sin = self.sin_cache[positions].unsqueeze(1)
            self._positions, self._cos_sin = positions, (cos, sin)
        return self._cos_sin


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # HF: x * cat(cos, cos) + rotate_half(x) * cat(sin, sin), rotate_half(x) = cat(-x2, x1).
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)  # [num_tokens, heads, head_dim // 2] each
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
