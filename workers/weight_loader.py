"""Stream an HF safetensors checkpoint into a (possibly sharded) model, one rank's slice at a time.

Each parameter carries a `weight_loader(param, loaded_weight, shard_id=None)` (nano-vllm style);
here `loaded_weight` is a lazy safetensors slice, so a layer narrowing it to its shard reads only
those bytes from disk. Checkpoint names are mapped onto fused parameters (q/k/v -> qkv_proj,
gate/up -> gate_up_proj) through the model's `packed_modules_mapping`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors import safe_open
from torch import nn


class SafeSlice(Protocol):
    """The part of safetensors' lazy PySafeSlice the loaders use."""

    def get_shape(self) -> list[int]: ...

    def __getitem__(self, index: Any) -> torch.Tensor: ...


# A checkpoint tensor, either loaded or still on disk.
WeightSource = torch.Tensor | SafeSlice

# Weights that checkpoints may carry but the model recomputes itself.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def narrow_weight(weight: WeightSource, dim: int, start: int, length: int) -> torch.Tensor:
    """`weight[..., start:start + length, ...]` along `dim`, reading only that part from disk."""
    if isinstance(weight, torch.Tensor):
        return weight.narrow(dim, start, length)
    index = [slice(None)] * len(weight.get_shape())
    index[dim] = slice(start, start + length)
    return weight[tuple(index)]


def full_weight(weight: WeightSource) -> torch.Tensor:
    if isinstance(weight, torch.Tensor):
        return weight
    return weight[:]


def copy_weight(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy (casting to the model dtype), refusing a shape mismatch instead of broadcasting."""
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(
            f"checkpoint shard shape {tuple(src.shape)} != parameter {tuple(dst.shape)}"
        )
    dst.copy_(src)


def default_weight_loader(
    param: nn.Parameter, loaded_weight: WeightSource, shard_id: Any = None
) -> None:
    """Replicated parameters (norms): every rank takes the whole tensor."""
    copy_weight(param.data, full_weight(loaded_weight))


def iter_checkpoint(checkpoint_dir: str | Path) -> Iterator[tuple[str, SafeSlice]]:
    """(name, lazy slice) for every tensor in `model.safetensors` or the sharded index's files.

    A slice is valid only until the next item: its file is closed once its tensors are done.
    """
    root = Path(checkpoint_dir)
    index = root / "model.safetensors.index.json"
    if index.exists():
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    elif (root / "model.safetensors").exists():
        files = ["model.safetensors"]
    else:
        raise FileNotFoundError(
            f"{root}: no model.safetensors or model.safetensors.index.json "
            "(only safetensors checkpoints are supported)"
        )
    for file in files:
        with safe_open(str(root / file), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 (safe_open is not a dict)
                yield name, handle.get_slice(name)


def load_weights(model: nn.Module, checkpoint_dir: str | Path) -> None:
    """Fill every parameter of `model` with this rank's shard of the checkpoint.

    Raises:
        ValueError: a checkpoint tensor has no parameter, or a parameter (or one of a fused
            parameter's shards) was not found in the checkpoint.
    """
    params = dict(model.named_parameters())
    packed: dict[str, tuple[str, Any]] = getattr(model, "packed_modules_mapping", {})
    tied = bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))
    loaded: dict[str, set[Any]] = {}
    for name, weight in iter_checkpoint(checkpoint_dir):
        if name.endswith(_IGNORED_SUFFIXES) or (tied and name == "lm_head.weight"):
            continue
        param_name, shard_id = _map_name(name, packed)
        if param_name not in params:
            raise ValueError(f"checkpoint tensor {name!r} matches no model parameter")
        param = params[param_name]
        loader = getattr(param, "weight_loader", default_weight_loader)
        with torch.no_grad():
            if shard_id is None:
                loader(param, weight)
            else:
                loader(param, weight, shard_id)
        loaded.setdefault(param_name, set()).add(shard_id)
    _check_complete(params, packed, loaded, checkpoint_dir)


def _map_name(name: str, packed: dict[str, tuple[str, Any]]) -> tuple[str, Any]:
    """HF name -> (our parameter name, shard id or None)."""
    for hf_module, (fused_module, shard_id) in packed.items():
        if f".{hf_module}." in name:
            return name.replace(f".{hf_module}.", f".{fused_module}."), shard_id
    return name, None


def _check_complete(
    params: dict[str, nn.Parameter],
    packed: dict[str, tuple[str, Any]],
    loaded: dict[str, set[Any]],
    checkpoint_dir: str | Path,
) -> None:
    expected_shards: dict[str, set[Any]] = {}
    for fused_module, shard_id in packed.values():
        expected_shards.setdefault(fused_module, set()).add(shard_id)
    missing = []
    for param_name in params:
        module = param_name.split(".")[-2] if "." in param_name else ""
        expected = expected_shards.get(module, {None})
        absent = expected - loaded.get(param_name, set())
        if absent:
            shards = "" if absent == {None} else f" (shards {sorted(map(str, absent))})"
            missing.append(param_name + shards)
    if missing:
        raise ValueError(f"{checkpoint_dir}: weights missing from the checkpoint: {missing}")
