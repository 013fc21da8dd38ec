"""Builds pagedray's default model offline: a seeded random-weight checkpoint in HF format.

The engine, its tests and its benchmarks need a real checkpoint without network access, so we train
a small byte-level BPE on a synthetic corpus and save a randomly initialised decoder next to it.
"""

from __future__ import annotations

import fcntl
import json
import os
import random
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tokenizers import Tokenizer
    from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerFast

from pagedray.cache_dir import cache_dir
from pagedray.tools.chat_template import CHAT_TEMPLATE

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
# NOTE: the trainer places special tokens first, in this order, so pad=0, bos=1, eos=2.
SPECIAL_TOKENS = ("<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>")
# Ids at the top of the vocabulary are filled with reserved special tokens (as Llama 3 does), so
# that every id the model can emit decodes to something.
NUM_RESERVED = 8
# NOTE: transformers 5 ignores tokenizer.json's pipeline for model_type qwen2 and rebuilds it as
# Qwen2Tokenizer (NFC, this split regex, ByteLevel without its own regex). Every arch uses exactly
# that pipeline, so AutoTokenizer and a plain `tokenizers.Tokenizer.from_file` agree on every id.
_SPLIT_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
# A wide init spreads the logits, so greedy argmax has no near-ties that float noise could flip.
INITIALIZER_RANGE = 0.1
# Target std of the logits over the vocabulary: wide enough that top-2 gaps sit well above float
# noise, narrow enough that sampling at temperature 1 still diverges between sequences.
LOGIT_STD = 4.0
# How the byte-level alphabet spells a space byte (0x20), as in "Ġthe".
BYTE_LEVEL_SPACE = "\u0120"
_NUM_SENTENCES = 6000
_NUM_PSEUDO_WORDS = 1500

_COMMON_WORDS_TEXT = """
the of and to a in is it you that he was for on are with as I his they be at one have this from
or had by hot word but what some we can out other were all there when up use your how said an
each she which do their time if will way about many then them write would like so these her long
make thing see him two has look more day could go come did number sound no most people my over
know water than call first who may down side been now find any new work part take get place made
live where after back little only round man year came show every good me give our under name very
through just form sentence great think say help low line differ turn cause much mean before move
right boy old too same tell does set three want air well also play small end put home read hand
port large spell add even land here must big high such follow act why ask men change went light
kind off need house picture try us again animal point mother world near build self earth father
head stand own page should country found answer school grow study still learn plant cover food sun
four between state keep eye never last let thought city tree cross farm hard start might story saw
far sea draw left late run while press close night real life few north open seem together next
white children begin got walk example ease paper group always music those both mark often letter
until mile river car feet care second book carry took science eat room friend began idea fish
mountain stop once base hear horse cut sure watch color face wood main enough plain girl usual
young ready above ever red list though feel talk bird soon body dog family direct pose leave song
café naïve über façade déjà Zürich 東京 日本語 сегодня données 😀 ✨
"""
_COMMON_WORDS = _COMMON_WORDS_TEXT.split()
_ONSETS = (
    "",
    "b",
    "br",
    "c",
    "ch",
    "d",
    "dr",
    "f",
    "g",
    "gl",
    "h",
    "j",
    "k",
    "l",
    "m",
    "n",
    "p",
    "pl",
    "qu",
    "r",
    "s",
    "sh",
    "st",
    "t",
    "th",
    "tr",
    "v",
    "w",
    "z",
)
_VOWELS = ("a", "e", "i", "o", "u", "ai", "ea", "ee", "io", "ou", "oo", "y")
_CODAS = ("", "", "n", "r", "s", "t", "l", "m", "nd", "ng", "st", "ck", "x")


def _pseudo_words(rng: random.Random) -> list[str]:
    """English-looking made-up words: enough distinct merges for BPE to fill a 4k vocabulary."""
    words = []
    for _ in range(_NUM_PSEUDO_WORDS):
        syllables = rng.randint(1, 3)
        words.append(
            "".join(
                rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS)
                for _ in range(syllables)
            )
        )
    return words


def _corpus(seed: int) -> list[str]:
    """Seeded sentences with Zipf-like word frequencies, capitals, punctuation and numbers."""
    rng = random.Random(seed)
    words = _COMMON_WORDS + _pseudo_words(rng)
    cum_weights, total = [], 0.0
    for rank in range(len(words)):
        total += 1.0 / (rank + 1)
        cum_weights.append(total)
    sentences = []
    for _ in range(_NUM_SENTENCES):
        sentence = rng.choices(words, cum_weights=cum_weights, k=rng.randint(4, 16))
        if rng.random() < 0.3:
            sentence.insert(rng.randrange(len(sentence)), str(rng.randint(0, 99999)))
        if rng.random() < 0.3:
            idx = rng.randrange(1, len(sentence))
            sentence[idx - 1] += rng.choice((",", ";", ":", " -"))
        text = " ".join(sentence)
        end = rng.choice((".", ".", ".", "?", "!", "...", '."'))
        sentences.append(text[0].upper() + text[1:] + end + rng.choice((" ", " ", "\n", "\n\n")))
    return sentences


def _build_tokenizer(vocab_size: int, seed: int, model_max_length: int) -> PreTrainedTokenizerFast:
    """Trains a byte-level BPE with exactly `vocab_size` entries: every id < vocab_size decodes."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < 256 + len(SPECIAL_TOKENS) + NUM_RESERVED:
        raise ValueError(f"vocab_size={vocab_size} cannot hold 256 byte tokens plus special tokens")
    tokenizer = Tokenizer(models.BPE())
    # Byte-level with no prefix space: decode(encode(s)) == s for any NFC-normalised string.
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_SPLIT_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - NUM_RESERVED,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(seed), trainer=trainer)
    # NOTE: on this corpus the trainer stops at about 6,100 entries, short of the real shapes'
    # 151,936 and 128,256. The rest are ordinary vocabulary entries, as a published vocabulary's
    # rare tokens are, not added tokens: a published tokenizer has a few dozen of those, and
    # llguidance's index of a vocabulary grows with their square (145,817 added tokens took it
    # 79 s, holding the GIL; as vocabulary entries, 0.8 s).
    shortfall = vocab_size - NUM_RESERVED - tokenizer.get_vocab_size()
    if shortfall > 0:
        tokenizer = _with_filler_words(tokenizer, shortfall, random.Random(seed))
    tokenizer.add_special_tokens([f"<|reserved_{idx}|>" for idx in range(NUM_RESERVED)])
    assert tokenizer.get_vocab_size() == vocab_size
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        extra_special_tokens=["<|im_start|>", "<|im_end|>"],
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
        model_max_length=model_max_length,
    )


def _with_filler_words(tokenizer: Tokenizer, count: int, rng: random.Random) -> Tokenizer:
    """`tokenizer` with `count` made-up words (" " and 2-4 syllables) after its vocabulary. No
    merge makes them, so encoding never emits one; the model may, and each decodes to its word."""
    from tokenizers import Tokenizer

    state = json.loads(tokenizer.to_str())
    vocab: dict[str, int] = state["model"]["vocab"]
    next_id = max(vocab.values()) + 1
    assert next_id == tokenizer.get_vocab_size()  # no added tokens past the vocabulary yet
    while count:
        syllables = rng.randint(2, 4)
        word = BYTE_LEVEL_SPACE + "".join(
            rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS) for _ in range(syllables)
        )
        if word not in vocab:
            vocab[word] = next_id
            next_id += 1
            count -= 1
    return Tokenizer.from_str(json.dumps(state))


def _save_tokenizer(tokenizer: PreTrainedTokenizerFast, out_dir: Path) -> None:
    # save_jinja_files=False keeps the chat template inside tokenizer_config.json.
    tokenizer.save_pretrained(out_dir, save_jinja_files=False)
    # NOTE: an explicit null unk_token stops Qwen2Tokenizer (see _SPLIT_REGEX) from appending its
    # default "<|endoftext|>" at id vocab_size, past the end of the embedding table.
    config_path = out_dir / "tokenizer_config.json"
    tokenizer_config = json.loads(config_path.read_text())
    tokenizer_config["unk_token"] = None
    text = json.dumps(tokenizer_config, indent=2, sort_keys=True, ensure_ascii=False)
    config_path.write_text(text + "\n", encoding="utf-8")


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
        tokenizer = _build_tokenizer(shape["vocab_size"], seed, shape["max_position_embeddings"])
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
        _save_tokenizer(tokenizer, tmp_dir)
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
