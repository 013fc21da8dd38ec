"""Loads the model's tokenizer, and the prompt validator over it, without torch where it can.

The ingress holds a tokenizer and the model's limits, nothing of the model. transformers'
`AutoTokenizer` imports torch (through its model-config classes): 1.5-2 s of an ingress
replica's start, and of the API's outage while a lost one is replaced (issue P14). Where
`AutoTokenizer` would resolve to the generic `tokenizers`-backed class anyway, this loads that
class directly; any other checkpoint goes through `AutoTokenizer`, as before.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pagedray.engine.config import EngineConfig
from pagedray.engine.prompt_validator import PromptValidator
from pagedray.engine.sampling_defaults import max_tokens_cap, sampling_defaults
from pagedray.workers.model_config import ModelConfig

# The tokenizer classes a checkpoint may name that are the generic `tokenizers` backend.
GENERIC_TOKENIZER_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")
# Model types for which `AutoTokenizer` trusts a checkpoint that names a generic class (it
# overrides the named class for some model types, Qwen2's among them, and Mistral's may take
# its own backend).
GENERIC_TRUSTED_MODEL_TYPES = ("llama", "qwen3")


def _json(path: Path) -> dict[str, Any]:
    try:
        with open(path) as file:
            loaded = json.load(file)
    except (OSError, ValueError):
        return {}
    return loaded if isinstance(loaded, dict) else {}


def loads_generic_tokenizer(path: str | Path) -> bool:
    """Whether `AutoTokenizer` would load the checkpoint at `path` as the generic class: its
    tokenizer_config.json names that class and no code of its own, for a model type whose named
    class `AutoTokenizer` keeps, and a tokenizer.json is there."""
    directory = Path(path)
    tokenizer_config = _json(directory / "tokenizer_config.json")
    return (
        tokenizer_config.get("tokenizer_class") in GENERIC_TOKENIZER_CLASSES
        and "auto_map" not in tokenizer_config
        and _json(directory / "config.json").get("model_type") in GENERIC_TRUSTED_MODEL_TYPES
        and (directory / "tokenizer.json").is_file()
    )


def load_tokenizer(config: EngineConfig) -> Any:
    """The model's tokenizer, with `config.chat_template` in place of its own where set."""
    tokenizer = _tokenizer(config.tokenizer or config.model, config.trust_remote_code)
    if config.chat_template is not None:
        tokenizer.chat_template = config.chat_template
    return tokenizer


def _tokenizer(path: str, trust_remote_code: bool) -> Any:
    if loads_generic_tokenizer(path):
        from transformers.tokenization_utils_tokenizers import TokenizersBackend

        return TokenizersBackend.from_pretrained(path)
    # NOTE: imported here: transformers' auto classes cost 1-2 s to import, which an engine
    # replica (no tokenizer until a structured request) does not pay at start.
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)


def make_validator(config: EngineConfig, tokenizer: Any, max_model_len: int) -> PromptValidator:
    model_config = ModelConfig.from_pretrained(config.model, config.dtype)
    defaults = sampling_defaults(config)
    return PromptValidator(
        tokenizer,
        max_model_len,
        model_config.vocab_size,
        config.max_num_seqs,
        defaults,
        max_tokens_cap(config, defaults),
        config.default_chat_template_kwargs,
        config.max_logprobs,
    )
