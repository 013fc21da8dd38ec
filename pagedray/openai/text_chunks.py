"""Streamed chunks that carry only a choice's next text, written from a template per stream.

Most events of a stream are one choice's next few characters: no logprobs, no finish reason, no
tool call. Built as pydantic models, each such event costs three models and a serialisation
in the ingress, per token of every stream. The template is that very chunk, serialised once by
pydantic with a marker where the text goes; an event is then the text, JSON-escaped, between
the template's two halves, so its bytes are the models' own (tests/openai/test_text_chunks.py
checks them against the models').
"""

from __future__ import annotations

import json
from typing import Callable

from pydantic import BaseModel

from pagedray.openai.serving import LINE_BREAKS_IN_JSON, sse

# Where the text goes. The text field comes after the chunk's id and model name, so the last
# occurrence is the field's even in the unlikely case a model name contains the marker.
_MARKER = "pagedray-chunk-text-marker"


class TextChunkTemplate:
    """SSE events of one stream whose only content is a choice's next text."""

    def __init__(self, chunk_of: Callable[[int, str], BaseModel]) -> None:
        """`chunk_of(index, text)`: the stream's chunk model for choice `index` with `text`."""
        self._chunk_of = chunk_of
        self._halves: dict[int, tuple[str, str]] = {}  # choice index -> (before, after) text

    def event(self, index: int, text: str) -> str:
        """`sse(chunk_of(index, text))`, without building the models again."""
        halves = self._halves.get(index)
        if halves is None:
            before, _, after = sse(self._chunk_of(index, _MARKER)).rpartition(_MARKER)
            halves = self._halves[index] = (before, after)
        escaped = json.dumps(text, ensure_ascii=False)[1:-1]
        # The framing's line-break escapes, applied to the text as `sse` applies them to all.
        return halves[0] + escaped.translate(LINE_BREAKS_IN_JSON) + halves[1]
