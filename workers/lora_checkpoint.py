"""A LoRA adapter on disk in PEFT's format: read and checked against the model, or made seeded.

An adapter is a folder with `adapter_config.json` (`r`, `lora_alpha`, `use_rslora`, ...) and
`adapter_model.safetensors`, whose tensors are named as PEFT saves them:
`base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight` ([r, in] ) and `...lora_B.weight`
([out, r]). The engine reads it when a request may first name it (`--lora-modules`, a
`LoRARequest`), so an adapter that does not fit the model is refused there, with its reason, and
a rank that loads it later (workers/lora.py) finds what was checked.

No adapter can be downloaded here, so tests, benchmarks and a first try of `--lora-modules`
build their own (`make_lora_adapter`, `pagedray make-lora`): seeded, with B random rather than
PEFT's zeros (an untrained adapter would change nothing), each projection's delta about half
the base projection's output.
"""

from __future__ import annotations

import json
import math
import re
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagedray.workers.model_config import ModelConfig

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# The projections an adapter may change: a decoder layer's attention and MLP.
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# `base_model.model.<module>.lora_A.weight`, the adapter's own name sometimes before `.weight`.
_TENSOR_NAME = re.compile(
    r"base_model\.model\.(?P<module>model\.layers\.(?P<layer>\d+)\.(?:self_attn|mlp)\."
    r"(?P<target>\w+))\.(?P<kind>lora_A|lora_B)(?:\.\w+)?\.weight"
)
_FLOAT_DTYPES = ("F32", "F16", "BF16")


@dataclass(frozen=True)
class LoRAAdapter:
    """An adapter that fits the model: what a rank needs to load it into a slot."""

    name: str
    path: str
    rank: int  # the largest r of its projections
    scaling: float  # lora_alpha / r (/ sqrt(r) with use_rslora): B is multiplied by it
    # Its projections as the checkpoint names them (`model.layers.3.self_attn.q_proj`).
    modules: tuple[str, ...]


def read_adapter(name: str, path: str, model: ModelConfig, max_lora_rank: int) -> LoRAAdapter:
    """The adapter at `path`, checked against `model`'s shapes.

    Raises:
        ValueError: "lora_path: ..." saying what is missing or does not fit.
    """
    try:
        return _read_adapter(name, path, model, max_lora_rank)
    except (TypeError, AttributeError, KeyError, OverflowError) as error:  # a crafted file
        raise ValueError(f"lora_path: {path!r}: not a PEFT adapter ({error!r})") from None


def _read_adapter(name: str, path: str, model: ModelConfig, max_lora_rank: int) -> LoRAAdapter:
    try:
        folder = Path(path).expanduser().resolve()
    except (OSError, RuntimeError, ValueError) as error:  # a loop of links, a NUL byte
        raise ValueError(f"lora_path: {path!r} cannot be resolved: {error}") from None
    config = _adapter_config(folder)
    rank = config.get("r")
    alpha = config.get("lora_alpha", rank)
    if not isinstance(rank, int) or rank < 1 or not isinstance(alpha, (int, float)):
        raise _unfit(folder, "adapter_config.json needs an integer r >= 1 and a lora_alpha")
    if rank > max_lora_rank:
        raise _unfit(folder, f"r={rank} exceeds --max-lora-rank {max_lora_rank}")
    for key, unsupported in (
        ("use_dora", "DoRA"),
        ("modules_to_save", "modules_to_save"),
        ("rank_pattern", "rank_pattern"),
        ("alpha_pattern", "alpha_pattern"),
    ):
        if config.get(key):
            raise _unfit(folder, f"{unsupported} adapters are not supported")
    if config.get("bias", "none") != "none":
        raise _unfit(folder, "adapters that train biases are not supported")
    shapes = _tensor_shapes(folder / ADAPTER_WEIGHTS)
    expected = projection_shapes(model)
    modules: dict[str, set[str]] = {}
    for tensor, (dtype, shape) in shapes.items():
        match = _TENSOR_NAME.fullmatch(tensor)
        if match is None or match["target"] not in expected:
            raise _unfit(folder, f"tensor {tensor!r} is no LoRA of a layer's projection")
        if int(match["layer"]) >= model.num_hidden_layers:
            raise _unfit(folder, f"tensor {tensor!r}: the model has {model.num_hidden_layers}")
        if dtype not in _FLOAT_DTYPES:
            raise _unfit(folder, f"tensor {tensor!r} is {dtype}")
        out_features, in_features = expected[match["target"]]
        want = [rank, in_features] if match["kind"] == "lora_A" else [out_features, rank]
        if shape != want:
            raise _unfit(folder, f"tensor {tensor!r} is {shape}, the model needs {want}")
        modules.setdefault(match["module"], set()).add(match["kind"])
    unpaired = sorted(module for module, kinds in modules.items() if len(kinds) != 2)
    if unpaired:
        raise _unfit(folder, f"{unpaired[0]} has lora_A or lora_B alone")
    if not modules:
        raise _unfit(folder, "no LoRA tensors")
    scaling = alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)
    return LoRAAdapter(name, str(folder), rank, float(scaling), tuple(sorted(modules)))


def adapter_key(name: str, path: str) -> str:
    """What an adapter's prefix-cache blocks are hashed with: its name and its weights file's
    size and modification time, so that blocks outliving an engine (the node's KV tiers) are
    never read for an adapter trained again into the same folder. Every process that reads the
    same file computes the same key (the router's hashes match the engines'). Raises OSError
    when the file cannot be read."""
    stat = (Path(path) / ADAPTER_WEIGHTS).stat()
    return f"{name}@{stat.st_size}:{stat.st_mtime_ns}"


def projection_shapes(model: ModelConfig) -> dict[str, tuple[int, int]]:
    """(out, in) features of each projection an adapter may target, unsharded."""
    hidden, inner = model.hidden_size, model.intermediate_size
    q_out = model.num_attention_heads * model.head_dim
    kv_out = model.num_key_value_heads * model.head_dim
    return {
        "q_proj": (q_out, hidden),
        "k_proj": (kv_out, hidden),
        "v_proj": (kv_out, hidden),
        "o_proj": (hidden, q_out),
        "gate_proj": (inner, hidden),
        "up_proj": (inner, hidden),
        "down_proj": (hidden, inner),
    }


_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
# The share of the base projection's output a delta is sized to.
_DELTA_SHARE = 0.5


def make_lora_adapter(
    model_dir: str | Path,
    out_dir: str | Path,
    rank: int = 8,
    alpha: int = 16,
    targets: Sequence[str] = LORA_TARGETS,
    seed: int = 0,
) -> Path:
    """Writes an adapter of `rank` over `targets` of every layer of the model at `model_dir`
    to `out_dir` (made if absent) and returns it; the same seed gives the same files."""
    import torch
    from safetensors.torch import save_file

    unknown = sorted(set(targets) - set(LORA_TARGETS))
    if unknown or not targets:
        raise ValueError(f"targets: {unknown or 'none'}; choose from {', '.join(LORA_TARGETS)}")
    model = ModelConfig.from_pretrained(model_dir)
    raw = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    init_range = float(raw.get("initializer_range", 0.02))
    scaling = alpha / rank
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(model.num_hidden_layers):
        for target in targets:
            out_features, in_features = projection_shapes(model)[target]
            block = "self_attn" if target in _ATTENTION else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{block}.{target}"
            # x A^T has about unit components for a normed x; B then sizes the delta.
            a = torch.randn(rank, in_features, generator=generator) / math.sqrt(in_features)
            b_std = _DELTA_SHARE * init_range * math.sqrt(in_features / rank) / scaling
            b = torch.randn(out_features, rank, generator=generator) * b_std
            tensors[f"{prefix}.lora_A.weight"] = a.to(model.dtype).contiguous()
            tensors[f"{prefix}.lora_B.weight"] = b.to(model.dtype).contiguous()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = {
        "peft_type": "LORA",
        "base_model_name_or_path": str(model_dir),
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": 0.0,
        "target_modules": sorted(targets),
        "bias": "none",
        "task_type": "CAUSAL_LM",
        "use_rslora": False,
        "use_dora": False,
    }
    (out / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2), encoding="utf-8")
    save_file(tensors, str(out / ADAPTER_WEIGHTS))
    return out


def tensor_module(tensor: str) -> tuple[str, str] | None:
    """(module, "lora_A" or "lora_B") of one of an adapter's tensor names; None: none."""
    match = _TENSOR_NAME.fullmatch(tensor)
    return None if match is None else (match["module"], match["kind"])


def _adapter_config(folder: Path) -> dict[str, Any]:
    try:
        config = json.loads((folder / ADAPTER_CONFIG).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise _unfit(folder, f"no {ADAPTER_CONFIG} (a PEFT adapter folder is expected)") from None
    except (OSError, UnicodeDecodeError, ValueError) as error:  # JSONDecodeError is one
        raise _unfit(folder, f"{ADAPTER_CONFIG} cannot be read: {error}") from None
    if not isinstance(config, dict):
        raise _unfit(folder, f"{ADAPTER_CONFIG} is not a JSON object")
    return config


def _tensor_shapes(weights: Path) -> dict[str, tuple[str, list[int]]]:
    """name -> (dtype, shape) from a safetensors file's header, without reading the tensors."""
    try:
        with open(weights, "rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
            if length > 100 * 2**20:
                raise ValueError(f"a header of {length} bytes")
            header = json.loads(handle.read(length))
    except FileNotFoundError:
        raise _unfit(weights.parent, f"no {ADAPTER_WEIGHTS}") from None
    except (OSError, ValueError, struct.error) as error:
        raise _unfit(weights.parent, f"{ADAPTER_WEIGHTS} cannot be read: {error}") from None
    return {
        name: (str(entry.get("dtype")), list(entry.get("shape", [])))
        for name, entry in header.items()
        if name != "__metadata__" and isinstance(entry, dict)
    }


def _unfit(folder: Path, reason: str) -> ValueError:
    return ValueError(f"lora_path: {folder}: {reason}")
