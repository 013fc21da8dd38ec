"""RMSNorm as HF Llama computes it, with the residual add folded in.

Normalising in float32 and multiplying by the weight only after casting back is what HF does;
doing it in another order changes bf16 outputs, so we keep its order exactly.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedray.workers.layers import cpu_ops


class RMSNorm(nn.Module):
    """y = weight * (x / rms(x)) over the last dim; replicated on every rank."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype: torch.dtype | None = None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        input_dtype = x.dtype
        x = x.to(torch.float32)
        variance = x.pow(2).mean(-1, keepdim=True)
        x = x * torch.rsqrt(variance + self.eps)
        return self.weight * x.to(input_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if cpu_ops.serves(x) and x.dtype == self.weight.dtype:
            return cpu_ops.rms_norm(x, self.weight, self.eps)[0]
        return self._norm(x)

    def add_and_norm(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual): the sum is the next block's residual."""
        if cpu_ops.serves(x) and x.dtype == residual.dtype == self.weight.dtype:
            normed, summed = cpu_ops.rms_norm(x, self.weight, self.eps, residual)
            assert summed is not None
            return normed, summed
        x = x + residual
        return self._norm(x), x
