"""How many characters one token can cover, read from the tokenizer's structure.

A prompt of more than `max_model_len × chars_per_token` characters cannot fit in the model, so it
is refused without tokenizing it (tokenizing megabytes takes seconds). The bound must never be
too small, or a prompt that fits would be refused, so it is only given for pipelines where every
step provably keeps or lengthens the text: byte-level or byte-fallback BPE, pre-tokenizers that
split without dropping characters, and normalizers that keep, lengthen or compose (NFC/NFKC
compose at most 4 code points into one). Anything else (WordPiece, which maps a whole unknown
word to one token; whitespace pre-tokenizers, which drop spaces; accent stripping) gets None:
no pre-check, the prompt is tokenized and counted.
"""

from __future__ import annotations

import json
from typing import Any

# The longest canonical decomposition of one code point (e.g. U+1F82 is 4): the most input
# characters NFC or NFKC can fold into one.
MAX_COMPOSED_CHARS = 4
_SAFE_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "UnicodeScripts"}
_SPLITTING_PRE_TOKENIZERS = {"Split", "Punctuation"}  # safe unless their behavior removes
_LENGTHENING_NORMALIZERS = {"NFD", "NFKD", "Lowercase", "Prepend"}
_COMPOSING_NORMALIZERS = {"NFC", "NFKC"}


def chars_per_token(tokenizer: Any) -> int | None:
    """An upper bound on the prompt characters one token stands for; None if none is known."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:  # a slow (pure Python) tokenizer: its pipeline is not inspectable
        return None
    if not _model_is_bounded(backend.model):
        return None
    if backend.pre_tokenizer is not None and not _pre_tokenizer_keeps(
        json.loads(backend.pre_tokenizer.__getstate__())
    ):
        return None
    factor = 1
    if backend.normalizer is not None:
        normalizer_factor = _normalizer_factor(json.loads(backend.normalizer.__getstate__()))
        if normalizer_factor is None:
            return None
        factor = normalizer_factor
    # Byte-level pieces spell one character per byte and SentencePiece pieces one per
    # character, so a piece is at least as long as the text it covers; added tokens match
    # their content.
    longest = max(len(piece) for piece in backend.get_vocab(with_added_tokens=True))
    return longest * factor


def _model_is_bounded(model: Any) -> bool:
    """BPE maps each unknown character to its own token (or its bytes), unless unknowns fuse."""
    if type(model).__name__ != "BPE":
        return False
    return bool(model.byte_fallback) or model.unk_token is None or not model.fuse_unk


def _pre_tokenizer_keeps(state: dict[str, Any]) -> bool:
    kind = state.get("type")
    if kind == "Sequence":
        return all(_pre_tokenizer_keeps(part) for part in state.get("pretokenizers", []))
    if kind in _SPLITTING_PRE_TOKENIZERS:
        return state.get("behavior") != "Removed"
    return kind in _SAFE_PRE_TOKENIZERS


def _normalizer_factor(state: dict[str, Any]) -> int | None:
    """How many input characters the normalizer can fold into one; None if unbounded."""
    kind = state.get("type")
    if kind == "Sequence":
        factor = 1
        for part in state.get("normalizers", []):
            part_factor = _normalizer_factor(part)
            if part_factor is None:
                return None
            factor *= part_factor
        return factor
    if kind in _LENGTHENING_NORMALIZERS:
        return 1
    if kind in _COMPOSING_NORMALIZERS:
        return MAX_COMPOSED_CHARS
    if kind == "Replace":
        pattern = state.get("pattern", {}).get("String")
        content = state.get("content", "")
        if pattern is None or not content:  # a regex, or a deletion: unbounded
            return None
        return max(1, -(-len(pattern) // len(content)))
    return None
