"""Tests for the offline default model: loads in transformers, is deterministic, clear argmaxes."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer

from pagedray.tools.default_model import (
    ARCHS,
    PRESET_ARCHS,
    PRESETS,
    _build_config,
    default_model_path,
    make_model,
)
from pagedray.tools.default_tokenizer import NUM_RESERVED, SPECIAL_TOKENS, build_tokenizer
from pagedray.workers.model_config import ModelConfig

FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
PROMPTS = (
    "Hello, my name is",
    "The capital of France is",
    "1 2 3 4 5",
    "Once upon a time",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
)
# Greedy comparisons against transformers need the winning logit clearly ahead of the runner-up.
MIN_TOP2_GAP = 1e-3


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {arch: make_model(root / arch, arch=arch, preset="tiny") for arch in ARCHS}


def _load(path: Path) -> tuple[torch.nn.Module, object]:
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True).eval()
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    return model, tokenizer


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("arch", ARCHS)
def test_files_and_config(tiny_models: dict[str, Path], arch: str) -> None:
    path = tiny_models[arch]
    for name in FILES:
        assert (path / name).is_file(), name
    config = json.loads((path / "config.json").read_text())
    tokenizer_config = json.loads((path / "tokenizer_config.json").read_text())
    assert config["model_type"] == arch
    assert config["vocab_size"] == PRESETS["tiny"]["vocab_size"]
    assert config["head_dim"] == 16 and config["num_key_value_heads"] == 2
    assert config["tie_word_embeddings"] == (arch == "qwen2")
    assert config.get("sliding_window") is None
    rope = config["rope_parameters"]
    assert rope["rope_type"] == ("llama3" if arch == "llama" else "default")
    if arch == "llama":
        assert rope["original_max_position_embeddings"] == 512 and rope["factor"] == 8.0
    assert "chat_template" in tokenizer_config
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    assert len(tokenizer) == config["vocab_size"]
    assert tokenizer.convert_ids_to_tokens(list(range(len(SPECIAL_TOKENS)))) == list(SPECIAL_TOKENS)
    assert (config["pad_token_id"], config["bos_token_id"], config["eos_token_id"]) == (
        tokenizer.pad_token_id,
        tokenizer.bos_token_id,
        tokenizer.eos_token_id,
    )


@pytest.mark.parametrize("arch", ARCHS)
def test_loads_and_generates(tiny_models: dict[str, Path], arch: str) -> None:
    model, tokenizer = _load(tiny_models[arch])
    input_ids = tokenizer("Once upon a time", return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(
            input_ids, max_new_tokens=10, min_new_tokens=10, do_sample=False, pad_token_id=0
        )
    assert out.shape == (1, input_ids.shape[1] + 10)
    assert int(out.max()) < model.config.vocab_size


def test_norms_and_biases_are_not_default(tiny_models: dict[str, Path]) -> None:
    # A loader that skipped norm weights or q/k/v biases must not match transformers by accident.
    model, _ = _load(tiny_models["qwen2"])
    attn = model.model.layers[0].self_attn
    assert attn.q_proj.bias.abs().min() > 0 and attn.v_proj.bias.abs().min() > 0
    assert not torch.allclose(model.model.layers[0].input_layernorm.weight, torch.ones(64))
    qwen3, _ = _load(tiny_models["qwen3"])
    assert not torch.allclose(qwen3.model.layers[0].self_attn.q_norm.weight, torch.ones(16))


TEXTS = (
    "Hello world, the 12345 cats sat!",
    "  two  spaces\tand\ttabs\n\nnew lines ",
    "café naïve Zürich 東京 😀 ✨ don't",
    "<|im_start|>user\nhi<|im_end|>",
    "",
)


@pytest.mark.parametrize("arch", ARCHS)
def test_tokenizer_round_trip(tiny_models: dict[str, Path], arch: str) -> None:
    # transformers picks Qwen2Tokenizer for qwen2 and rebuilds its pipeline; ids must still match
    # the plain tokenizer.json that the engine may load directly.
    tokenizer = AutoTokenizer.from_pretrained(tiny_models[arch], local_files_only=True)
    raw = Tokenizer.from_file(str(tiny_models[arch] / "tokenizer.json"))
    for text in TEXTS:
        ids = tokenizer.encode(text)
        assert ids == raw.encode(text).ids
        assert tokenizer.decode(ids) == text


def test_chat_template(tiny_models: dict[str, Path]) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_models["qwen3"], local_files_only=True)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    without = tokenizer.apply_chat_template(messages, add_generation_prompt=False, tokenize=False)
    assert not without.endswith("assistant\n")
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    assert ids[0] == tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert ids == tokenizer.encode(text)


def test_same_seed_gives_identical_files(tmp_path: Path, tiny_models: dict[str, Path]) -> None:
    again = make_model(tmp_path / "again", arch="llama", preset="tiny", seed=0)
    for name in FILES:
        assert _sha256(again / name) == _sha256(tiny_models["llama"] / name), name
    other = make_model(tmp_path / "other", arch="llama", preset="tiny", seed=1)
    assert _sha256(other / "model.safetensors") != _sha256(again / "model.safetensors")


def test_overrides_take_effect(tmp_path: Path) -> None:
    path = make_model(tmp_path / "odd", arch="mistral", num_key_value_heads=1, vocab_size=517)
    model, tokenizer = _load(path)
    assert model.config.num_key_value_heads == 1 and model.config.vocab_size == 517
    assert model.model.layers[0].self_attn.k_proj.weight.shape == (16, 64)  # [kv_heads*head_dim, h]
    assert model.get_input_embeddings().weight.shape == (517, 64)
    assert len(tokenizer) == 517
    input_ids = tokenizer("The sun", return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(input_ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert out.shape[1] == input_ids.shape[1] + 4


def _min_top2_gap(path: Path) -> float:
    model, tokenizer = _load(path)
    gaps = []
    for prompt in PROMPTS:
        with torch.no_grad():
            logits = model(tokenizer(prompt, return_tensors="pt").input_ids).logits[0, -1]
        top2 = logits.topk(2).values
        gaps.append(float(top2[0] - top2[1]))
    return min(gaps)


@pytest.mark.parametrize("preset", ["tiny", "small"])
def test_greedy_top2_gap(tmp_path: Path, tiny_models: dict[str, Path], preset: str) -> None:
    gaps = {}
    for arch in ARCHS:
        path = tiny_models[arch] if preset == "tiny" else make_model(tmp_path / arch, arch, preset)
        gaps[arch] = _min_top2_gap(path)
    print(f"min top-2 logit gap ({preset}):", {arch: round(gap, 4) for arch, gap in gaps.items()})
    assert min(gaps.values()) > MIN_TOP2_GAP, gaps


def test_make_model_replaces_existing_dir(tmp_path: Path) -> None:
    out = tmp_path / "model"
    out.mkdir()
    (out / "stale.txt").write_text("old")
    make_model(out, arch="qwen2")
    assert not (out / "stale.txt").exists() and (out / "model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]  # no temp dirs left behind
    with pytest.raises(ValueError):
        make_model(tmp_path / "bad", arch="gpt2")


def test_default_model_path_builds_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGEDRAY_CACHE_DIR", str(tmp_path))
    path = default_model_path("llama", "tiny")
    assert path.parent == tmp_path / "models" and path.name.startswith("llama-tiny-")
    mtime = (path / "model.safetensors").stat().st_mtime_ns
    assert default_model_path("llama", "tiny") == path
    assert (path / "model.safetensors").stat().st_mtime_ns == mtime


# The published shapes (config.json of Qwen/Qwen2.5-0.5B-Instruct and
# meta-llama/Llama-3.2-1B-Instruct): what the real-shape presets must reproduce.
PUBLISHED = {
    "qwen2.5-0.5b": {
        "architectures": ["Qwen2ForCausalLM"],
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "vocab_size": 151936,
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
        "rope_theta": 1000000.0,
    },
    "llama-3.2-1b": {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "vocab_size": 128256,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": True,
        "rope_theta": 500000.0,
    },
}


@pytest.mark.parametrize("preset", list(PUBLISHED))
def test_real_shape_presets_have_the_published_shapes(preset: str) -> None:
    """Checked on the config alone: building the weights is the benchmarks' (1-2.5 GB)."""
    config = _build_config(
        PRESET_ARCHS[preset], preset, "bfloat16", {"bos": 1, "eos": 2, "pad": 0}, {}
    )
    raw = config.to_dict()
    parsed = ModelConfig.from_dict(raw)
    for field, value in PUBLISHED[preset].items():
        if field == "rope_theta":
            assert parsed.rope_theta == value
        else:
            assert raw[field] == value, field
    assert parsed.head_dim == 64 and parsed.tie_word_embeddings
    assert parsed.dtype == torch.bfloat16
    if preset == "llama-3.2-1b":  # llama3 rope scaling, as published
        assert parsed.rope_scaling is not None and parsed.rope_scaling["factor"] == 32.0


def test_a_real_shape_builds_and_runs_token_exact_with_transformers(
    tmp_path: Path, hf_greedy: Any
) -> None:
    """The Qwen2.5-0.5B shape at one layer (the rest as published: its 151,936-token vocabulary
    and tokenizer, widths, GQA, tied embeddings) through the engine, greedy, as transformers."""
    from pagedray import LLM, SamplingParams

    path = make_model(tmp_path / "qwen", preset="qwen2.5-0.5b", num_hidden_layers=1)
    raw = json.loads((path / "config.json").read_text())
    assert raw["architectures"] == ["Qwen2ForCausalLM"] and raw["vocab_size"] == 151936
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert len(tokenizer) == 151936
    # As a published tokenizer: a few added tokens, every other id the model's vocabulary (145,817
    # added tokens made llguidance's index of it take 79 s, holding the GIL).
    assert len(tokenizer.added_tokens_decoder) == len(SPECIAL_TOKENS) + NUM_RESERVED
    assert tokenizer.decode([151935 - NUM_RESERVED]).strip().isalpha()
    prompt = tokenizer.encode("Once upon a time, in a city far away,")
    llm = LLM(str(path), max_model_len=256, num_kv_blocks=16, enable_prefix_caching=False)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    (ours,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    assert ours.outputs[0].token_ids == hf_greedy(str(path), [prompt], 6)[0]


def test_a_vocabulary_past_the_trained_one_is_filled_with_words_not_added_tokens() -> None:
    """Past what the trainer learns here (about 6,100 entries), ids are ordinary vocabulary:
    made-up words that decode, which encoding never emits; the reserved special tokens stay at
    the top ids; the same seed gives the same tokenizer."""
    size = 6600
    first, second = (build_tokenizer(size, 0, 2048) for _ in range(2))
    assert first.backend_tokenizer.to_str() == second.backend_tokenizer.to_str()
    assert len(first) == size
    added = sorted(first.added_tokens_decoder)
    assert len(added) == len(SPECIAL_TOKENS) + NUM_RESERVED
    assert added[-NUM_RESERVED:] == list(range(size - NUM_RESERVED, size))
    vocab = json.loads(first.backend_tokenizer.to_str())["model"]["vocab"]
    fillers = range(max(vocab.values()) - 300, size - NUM_RESERVED)
    assert set(fillers) <= set(vocab.values())
    for token_id in fillers:
        word = first.decode([token_id])
        assert word[0] == " " and word[1:].isalpha(), (token_id, word)
        assert token_id not in first.encode(word)
