"""The ingress's tokenizer without transformers' auto classes (engine/tokenizer_loading.py):
exactly the tokenizer `AutoTokenizer` gives where the fast path applies, `AutoTokenizer` itself
where it does not, and no torch imported on the way."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer
from transformers.models.auto import tokenization_auto

from pagedray.engine.config import EngineConfig
from pagedray.engine.tokenizer_loading import (
    GENERIC_TRUSTED_MODEL_TYPES,
    load_tokenizer,
    loads_generic_tokenizer,
)

MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Say hello, then stop."},
]


@pytest.fixture(scope="module")
def both(tiny_llama: str) -> tuple[object, object]:
    return load_tokenizer(EngineConfig(model=tiny_llama)), AutoTokenizer.from_pretrained(tiny_llama)


def test_the_fast_path_is_the_tokenizer_auto_tokenizer_gives(both: tuple) -> None:
    fast, auto = both
    assert type(fast) is type(auto)
    assert fast.all_special_ids == auto.all_special_ids
    assert (fast.bos_token_id, fast.eos_token_id, fast.pad_token_id) == (
        auto.bos_token_id,
        auto.eos_token_id,
        auto.pad_token_id,
    )
    rendered = [
        t.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True) for t in both
    ]
    assert rendered[0] == rendered[1]


@settings(max_examples=60, deadline=None)
@given(text=st.text(max_size=80))
def test_the_fast_path_encodes_and_decodes_as_auto_tokenizer(both: tuple, text: str) -> None:
    fast, auto = both
    ids = fast.encode(text)
    assert ids == auto.encode(text)
    assert fast.decode(ids) == auto.decode(ids)


def test_only_checkpoints_auto_tokenizer_keeps_generic_take_the_fast_path(
    tiny_models: dict[str, str], tmp_path: Path
) -> None:
    assert loads_generic_tokenizer(tiny_models["llama"])
    assert loads_generic_tokenizer(tiny_models["qwen3"])
    # AutoTokenizer gives Qwen2's own class to a qwen2 checkpoint whatever it names.
    assert not loads_generic_tokenizer(tiny_models["qwen2"])
    assert (
        type(load_tokenizer(EngineConfig(model=tiny_models["qwen2"]))).__name__ == "Qwen2Tokenizer"
    )
    # Code of its own, or another class named: AutoTokenizer decides.
    copy = Path(shutil.copytree(tiny_models["llama"], tmp_path / "model"))
    config_path = copy / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "auto_map": {"AutoTokenizer": ["x", "y"]}}))
    assert not loads_generic_tokenizer(copy)
    config_path.write_text(json.dumps({**config, "tokenizer_class": "LlamaTokenizer"}))
    assert not loads_generic_tokenizer(copy)


def test_transformers_still_trusts_the_generic_class_for_those_model_types() -> None:
    # Where AutoTokenizer overrides a checkpoint's named class, the fast path would differ.
    overridden = tokenization_auto.MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS
    assert not set(GENERIC_TRUSTED_MODEL_TYPES) & set(overridden)


def test_the_ingress_tokenizer_and_limits_load_without_torch(tiny_llama: str) -> None:
    script = (
        "import sys\n"
        "from pagedray.cluster.engine_control import config_max_model_len\n"
        "from pagedray.engine.config import EngineConfig\n"
        "from pagedray.engine.tokenizer_loading import load_tokenizer, make_validator\n"
        f"config = EngineConfig(model={tiny_llama!r})\n"
        "tokenizer = load_tokenizer(config)\n"
        "make_validator(config, tokenizer, config_max_model_len(config))\n"
        "print('torch' in sys.modules)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "False", result.stderr


CUSTOM_TOKENIZER = '''
from transformers.tokenization_utils_tokenizers import TokenizersBackend


class CheckpointTokenizer(TokenizersBackend):
    """A tokenizer class the checkpoint ships, as some do (auto_map)."""
'''


def test_a_checkpoints_own_tokenizer_code_runs_only_when_trusted(
    tiny_llama: str, tmp_path: Path
) -> None:
    """vLLM's `--trust-remote-code`: off, a tokenizer_config.json's auto_map is not run (its
    tokenizer_class serves); on, the checkpoint's class is the tokenizer."""
    folder = tmp_path / "custom"
    shutil.copytree(tiny_llama, folder)
    (folder / "checkpoint_tokenizer.py").write_text(CUSTOM_TOKENIZER)
    config_path = folder / "tokenizer_config.json"
    tokenizer_config = json.loads(config_path.read_text())
    tokenizer_config["auto_map"] = {
        "AutoTokenizer": [None, "checkpoint_tokenizer.CheckpointTokenizer"]
    }
    config_path.write_text(json.dumps(tokenizer_config))
    assert not loads_generic_tokenizer(str(folder))
    untrusted = load_tokenizer(EngineConfig(model=str(folder)))
    assert type(untrusted).__name__ == tokenizer_config["tokenizer_class"]
    trusted = load_tokenizer(EngineConfig(model=str(folder), trust_remote_code=True))
    assert type(trusted).__name__ == "CheckpointTokenizer"
    assert trusted.encode("hello") == AutoTokenizer.from_pretrained(tiny_llama).encode("hello")
