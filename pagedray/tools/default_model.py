"""Builds pagedray's default model offline: a seeded random-weight checkpoint in HF format.

The engine, its tests and its benchmarks need a real checkpoint without network access, so we train
a small byte-level BPE on a synthetic corpus (default_tokenizer.py) and save a randomly initialised
decoder next to it.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel

from pagedray.cache_dir import cache_dir
from pagedray.tools.default_tokenizer import build_tokenizer, save_tokenizer

__all__ = [
    "ARCHS",
    "DEFAULT_ARCH",
    "DEFAULT_PRESET",
    "PRESETS",
    "PRESET_ARCHS",
    "default_model_path",
    "make_model",
]

PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 128,
        "vocab_size": 512,
        "max_position_embeddings": 1024,
    },
    "small": {
        "hidden_size": 256,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 768,
        "vocab_size": 4096,
        "max_position_embeddings": 2048,
    },
    # The shapes users run, from the published config.json of each (random weights): what a
    # step costs there is memory bandwidth and GEMM, not the serving loop.
    "qwen2.5-0.5b": {  # Qwen/Qwen2.5-0.5B-Instruct
        "hidden_size": 896,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "intermediate_size": 4864,
        "vocab_size": 151936,
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
    },
    "llama-3.2-1b": {  # meta-llama/Llama-3.2-1B-Instruct
        "hidden_size": 2048,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "intermediate_size": 8192,
        "vocab_size": 128256,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": True,
        "rope_parameters": {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    },
}
# The architecture a preset has unless one is asked for (the real shapes are of one model each).
PRESET_ARCHS = {"qwen2.5-0.5b": "qwen2", "llama-3.2-1b": "llama"}
ARCHS = ("llama", "mistral", "qwen2", "qwen3")
DEFAULT_ARCH = "llama"
DEFAULT_PRESET = "small"
# Bump when the corpus, tokenizer recipe or init changes, so stale cached builds are not reused.
CACHE_VERSION = "v2"
# Presets whose builds changed since: the vocabulary past what the trainer learns became ordinary
# entries. The small and tiny builds stayed the same byte for byte, and keep their names (the
# served model's name is its build's: `llama-small-v2`).
PRESET_CACHE_VERSIONS = {"qwen2.5-0.5b": "v3", "llama-3.2-1b": "v3"}

# transformers' config and model classes of each arch, by name: torch and transformers are
# imported only to build, so that `pagedray serve` with a cached build (every start but the first)
# does not spend seconds importing them in a process that never runs the model.
_MODEL_CLASS_NAMES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
}
# A wide init spreads the logits, so greedy argmax has no near-ties that float noise could flip.
INITIALIZER_RANGE = 0.1
# Target std of the logits over the vocabulary: wide enough that top-2 gaps sit well above float
# noise, narrow enough that sampling at temperature 1 still diverges between sequences.
LOGIT_STD = 4.0


def _build_config(
    arch: str, preset: str, dtype: str, special_ids: dict[str, int], overrides: dict[str, Any]
) -> PretrainedConfig:
    """The preset shape plus the arch's distinguishing features, with `overrides` applied last."""
    fields: dict[str, Any] = {**PRESETS[preset], **overrides}
    fields.setdefault("head_dim", fields["hidden_size"] // fields["num_attention_heads"])
    fields.setdefault("initializer_range", INITIALIZER_RANGE)
    fields.setdefault("tie_word_embeddings", arch == "qwen2")
    fields.setdefault("bos_token_id", special_ids["bos"])
    fields.setdefault("eos_token_id", special_ids["eos"])
    fields.setdefault("pad_token_id", special_ids["pad"])
    if arch == "llama" and "rope_parameters" not in fields and "rope_scaling" not in fields:
        # Exercises the llama3 frequency rescaling: wavelengths above original_max are stretched.
        fields["rope_parameters"] = {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": fields["max_position_embeddings"] // 2,
        }
    if arch != "llama":
        # Every layer attends to the full context; the engine has no sliding-window path.
        fields.setdefault("sliding_window", None)
    if arch in ("qwen2", "qwen3"):
        fields.setdefault("use_sliding_window", False)
        fields.setdefault("max_window_layers", fields["num_hidden_layers"])
    config_class, model_class = _model_classes(arch)
    config = config_class(**fields)
    config.architectures = [model_class.__name__]
    config.dtype = dtype
    return config


def _model_classes(arch: str) -> tuple[type[PretrainedConfig], type[PreTrainedModel]]:
    import transformers

    config_name, model_name = _MODEL_CLASS_NAMES[arch]
    return getattr(transformers, config_name), getattr(transformers, model_name)


def _spread_init(model: PreTrainedModel, config: PretrainedConfig) -> None:
    """Randomises what the default init leaves constant, and widens the logits to `LOGIT_STD`.

    Norm weights (default 1) and biases (default 0) get random values so that a loader which skips
    them produces wrong outputs instead of passing by accident.
    """
    import torch

    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0.0, config.initializer_range)
            elif "norm" in name:
                param.uniform_(0.5, 1.5)
        # The final norm's output has rms ~1 (times its weight, mean 1), and each logit sums
        # hidden_size terms of std initializer_range, so this brings the logits' std to LOGIT_STD.
        scale = LOGIT_STD / (config.initializer_range * config.hidden_size**0.5)
        model.model.norm.weight.mul_(scale)


def _publish(tmp_dir: Path, out_dir: Path) -> None:
    """Moves a finished build into place; readers never see a half-written directory."""
    if out_dir.exists():
        old = out_dir.with_name(f".{out_dir.name}.old-{uuid.uuid4().hex}")
        os.rename(out_dir, old)
        os.rename(tmp_dir, out_dir)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp_dir, out_dir)


def make_model(
    out_dir: str | os.PathLike[str],
    arch: str | None = None,
    preset: str = "tiny",
    seed: int = 0,
    dtype: str = "float32",
    **overrides: Any,
) -> Path:
    """Writes a seeded random-weight checkpoint with its tokenizer to `out_dir` and returns it.

    Args:
        out_dir: target directory; replaced atomically if it already exists.
        arch: one of `ARCHS`; None: the preset's own (`PRESET_ARCHS`), else llama.
        preset: one of `PRESETS`.
        seed: seeds both the tokenizer corpus and the weight init; same seed gives identical files.
        dtype: torch dtype name the weights are saved in.
        **overrides: config fields, e.g. `num_key_value_heads=1` or `vocab_size=517`.
    """
    import torch

    if arch is None:
        arch = PRESET_ARCHS.get(preset, DEFAULT_ARCH)
    if arch not in _MODEL_CLASS_NAMES:
        raise ValueError(f"unknown arch {arch!r}; expected one of {ARCHS}")
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; expected one of {tuple(PRESETS)}")
    shape = {**PRESETS[preset], **overrides}
    out_dir = Path(out_dir).expanduser().resolve()
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp_dir = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        tokenizer = build_tokenizer(shape["vocab_size"], seed, shape["max_position_embeddings"])
        special_ids = {
            "bos": tokenizer.bos_token_id,
            "eos": tokenizer.eos_token_id,
            "pad": tokenizer.pad_token_id,
        }
        config = _build_config(arch, preset, dtype, special_ids, overrides)
        torch.manual_seed(seed)
        model = _model_classes(arch)[1](config)
        _spread_init(model, config)
        model = model.to(getattr(torch, dtype))
        model.save_pretrained(tmp_dir)
        save_tokenizer(tokenizer, tmp_dir)
        _publish(tmp_dir, out_dir)
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)
    return out_dir


def default_model_built(
    arch: str = DEFAULT_ARCH, preset: str = DEFAULT_PRESET, dtype: str = "float32"
) -> bool:
    """Whether `default_model_path` finds the build in the cache (else it builds it first)."""
    return (_default_model_dir(arch, preset, dtype) / "config.json").exists()


def _default_model_dir(arch: str, preset: str, dtype: str) -> Path:
    suffix = "" if dtype == "float32" else f"-{dtype}"
    version = PRESET_CACHE_VERSIONS.get(preset, CACHE_VERSION)
    return cache_dir("models") / f"{arch}-{preset}{suffix}-{version}"


def default_model_path(
    arch: str = DEFAULT_ARCH, preset: str = DEFAULT_PRESET, dtype: str = "float32"
) -> Path:
    """Returns the cached build of (arch, preset, dtype), seed 0, building it once on first use.

    A file lock serialises concurrent builders; the atomic rename in `make_model` means a directory
    that exists is always complete (whatever shards its weights take).
    """
    path = _default_model_dir(arch, preset, dtype)
    if (path / "config.json").exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "w") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)
        try:
            # Another process may have finished the build while we waited for the lock.
            if not (path / "config.json").exists():
                make_model(path, arch=arch, preset=preset, seed=0, dtype=dtype)
        finally:
            fcntl.flock(lock_file, fcntl.LOCK_UN)
    return path
