"""LoRA adapters on one rank: the projections' low-rank deltas, in `max_loras` slots.

Every projection an adapter may target (q, k, v, o, gate, up, down) keeps, per slot, A
[parts * R, in] and B [out, parts * R], R = `max_lora_rank`: a fused projection (qkv,
gate_up) puts each part's A rows after the one before's and each part's B on that part's own
output rows, so one pair of matmuls gives the whole fused delta. A smaller rank fills the first
rows and leaves zeros; a part the adapter does not target stays zero. Sharded as the weight
is: a column-parallel projection keeps its rows of B, a row-parallel one its columns of A, and
its partial delta joins the all-reduce the projection makes anyway. B is stored multiplied by
the adapter's scaling.

Each step the model runner says which slot each token's sequence uses (`LoRAStep`); tokens
of the base model get no delta, and a step of base tokens alone costs nothing.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file
from torch import nn

from pagedray.scheduler.messages import LoRALoad
from pagedray.workers.layers.linear import (
    LinearBase,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from pagedray.workers.lora_checkpoint import ADAPTER_WEIGHTS, read_adapter, tensor_module
from pagedray.workers.model_config import ModelConfig
from pagedray.workers.parallel_state import TensorParallelGroup

logger = logging.getLogger(__name__)

_QKV_PARTS = {"q": 0, "k": 1, "v": 2}


class LoRAStep:
    """Which tokens of this step run with which slot: (slot, token rows or None for all)."""

    def __init__(self) -> None:
        self.groups: list[tuple[int, torch.Tensor | None]] = []

    def set(self, token_slots: np.ndarray, device: torch.device) -> None:
        """`token_slots[i]`: the slot of token i's adapter, -1 for the base model."""
        slots = np.unique(token_slots)
        slots = slots[slots >= 0]
        if len(slots) == 1 and len(slots) == len(np.unique(token_slots)):
            self.groups = [(int(slots[0]), None)]  # every token, one adapter: no gathers
            return
        self.groups = [
            (int(slot), torch.from_numpy(np.flatnonzero(token_slots == slot)).to(device))
            for slot in slots
        ]

    def clear(self) -> None:
        self.groups = []


class LoRAStack:
    """One projection's adapters, one per slot, added to its output (`LinearBase.lora`)."""

    def __init__(
        self, layer: LinearBase, parts: int, max_loras: int, max_rank: int, step: LoRAStep
    ) -> None:
        out_features, in_features = layer.weight.shape
        dtype, device = layer.weight.dtype, layer.weight.device
        self.layer = layer
        self.max_rank = max_rank
        self.step = step
        self.a = torch.zeros(max_loras, parts * max_rank, in_features, dtype=dtype, device=device)
        self.b = torch.zeros(max_loras, out_features, parts * max_rank, dtype=dtype, device=device)
        self.filled: set[int] = set()  # slots whose adapter targets this projection

    def add_to(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """y += x A^T B^T for each token, with its own slot's A and B."""
        for slot, rows in self.step.groups:
            if slot not in self.filled:
                continue
            a, b = self.a[slot], self.b[slot]
            if rows is None:
                y.add_(torch.mm(torch.mm(x, a.t()), b.t()))
            else:
                y.index_add_(0, rows, torch.mm(torch.mm(x[rows], a.t()), b.t()))

    def clear(self, slot: int) -> None:
        self.a[slot].zero_()
        self.b[slot].zero_()
        self.filled.discard(slot)

    def set_part(
        self, slot: int, shard_id: Any, part: int, a: torch.Tensor, b: torch.Tensor
    ) -> None:
        """One part's full (unsharded) A [r, in] and scaled B [out, r], into `slot`."""
        rank = a.shape[0]
        rows = slice(part * self.max_rank, part * self.max_rank + rank)
        a_slot, b_slot = self.a[slot, rows], self.b[slot, :, rows]
        if isinstance(self.layer, RowParallelLinear):  # A's columns split, as the weight's
            self.layer.weight_loader(a_slot, a)  # type: ignore[arg-type]
            b_slot.copy_(b)
        else:  # B's rows split, as the weight's (and placed as the fused part's)
            a_slot.copy_(a)
            self.layer.weight_loader(b_slot, b, shard_id)  # type: ignore[arg-type]
        self.filled.add(slot)


class WorkerLoRA:
    """A rank's LoRA slots over every projection of its model shard."""

    def __init__(
        self, model: nn.Module, model_config: ModelConfig, max_loras: int, max_rank: int
    ) -> None:
        self.model_config = model_config
        self.max_rank = max_rank
        self.tp: TensorParallelGroup = model.tp  # type: ignore[assignment]
        self.device = next(model.parameters()).device
        self.step = LoRAStep()
        # Checkpoint projection -> (its stack, the fused parameter's shard id, part index).
        self._targets: dict[str, tuple[LoRAStack, Any, int]] = {}
        packed: dict[str, tuple[str, Any]] = getattr(model, "packed_modules_mapping", {})
        fused_of = {fused: [] for fused, _ in packed.values()}  # type: dict[str, list[str]]
        for hf_name, (fused, _) in packed.items():
            fused_of[fused].append(hf_name)
        for name, module in model.named_modules():
            if not isinstance(module, LinearBase) or ".layers." not in name:
                continue
            prefix, leaf = name.rsplit(".", 1)
            parts = fused_of.get(leaf, [leaf])
            stack = LoRAStack(module, len(parts), max_loras, max_rank, self.step)
            module.lora = stack
            for hf_name in parts:
                shard_id = packed[hf_name][1] if hf_name in packed else None
                part = _part_index(module, shard_id)
                self._targets[f"{prefix}.{hf_name}"] = (stack, shard_id, part)

    def load_all(self, loads: list[LoRALoad]) -> dict[int, str]:
        """The plan's loads, in order; the slots left empty because a load failed on some rank,
        by slot: the adapter's name. A file that cannot be read fails the requests waiting for
        that adapter, not the engine (it was checked when named; it may since be gone, or
        absent from another node). Collective at TP > 1: every rank reads the same answer."""
        ok = []
        for load in loads:
            try:
                self.load(load)
                ok.append(1)
            except Exception:  # noqa: BLE001 - one adapter's file is its requests' failure
                logger.exception("LoRA adapter %r (%s) could not be loaded", load.name, load.path)
                self._clear(load.slot)
                ok.append(0)
        if self.tp.world_size > 1:
            agreed = self.tp.all_reduce(torch.tensor(ok, dtype=torch.int32, device=self.device))
            ok = [int(count == self.tp.world_size) for count in agreed.tolist()]
        failed: dict[int, str] = {}
        for load, loaded in zip(loads, ok):  # a slot's last load decides it
            if loaded:
                failed.pop(load.slot, None)
            else:
                self._clear(load.slot)
                failed[load.slot] = load.name
        return failed

    def _clear(self, slot: int) -> None:
        for stack, _, _ in self._targets.values():
            stack.clear(slot)

    def load(self, load: LoRALoad) -> None:
        """Put the adapter at `load.path` into `load.slot` (replacing what the slot held)."""
        adapter = read_adapter(load.name, load.path, self.model_config, self.max_rank)
        tensors = load_file(f"{adapter.path}/{ADAPTER_WEIGHTS}")
        pairs: dict[str, dict[str, torch.Tensor]] = {}
        for tensor_name, tensor in tensors.items():
            found = tensor_module(tensor_name)
            assert found is not None, tensor_name  # read_adapter checked every name
            module, kind = found
            pairs.setdefault(module, {})[kind] = tensor
        self._clear(load.slot)
        dtype = next(iter(self._targets.values()))[0].a.dtype
        for module, pair in pairs.items():
            stack, shard_id, part = self._targets[module]
            a = pair["lora_A"].to(dtype)
            b = (pair["lora_B"].float() * adapter.scaling).to(dtype)
            stack.set_part(load.slot, shard_id, part, a, b)


def _part_index(layer: LinearBase, shard_id: Any) -> int:
    if isinstance(layer, QKVParallelLinear):
        return _QKV_PARTS[shard_id]
    if isinstance(layer, MergedColumnParallelLinear):
        return int(shard_id)
    return 0
