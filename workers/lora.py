"""LoRA adapters on one rank: the projections' low-rank deltas, in `max_loras` slots.

Every projection an adapter may target (q, k, v, o, gate, up, down) keeps, per slot, A
[parts * R, in] and B [out, parts * R], R = `max_lora_rank`: a fused projection (qkv,
gate_up) puts each part's A rows after the one before's and each part's B on that part's own
output rows, so one pair of matmuls gives the whole fused delta. A smaller rank fills the first
rows and leaves zeros; a part the adapter does not target stays zero. Sharded as the weight
is: a column-parallel projection keeps its rows of B, a row-parallel one its columns of A, and
its partial delta joins the all-reduce the projection makes anyway. B is stored multiplied by
the adapter's scaling.

The slots sit side by side (A [slots * parts * R, in], B [out, slots * parts * R]), and a step
computes every token against all of them, zeroing the columns of the slots that are not its
own between the two products (`LoRAStep`): three operations per projection whatever the mix of
adapters in the step, every GEMM of the same shape but its rows, so a token's bits do not
depend on its neighbours (as the base GEMMs' do not: tests/engine/test_exact_rows.py), and a
base-model token gets an exact zero. A step of base-model tokens alone skips it all.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file
from torch import nn

from pagedray.scheduler.messages import LoRALoad
from pagedray.workers.layers.gemm import linear, pack
from pagedray.workers.layers.linear import (
    LinearBase,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from pagedray.workers.lora_checkpoint import (
    ADAPTER_WEIGHTS,
    adapter_key,
    read_adapter,
    tensor_module,
)
from pagedray.workers.model_config import ModelConfig
from pagedray.workers.parallel_state import TensorParallelGroup

logger = logging.getLogger(__name__)

_QKV_PARTS = {"q": 0, "k": 1, "v": 2}


class LoRAStep:
    """Which slot each token of this step runs with, as the masks the stacks multiply by."""

    def __init__(self, max_loras: int, dtype: torch.dtype, device: torch.device) -> None:
        self.max_loras = max_loras
        self.dtype, self.device = dtype, device
        self.active = False  # some token runs with an adapter
        self._others: torch.Tensor | None = None  # [tokens, slots]: True where not its slot
        self._masks: dict[int, torch.Tensor] = {}  # rows per slot -> [tokens, slots * rows]

    def set(self, token_slots: np.ndarray) -> None:
        """`token_slots[i]`: the slot of token i's adapter, -1 for the base model."""
        adapted = np.flatnonzero(token_slots >= 0)
        self.active = len(adapted) > 0
        self._masks = {}
        if not self.active:
            return
        others = np.ones((len(token_slots), self.max_loras), dtype=np.bool_)
        others[adapted, token_slots[adapted]] = False
        self._others = torch.from_numpy(others).to(self.device)

    def mask(self, rows_per_slot: int) -> torch.Tensor:
        """[tokens, slots * rows_per_slot]: True in the columns of slots not the token's own."""
        mask = self._masks.get(rows_per_slot)
        if mask is None:
            assert self._others is not None
            mask = self._others.repeat_interleave(rows_per_slot, dim=1)
            self._masks[rows_per_slot] = mask
        return mask


class LoRAStack:
    """One projection's adapters, one per slot, added to its output (`LinearBase.lora`)."""

    def __init__(
        self, layer: LinearBase, parts: int, max_loras: int, max_rank: int, step: LoRAStep
    ) -> None:
        out_features, in_features = layer.weight.shape
        dtype, device = layer.weight.dtype, layer.weight.device
        self.layer = layer
        self.max_rank = max_rank
        self.rows_per_slot = parts * max_rank
        self.step = step
        columns = max_loras * self.rows_per_slot
        self.a = torch.zeros(columns, in_features, dtype=dtype, device=device)
        self.b = torch.zeros(out_features, columns, dtype=dtype, device=device)
        self._packed: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None)
        self.filled: set[int] = set()  # slots whose adapter targets this projection

    def add_to(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """y += x A^T B^T for each token, with its own slot's A and B."""
        if not self.step.active or not self.filled:
            return
        packed_a, packed_b = self._packed
        xa = linear(x, self.a, None, packed_a)  # [tokens, slots * rows]: every slot's
        # Each token's own slot only: filled, not multiplied, so that another slot's overflow
        # (fp16) cannot reach it as 0 * inf; B is finite (checked at load), so the other
        # slots then add an exact 0.
        xa.masked_fill_(self.step.mask(self.rows_per_slot), 0)
        y.add_(linear(xa, self.b, None, packed_b))

    def clear(self, slot: int) -> None:
        columns = self._slot_columns(slot)
        self.a[columns].zero_()
        self.b[:, columns].zero_()
        self.filled.discard(slot)

    def set_part(
        self, slot: int, shard_id: Any, part: int, a: torch.Tensor, b: torch.Tensor
    ) -> None:
        """One part's full (unsharded) A [r, in] and scaled B [out, r], into `slot`."""
        start = self._slot_columns(slot).start + part * self.max_rank
        rows = slice(start, start + a.shape[0])
        a_slot, b_slot = self.a[rows], self.b[:, rows]
        if isinstance(self.layer, RowParallelLinear):  # A's columns split, as the weight's
            self.layer.weight_loader(a_slot, a)  # type: ignore[arg-type]
            b_slot.copy_(b)
        else:  # B's rows split, as the weight's (and placed as the fused part's)
            a_slot.copy_(a)
            self.layer.weight_loader(b_slot, b, shard_id)  # type: ignore[arg-type]
        self.filled.add(slot)

    def pack(self) -> None:
        """oneDNN's layouts of A and B (where it serves them), after the slots changed."""
        self._packed = (pack(self.a), pack(self.b))

    def _slot_columns(self, slot: int) -> slice:
        return slice(slot * self.rows_per_slot, (slot + 1) * self.rows_per_slot)


class WorkerLoRA:
    """A rank's LoRA slots over every projection of its model shard."""

    def __init__(
        self, model: nn.Module, model_config: ModelConfig, max_loras: int, max_rank: int
    ) -> None:
        self.model_config = model_config
        self.max_rank = max_rank
        self.tp: TensorParallelGroup = model.tp  # type: ignore[assignment]
        self.device = next(model.parameters()).device
        self.step = LoRAStep(max_loras, model_config.dtype, self.device)
        # Checkpoint projection -> (its stack, the fused parameter's shard id, part index).
        self._targets: dict[str, tuple[LoRAStack, Any, int]] = {}
        self._stacks: list[LoRAStack] = []
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
            self._stacks.append(stack)
            for hf_name in parts:
                shard_id = packed[hf_name][1] if hf_name in packed else None
                part = _part_index(module, shard_id)
                self._targets[f"{prefix}.{hf_name}"] = (stack, shard_id, part)

    def load_all(self, loads: list[LoRALoad]) -> list[int]:
        """The plan's loads, in order; the slots left empty because a load failed on some rank.
        A file that cannot be read fails the requests waiting for
        that adapter, not the engine (it was checked when named; it may since be gone, or
        absent from another node). Collective at TP > 1: every rank reads the same answer."""
        ok = []
        for load in loads:
            try:
                self.load(load)
                ok.append(1)
            except Exception:  # noqa: BLE001 - one adapter's file is its requests' failure
                logger.exception("LoRA adapter %r (%s) could not be loaded", load.name, load.path)
                ok.append(0)
        if self.tp.world_size > 1:
            agreed = self.tp.all_reduce(torch.tensor(ok, dtype=torch.int32, device=self.device))
            ok = [int(count == self.tp.world_size) for count in agreed.tolist()]
        failed: set[int] = set()
        for load, loaded in zip(loads, ok):  # a slot's last load decides it
            if loaded:
                failed.discard(load.slot)
            else:
                self._clear(load.slot)
                failed.add(load.slot)
        for stack in self._stacks:
            stack.pack()
        return sorted(failed)

    def _clear(self, slot: int) -> None:
        for stack in self._stacks:
            stack.clear(slot)

    def load(self, load: LoRALoad) -> None:
        """Put the adapter at `load.path` into `load.slot` (replacing what the slot held);
        `load_all` then lays the stacks out for the GEMMs again."""
        adapter = read_adapter(load.name, load.path, self.model_config, self.max_rank)
        if adapter_key(load.name, adapter.path) != load.key:
            # Its blocks are hashed under the key its request arrived with: new weights under
            # it would be served for the old ones'. Requests naming it now get the new key.
            raise ValueError(f"{adapter.path} changed since it was registered")
        tensors = load_file(f"{adapter.path}/{ADAPTER_WEIGHTS}")
        pairs: dict[str, dict[str, torch.Tensor]] = {}
        for tensor_name, tensor in tensors.items():
            found = tensor_module(tensor_name)
            assert found is not None, tensor_name  # read_adapter checked every name
            module, kind = found
            pairs.setdefault(module, {})[kind] = tensor
        self._clear(load.slot)
        dtype = self.step.dtype
        parts = []
        for module, pair in pairs.items():
            a = pair["lora_A"].to(dtype)
            b = (pair["lora_B"].float() * adapter.scaling).to(dtype)
            if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
                # Every token is computed against every slot: one inf would reach them all.
                raise ValueError(f"{module}: a weight is not finite in {dtype} (scaled)")
            parts.append((module, a, b))
        for module, a, b in parts:
            stack, shard_id, part = self._targets[module]
            stack.set_part(load.slot, shard_id, part, a, b)


def _part_index(layer: LinearBase, shard_id: Any) -> int:
    if isinstance(layer, QKVParallelLinear):
        return _QKV_PARTS[shard_id]
    if isinstance(layer, MergedColumnParallelLinear):
        return int(shard_id)
    return 0
