"""A text-only chunk from the template is byte for byte the chunk the models serialise."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from pagedray.openai.answer_models import (
    ChatCompletionChunk,
    ChatCompletionStreamChoice,
    CompletionChoice,
    CompletionResponse,
    DeltaMessage,
)
from pagedray.openai.serving import sse
from pagedray.openai.text_chunks import TextChunkTemplate

# Any text a tokenizer may decode to: quotes, backslashes, control characters, the characters
# some line readers split on, and every plane (no lone surrogates: decoded text is valid UTF-8).
TEXTS = st.text(st.characters(exclude_categories=("Cs",)), max_size=40) | st.sampled_from(
    ['"', "\\", "\n\r\t\b\f\x00\x1f\x7f", "\x85\u2028\u2029", "pagedray-chunk-text-marker"]
)
MODELS = st.sampled_from(["m", 'we"ird\\/model \u2028', "pagedray-chunk-text-marker"])


def chat_chunk(model: str, index: int, text: str) -> ChatCompletionChunk:
    choice = ChatCompletionStreamChoice(index=index, delta=DeltaMessage(content=text))
    return ChatCompletionChunk(id="chatcmpl-1", created=7, model=model, choices=[choice])


def completion_chunk(model: str, index: int, text: str) -> CompletionResponse:
    choice = CompletionChoice(index=index, text=text)
    return CompletionResponse(id="cmpl-1", created=7, model=model, choices=[choice])


@settings(max_examples=300, deadline=None)
@given(model=MODELS, events=st.lists(st.tuples(st.integers(0, 3), TEXTS), min_size=1))
def test_template_events_equal_the_models_events(model, events) -> None:
    for build in (chat_chunk, completion_chunk):
        template = TextChunkTemplate(lambda i, text, build=build: build(model, i, text))
        for index, text in events:
            event = template.event(index, text)
            assert event == sse(build(model, index, text))
            assert event.startswith("data: ") and event.endswith("\n\n")
            assert event.count("\n") == 2  # one line for any line reader
            payload = json.loads(event[len("data: ") :])
            assert payload["choices"][0]["index"] == index
