"""The default model's tokenizer, built offline and seeded: a byte-level BPE trained on a synthetic
corpus of English-looking sentences, its vocabulary filled to the model's size.

Split from default_model.py, which builds the checkpoint around it: a real shape's vocabulary
(151,936 ids) is mostly what this recipe adds past what the trainer learns on the corpus.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

from pagedray.tools.chat_template import CHAT_TEMPLATE

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


def build_tokenizer(vocab_size: int, seed: int, model_max_length: int) -> PreTrainedTokenizerFast:
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


def save_tokenizer(tokenizer: PreTrainedTokenizerFast, out_dir: Path) -> None:
    # save_jinja_files=False keeps the chat template inside tokenizer_config.json.
    tokenizer.save_pretrained(out_dir, save_jinja_files=False)
    # NOTE: an explicit null unk_token stops Qwen2Tokenizer (see _SPLIT_REGEX) from appending its
    # default "<|endoftext|>" at id vocab_size, past the end of the embedding table.
    config_path = out_dir / "tokenizer_config.json"
    tokenizer_config = json.loads(config_path.read_text())
    tokenizer_config["unk_token"] = None
    text = json.dumps(tokenizer_config, indent=2, sort_keys=True, ensure_ascii=False)
    config_path.write_text(text + "\n", encoding="utf-8")
