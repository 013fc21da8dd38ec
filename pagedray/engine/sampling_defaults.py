"""Defaults of the sampling parameters a request leaves unset, from the model's
`generation_config.json`, as vLLM applies them (`--generation-config auto`, its default).

A checkpoint's authors ship the sampling they tuned it for (Qwen2.5: temperature 0.7, top_p 0.8,
top_k 20, repetition_penalty 1.05); vLLM serves a request that names none of them with those,
so the same request to pagedray must sample the same way. vLLM reads the file through
transformers' `GenerationConfig` and keeps every field it takes that is not null (transformers 5
defaults each to None, so its `to_diff_dict` drops nothing else); `--override-generation-config`
sets fields over the file's (or alone, with `--generation-config vllm`). `max_new_tokens` is the
default `max_tokens`; and where it comes from the override, or from a file named by its folder,
it also caps every request's, as vLLM's server-wide limit. One difference: vLLM falls back to
sampling fields written in `config.json` (here: none). A file that cannot be read, or a value no
request could carry, is left out with a warning, never made the default of every request.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from pagedray.engine.config import EngineConfig
from pagedray.scheduler.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# The fields vLLM takes (vllm/config/model.py `get_diff_sampling_param`).
SAMPLING_FIELDS = (
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "temperature",
    "top_k",
    "top_p",
    "min_p",
)
NEUTRAL = "vllm"  # the setting for none: vLLM's spelling of its own neutral defaults
OUTPUT_LIMIT = "max_new_tokens"  # transformers' name of what a request calls max_tokens


def sampling_defaults(config: EngineConfig) -> dict[str, Any]:
    """The defaults of the fields a request leaves unset, by `SamplingParams` field name (the
    sampling fields, and `max_tokens` from `max_new_tokens`); empty with
    `generation_config="vllm"` and no override, or where there is no usable file."""
    path, written = _generation_config(config)
    written.update(config.override_generation_config)
    sources = [str(path)] if path is not None else []
    if config.override_generation_config:
        sources.append("--override-generation-config")
    source = " and ".join(sources)
    defaults = {}
    for name in (*SAMPLING_FIELDS, OUTPUT_LIMIT):
        value = written.get(name)
        if name in ("top_k", OUTPUT_LIMIT) and isinstance(value, float) and value.is_integer():
            value = int(value)  # 20.0 as written by some exporters
        if value is None:
            continue
        field = "max_tokens" if name == OUTPUT_LIMIT else name
        try:
            SamplingParams(**{field: value})
        except (ValueError, TypeError) as error:
            logger.warning(
                "%s: %s=%r left out, no request could carry it (%s)", source, name, value, error
            )
            continue
        defaults[field] = value
    if defaults:
        # A warning, as vLLM's: it changes what requests that name none of them sample.
        logger.warning(
            "sampling defaults from %s: %s (a request's own values win; --generation-config "
            "vllm turns the file's off)", source, defaults,
        )  # fmt: skip
    return defaults


def max_tokens_cap(config: EngineConfig, defaults: dict[str, Any]) -> int | None:
    """The most tokens any request may generate, whatever its `max_tokens`: vLLM's
    `override_max_tokens`, the default's `max_new_tokens` where it came from a folder named by
    `--generation-config`, else from `--override-generation-config`; None: no cap."""
    named_folder = config.generation_config not in ("auto", NEUTRAL)
    if named_folder or OUTPUT_LIMIT in config.override_generation_config:
        return defaults.get("max_tokens")  # validated with the rest, the override's over the file's
    return None


def _generation_config(config: EngineConfig) -> tuple[Path | None, dict[str, Any]]:
    """The generation_config.json read, and its fields; (None, {}) where none is used, is
    there, or can be read."""
    if config.generation_config == NEUTRAL:
        return None, {}
    folder = Path(config.model if config.generation_config == "auto" else config.generation_config)
    path = folder / "generation_config.json"
    if not path.is_file():
        if config.generation_config != "auto":
            logger.warning(
                "generation_config %s holds no generation_config.json: none used", folder
            )
        return None, {}
    try:
        written = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        logger.warning("%s cannot be read (%s): no sampling defaults from it", path, error)
        return None, {}
    if not isinstance(written, dict):
        logger.warning("%s is not a JSON object: no sampling defaults from it", path)
        return None, {}
    return path, written
