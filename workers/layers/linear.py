"""Megatron-style tensor-parallel linear layers that shard their weights as they load them.

Column-parallel layers split the output features across ranks and need no communication; a
row-parallel layer splits the input features and sums the partial products with one all-reduce.
Attention and MLP blocks pair them (column then row), so each block costs exactly one all-reduce.
"""

from __future__ import annotations

import abc
from typing import Protocol

import torch
from torch import nn

from pagedray.workers.layers.gemm import linear
from pagedray.workers.parallel_state import TensorParallelGroup
from pagedray.workers.weight_loader import WeightSource, copy_weight, full_weight, narrow_weight


class ProjectionDelta(Protocol):
    """What a projection adds to its output per token (LoRA adapters: workers/lora.py)."""

    def add_to(self, x: torch.Tensor, y: torch.Tensor) -> None: ...


def divide(numerator: int, denominator: int) -> int:
    if numerator % denominator != 0:
        raise ValueError(f"{numerator} is not divisible by tensor-parallel size {denominator}")
    return numerator // denominator


class LinearBase(nn.Module, abc.ABC):
    """A local [output_size, input_size] weight (already this rank's shard) and optional bias."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        tp: TensorParallelGroup,
        bias: bool,
        dtype: torch.dtype | None,
    ) -> None:
        super().__init__()
        self.tp = tp
        self.weight = nn.Parameter(torch.empty(output_size, input_size, dtype=dtype), False)
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        # Set by gemm.pack_module_weights once loaded: oneDNN's layout of `weight` on the CPU.
        self.packed_weight: torch.Tensor | None = None
        self.bias: nn.Parameter | None = None
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size, dtype=dtype), False)
            self.bias.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        # The LoRA adapters' deltas, where the engine serves adapters (workers/lora.py).
        self.lora: ProjectionDelta | None = None

    @abc.abstractmethod
    def weight_loader(
        self, param: nn.Parameter, loaded_weight: WeightSource, shard_id: object = None
    ) -> None:
        """Copy this rank's part of a checkpoint tensor into `param`: each layer knows its split."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = linear(x, self.weight, self.bias, self.packed_weight)
        if self.lora is not None:
            self.lora.add_to(x, y)
        return y


class ColumnParallelLinear(LinearBase):
    """y = x W^T with W's rows (output features) split evenly; each rank returns its slice."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        tp: TensorParallelGroup,
        bias: bool = False,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(input_size, divide(output_size, tp.world_size), tp, bias, dtype)

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: WeightSource, shard_id: object = None
    ) -> None:
        size = param.shape[0]
        copy_weight(param.data, narrow_weight(loaded_weight, 0, self.tp.rank * size, size))


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of one input fused into one matmul (gate and up).

    Each rank's weight is [shard of output 0; shard of output 1; ...], so splitting the local
    output by the local sizes gives the per-projection shards.
    """

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        tp: TensorParallelGroup,
        bias: bool = False,
        dtype: torch.dtype | None = None,
    ) -> None:
        self.output_sizes = list(output_sizes)
        super().__init__(input_size, sum(output_sizes), tp, bias, dtype)

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: WeightSource, shard_id: object = None
    ) -> None:
        if not isinstance(shard_id, int):
            raise TypeError(f"merged linear needs an integer shard id, got {shard_id!r}")
        local_sizes = [divide(size, self.tp.world_size) for size in self.output_sizes]
        offset, size = sum(local_sizes[:shard_id]), local_sizes[shard_id]
        shard = narrow_weight(loaded_weight, 0, self.tp.rank * size, size)
        copy_weight(param.data.narrow(0, offset, size), shard)


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections fused; query heads split across ranks, KV heads split or replicated.

    With num_kv_heads >= tp size each rank holds num_kv_heads / tp KV heads; with fewer KV heads
    than ranks each rank holds one, head `rank * num_kv_heads // tp`, which is the head its
    contiguous block of query heads groups onto.
    """

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        total_num_heads: int,
        total_num_kv_heads: int,
        tp: TensorParallelGroup,
        bias: bool = False,
        dtype: torch.dtype | None = None,
    ) -> None:
        world_size = tp.world_size
        self.head_dim = head_dim
        self.num_heads = divide(total_num_heads, world_size)
        if total_num_kv_heads >= world_size:
            self.num_kv_heads = divide(total_num_kv_heads, world_size)
            self.kv_head_start = tp.rank * self.num_kv_heads
        else:
            if world_size % total_num_kv_heads != 0:
                # Each KV head must serve a whole number of ranks to stay aligned with its queries.
                raise ValueError(
                    f"tensor-parallel size {world_size} is not a multiple of "
                    f"num_key_value_heads {total_num_kv_heads}"
                )
            self.num_kv_heads = 1
            self.kv_head_start = tp.rank * total_num_kv_heads // world_size
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        local_out = self.q_size + 2 * self.kv_size
        # Bypass ColumnParallelLinear's even split: the local size is already computed.
        LinearBase.__init__(self, hidden_size, local_out, tp, bias, dtype)

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: WeightSource, shard_id: object = None
    ) -> None:
        if shard_id == "q":
            offset, size, start = 0, self.q_size, self.tp.rank * self.q_size
        elif shard_id == "k":
            offset, size = self.q_size, self.kv_size
            start = self.kv_head_start * self.head_dim
        elif shard_id == "v":
            offset, size = self.q_size + self.kv_size, self.kv_size
            start = self.kv_head_start * self.head_dim
        else:
            raise ValueError(f"qkv shard id must be 'q', 'k' or 'v', got {shard_id!r}")
        copy_weight(
            param.data.narrow(0, offset, size), narrow_weight(loaded_weight, 0, start, size)
        )


class RowParallelLinear(LinearBase):
    """y = x W^T with W's columns (input features) split; partial sums all-reduced.

    The input arrives already split (the output of a column-parallel layer), and the bias is
    added once, after the reduction.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        tp: TensorParallelGroup,
        bias: bool = False,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(divide(input_size, tp.world_size), output_size, tp, bias, dtype)

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: WeightSource, shard_id: object = None
    ) -> None:
        if param.dim() == 1:  # bias: replicated
            copy_weight(param.data, full_weight(loaded_weight))
            return
        size = param.shape[1]
        copy_weight(param.data, narrow_weight(loaded_weight, 1, self.tp.rank * size, size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.world_size == 1:
            return super().forward(x)
        partial = linear(x, self.weight, None, self.packed_weight)
        if self.lora is not None:  # this rank's share of x A^T, times B: summed with the rest
            self.lora.add_to(x, partial)
        y = self.tp.all_reduce(partial)
        return y if self.bias is None else y + self.bias
