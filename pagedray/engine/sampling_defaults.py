"""Defaults of the sampling parameters a request leaves unset, from the model's
`generation_config.json`, as vLLM applies them (`--generation-config auto`, its default).

A checkpoint's authors ship the sampling they tuned it for (Qwen2.5: temperature 0.7, top_p 0.8,
top_k 20, repetition_penalty 1.05); vLLM serves a request that names none of them with those,
so the same request to pagedray must sample the same way. vLLM reads the file through
transformers' `GenerationConfig` and keeps the fields that differ from its defaults
(`to_diff_dict`): a field written at transformers' default (top_k 50, temperature 1.0, ...) is
no default here either. (vLLM also takes `max_new_tokens` as the default `max_tokens`; here a
request's default stays the room left in the context.)
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from pagedray.engine.config import EngineConfig

logger = logging.getLogger(__name__)

# The fields vLLM takes (vllm/config/model.py `get_diff_sampling_param`), and the value at which
# transformers' GenerationConfig leaves each out of its diff (None: never a default of its own).
SAMPLING_FIELDS: dict[str, float | None] = {
    "repetition_penalty": 1.0,
    "presence_penalty": None,
    "frequency_penalty": None,
    "temperature": 1.0,
    "top_k": 50,
    "top_p": 1.0,
    "min_p": None,
}
NO_DEFAULTS = "vllm"  # vLLM's spelling: its own neutral defaults


def sampling_defaults(config: EngineConfig) -> dict[str, Any]:
    """The model's defaults for the sampling fields a request leaves unset, by field name;
    empty with `generation_config="vllm"` or where there is no generation_config.json."""
    if config.generation_config == NO_DEFAULTS:
        return {}
    folder = Path(config.model if config.generation_config == "auto" else config.generation_config)
    path = folder / "generation_config.json"
    if not path.is_file():
        return {}
    written = json.loads(path.read_text(encoding="utf-8"))
    defaults = {
        name: written[name]
        for name, transformers_default in SAMPLING_FIELDS.items()
        if written.get(name) is not None and written[name] != transformers_default
    }
    if defaults:
        logger.info(
            "sampling defaults from %s: %s (a request's own values win; --generation-config "
            "vllm turns them off)", path, defaults,
        )  # fmt: skip
    return defaults
