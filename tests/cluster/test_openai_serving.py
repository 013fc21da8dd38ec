"""Logprob formatting for the OpenAI responses, on the tiny model's real byte-level tokenizer."""

from __future__ import annotations

import json

import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from transformers import AutoTokenizer

from pagedray.engine.output_processor import ChoiceDelta
from pagedray.openai.answer_models import CompletionChoice, CompletionResponse
from pagedray.openai.serving import LogprobFormatter, sse


@pytest.fixture(scope="module")
def formatter(tiny_llama: str) -> LogprobFormatter:
    return LogprobFormatter(AutoTokenizer.from_pretrained(tiny_llama))


def test_every_token_has_its_own_name(formatter: LogprobFormatter) -> None:
    """Tokens that are parts of a character would all decode to U+FFFD; they get `bytes:` names
    (as OpenAI's), so no two tokens collide as top_logprobs keys."""
    vocab = formatter.tokenizer.vocab_size
    names = [formatter.token_str(t) for t in range(vocab)]
    assert len(set(names)) == vocab
    partial = [n for n in names if n.startswith("bytes:")]
    assert partial and all("\ufffd" not in n for n in names)


def test_token_bytes_rebuild_the_text(formatter: LogprobFormatter, tiny_llama: str) -> None:
    tokenizer = formatter.tokenizer
    ids = tokenizer.encode("naïve café — ünïcödé ✓ 日本")
    assert b"".join(formatter.token_bytes(t) for t in ids).decode("utf-8") == tokenizer.decode(ids)


def test_partial_character_tokens_keep_their_top_logprobs(formatter: LogprobFormatter) -> None:
    vocab = formatter.tokenizer.vocab_size
    partial = [t for t in range(vocab) if formatter.token_str(t).startswith("bytes:")][:3]
    entries = {t: -1.0 - i for i, t in enumerate(partial)}
    delta = ChoiceDelta("r", 0, "\ufffd", [partial[0]], [entries], None, None)
    completion = formatter.completion(delta, text_offset=0)
    assert len(completion.top_logprobs[0]) == 3
    chat = formatter.chat(delta, num_top=3)[0]
    assert chat.bytes == list(formatter.token_bytes(partial[0]))
    assert len(chat.bytes) == 1 and chat.bytes[0] >= 0x80


# What line readers break at, besides \r and \n (JSON escapes those, and the C0 ones).
LINE_BREAKS = "\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029\r\n"


# No lone surrogates: text decoded from UTF-8, as the ingress's is, never holds one.
@given(st.text(st.sampled_from(LINE_BREAKS) | st.characters(blacklist_categories=("Cs",))))
@example("a\u2028b\x85c\u2029d")
def test_an_event_is_one_line_for_any_line_reader(text: str) -> None:
    """Streamed text may hold U+2028, U+0085 and the like, which httpx's `iter_lines` (and
    `str.splitlines`) break lines at: the event must still be one line that decodes to it."""
    from httpx._decoders import LineDecoder

    chunk = CompletionResponse(id="c", model="m", choices=[CompletionChoice(index=0, text=text)])
    for event, text_of in (
        (sse(chunk), lambda decoded: decoded["choices"][0]["text"]),
        (sse({"error": {"message": text}}), lambda decoded: decoded["error"]["message"]),
    ):
        lines = [line for line in LineDecoder().decode(event) if line]
        assert len(lines) == 1 and lines == event.rstrip("\n").splitlines()
        assert text_of(json.loads(lines[0].removeprefix("data: "))) == text
