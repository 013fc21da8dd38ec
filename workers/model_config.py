"""The model's shape, read once from an HF checkpoint's config.json and frozen.

Workers build layers from it; nothing here imports transformers, so a worker needs only the
checkpoint directory; nor torch until a layer asks for the dtype, so the ingress reads the
model's limits without loading torch. Both rope layouts are accepted: transformers 5's
`rope_parameters` and the older `rope_theta` + `rope_scaling`.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)
# Used when a config.json lacks `architectures`.
_MODEL_TYPE_TO_ARCHITECTURE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
# The dtype names a config or a flag may use, by torch's name for them.
_DTYPES = {
    "float32": "float32",
    "float": "float32",
    "bfloat16": "bfloat16",
    "float16": "float16",
    "half": "float16",
}
_DEFAULT_ROPE_THETA = 10_000.0  # transformers' default_theta when a config omits it


@dataclass(frozen=True)
class ModelConfig:
    """Everything the Llama-family model needs to build its layers."""

    architecture: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    # None for plain rope; else at least {"rope_type": ...} plus that type's parameters.
    rope_scaling: dict[str, Any] | None = field(hash=False)
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # bias on q/k/v projections
    o_proj_bias: bool  # bias on the attention output projection
    mlp_bias: bool  # bias on gate/up/down projections (Llama's `mlp_bias`)
    qk_norm: bool  # Qwen3: RMSNorm over head_dim on each q and k head, before rope
    bos_token_id: int | None
    eos_token_id: tuple[int, ...]
    # NOTE: recorded, not applied: the model attends to the whole context, so the engine must
    # cap the context length at this window (Mistral v0.1) for outputs to match the reference.
    sliding_window: int | None
    dtype_name: str  # torch's name of the weights' and KV pool's dtype

    @property
    def dtype(self) -> torch.dtype:
        import torch

        return getattr(torch, self.dtype_name)

    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: str = "auto") -> ModelConfig:
        """Parse `path/config.json`: once per process while the file stays as it is (the
        engine's config, its validator, its factory and its worker all ask).

        Args:
            path: an HF checkpoint directory.
            dtype: "auto" (the checkpoint's own dtype) or "float32" / "bfloat16" / "float16".
        """
        file = (Path(path) / "config.json").resolve()
        stat = file.stat()
        return _parsed(str(file), stat.st_mtime_ns, stat.st_size, dtype)

    @classmethod
    def from_dict(cls, raw: dict[str, Any], dtype: str = "auto") -> ModelConfig:
        """Build from an already-parsed config.json."""
        architecture = _architecture(raw)
        num_heads = raw["num_attention_heads"]
        rope_theta, rope_scaling = _parse_rope(raw)
        is_qwen2 = architecture == "Qwen2ForCausalLM"
        attention_bias = is_qwen2 or bool(raw.get("attention_bias", False))
        # Qwen2 has q/k/v bias but none on o_proj; Llama and Qwen3 use one flag for all four.
        o_proj_bias = (not is_qwen2) and bool(raw.get("attention_bias", False))
        return cls(
            architecture=architecture,
            hidden_size=raw["hidden_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=num_heads,
            num_key_value_heads=raw.get("num_key_value_heads") or num_heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // num_heads,
            intermediate_size=raw["intermediate_size"],
            vocab_size=raw["vocab_size"],
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=raw["max_position_embeddings"],
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=attention_bias,
            o_proj_bias=o_proj_bias,
            mlp_bias=architecture == "LlamaForCausalLM" and bool(raw.get("mlp_bias", False)),
            qk_norm=architecture == "Qwen3ForCausalLM",
            bos_token_id=raw.get("bos_token_id"),
            eos_token_id=_eos_ids(raw.get("eos_token_id")),
            sliding_window=_sliding_window(raw),
            dtype_name=_resolve_dtype(raw, dtype),
        )


def _architecture(raw: dict[str, Any]) -> str:
    names = raw.get("architectures") or []
    if not names and raw.get("model_type") in _MODEL_TYPE_TO_ARCHITECTURE:
        names = [_MODEL_TYPE_TO_ARCHITECTURE[raw["model_type"]]]
    for name in names:
        if name in SUPPORTED_ARCHITECTURES:
            return name
    raise ValueError(
        f"unsupported architecture {names or raw.get('model_type')!r}; "
        f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
    )


def _parse_rope(raw: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) from either config layout; rope_scaling None for plain rope."""
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    theta = params.pop("rope_theta", None) or raw.get("rope_theta") or _DEFAULT_ROPE_THETA
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"unsupported rope type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if rope_type == "default":
        return float(theta), None
    if rope_type == "llama3":
        # As transformers' standardize_rope_params: fall back to the model's own context length.
        params.setdefault(
            "original_max_position_embeddings",
            raw.get("original_max_position_embeddings", raw["max_position_embeddings"]),
        )
    return float(theta), {"rope_type": rope_type, **params}


def _eos_ids(value: int | list[int] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(value)


def _sliding_window(raw: dict[str, Any]) -> int | None:
    # Qwen2/3 carry a sliding_window value that is off unless use_sliding_window is set.
    if "use_sliding_window" in raw and not raw["use_sliding_window"]:
        return None
    return raw.get("sliding_window")


def _resolve_dtype(raw: dict[str, Any], dtype: str) -> str:
    name = dtype
    if dtype == "auto":
        # transformers 5 writes `dtype`, older versions `torch_dtype`; absent means float32.
        name = raw.get("dtype") or raw.get("torch_dtype") or "float32"
    if name not in _DTYPES:
        raise ValueError(f"unsupported dtype {name!r}; use auto, float32, bfloat16 or float16")
    return _DTYPES[name]


@functools.lru_cache(maxsize=16)
def _parsed(file: str, mtime_ns: int, size: int, dtype: str) -> ModelConfig:
    """`file` parsed; the key's modification time and size make a changed file parsed anew."""
    with open(file) as f:
        raw = json.load(f)
    return ModelConfig.from_dict(raw, dtype)
