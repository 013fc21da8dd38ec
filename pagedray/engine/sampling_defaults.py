"""Defaults of the sampling parameters a request leaves unset, from the model's
`generation_config.json`, as vLLM applies them (`--generation-config auto`, its default).

A checkpoint's authors ship the sampling they tuned it for (Qwen2.5: temperature 0.7, top_p 0.8,
top_k 20, repetition_penalty 1.05); vLLM serves a request that names none of them with those,
so the same request to pagedray must sample the same way. vLLM reads the file through
transformers' `GenerationConfig` and keeps every field it takes that is not null (transformers 5
defaults each to None, so its `to_diff_dict` drops nothing else). Two differences: vLLM also
takes `max_new_tokens` as the default `max_tokens` (here a request's default stays the room left
in its context), and falls back to sampling fields written in `config.json` (here: none). A file
that cannot be read, or a value no request could carry, is left out with a warning, never made
the default of every request.
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


def sampling_defaults(config: EngineConfig) -> dict[str, Any]:
    """The model's defaults for the sampling fields a request leaves unset, by field name;
    empty with `generation_config="vllm"` or where there is no usable generation_config.json."""
    if config.generation_config == NEUTRAL:
        return {}
    folder = Path(config.model if config.generation_config == "auto" else config.generation_config)
    path = folder / "generation_config.json"
    if not path.is_file():
        if config.generation_config != "auto":
            logger.warning(
                "generation_config %s holds no generation_config.json: none used", folder
            )
        return {}
    try:
        written = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        logger.warning("%s cannot be read (%s): no sampling defaults from it", path, error)
        return {}
    if not isinstance(written, dict):
        logger.warning("%s is not a JSON object: no sampling defaults from it", path)
        return {}
    defaults = {}
    for name in SAMPLING_FIELDS:
        value = written.get(name)
        if name == "top_k" and isinstance(value, float) and value.is_integer():
            value = int(value)  # 20.0 as written by some exporters
        if value is None:
            continue
        try:
            SamplingParams(**{name: value})
        except (ValueError, TypeError) as error:
            logger.warning(
                "%s: %s=%r left out, no request could carry it (%s)", path, name, value, error
            )
            continue
        defaults[name] = value
    if defaults:
        # A warning, as vLLM's: it changes what requests that name none of them sample.
        logger.warning(
            "sampling defaults from %s: %s (a request's own values win; --generation-config "
            "vllm turns them off)", path, defaults,
        )  # fmt: skip
    return defaults
