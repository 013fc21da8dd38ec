"""The detokenizer's decode: the fast tokenizer's own where that is what `decode` amounts to."""

from __future__ import annotations

import random

from transformers import AutoTokenizer

from pagedray.engine.detokenizer import IncrementalDetokenizer, _decoder


def test_fast_decode_equals_the_tokenizers_decode(tiny_llama: str) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    rng = random.Random(0)
    for skip in (True, False):
        decode = _decoder(tokenizer, skip)
        assert decode.func == tokenizer.backend_tokenizer.decode  # the fast path is taken
        for _ in range(500):
            ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randrange(12))]
            assert decode(ids) == tokenizer.decode(ids, skip_special_tokens=skip)


def test_a_tokenizer_that_decodes_its_own_way_keeps_its_decode(tiny_llama: str) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)

    class Shouting(type(tokenizer)):  # type: ignore[misc]
        def _decode(self, token_ids, skip_special_tokens=False, **kwargs):  # noqa: ANN001
            return super()._decode(token_ids, skip_special_tokens, **kwargs).upper()

    backend = tokenizer.backend_tokenizer
    ids = [i for i in range(len(tokenizer)) if backend.decode([i]).islower()][:20]
    tokenizer.__class__ = Shouting
    assert tokenizer.decode(ids) != backend.decode(ids)  # the override shows
    detokenizer = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=True)
    text = "".join(detokenizer.push([token_id]) for token_id in ids)
    assert text == tokenizer.decode(ids, skip_special_tokens=True)
    assert text == text.upper() and detokenizer.full_text() == text
