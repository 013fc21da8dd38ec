"""The `llama3_json` format, vLLM's parser of that name: Llama 3.1/3.2's JSON calls,
`<|python_tag|>`? `{"name": ..., "parameters": {...}}`, `;`-joined."""

from __future__ import annotations

import re

from pagedray.openai.tool_parsers.base import (
    JSON_DECODER,
    ExtractedToolCalls,
    ParsedCall,
    StreamedDelta,
    ToolCallStreamer,
    call_from_object,
    content_or_none,
    new_call_id,
)
from pagedray.openai.tool_parsers.text_streamer import TextCallStreamer

PYTHON_TAG = "<|python_tag|>"
# Between calls: whitespace and the `;` the 3.1/3.2 format puts there.
_SEPARATORS = re.compile(r"^[\s;]+")


class Llama3JsonToolParser:
    """Text that does not start with `{` (past the tag) is plain content, and so is the whole
    text when any part of it fails to be a call."""

    name = "llama3_json"

    def extract(self, text: str) -> ExtractedToolCalls:
        body = text.strip().removeprefix(PYTHON_TAG).lstrip()
        calls: list[ParsedCall] = []
        while body.startswith("{"):
            try:
                obj, end = JSON_DECODER.raw_decode(body)
            except ValueError:
                break
            if (call := call_from_object(obj)) is None:
                break
            calls.append(ParsedCall(new_call_id(), *call))
            body = _SEPARATORS.sub("", body[end:], count=1)
        if body or not calls:
            return ExtractedToolCalls(content_or_none(text), [])
        return ExtractedToolCalls(None, calls)

    def streamer(self) -> ToolCallStreamer:
        return Llama3JsonStreamer()


class Llama3JsonStreamer(TextCallStreamer):
    """States: start (deciding text or calls), between (calls), call, plain."""

    _first_state = "start"
    _after_call = "between"

    def _on_start(self, text: str, out: StreamedDelta) -> str:
        body = text.lstrip()
        if body.startswith(PYTHON_TAG):
            body = body[len(PYTHON_TAG) :].lstrip()
        elif PYTHON_TAG.startswith(body):
            body = ""
        if not body:
            self._held = text
            return ""
        if body[0] != "{":
            self._state = "plain"
            out.content = self._all
            return ""
        return self._start_call(body, 0)  # the first call failing makes the whole text content

    def _on_between(self, text: str, out: StreamedDelta) -> str:
        body = _SEPARATORS.sub("", text, count=1)
        return self._start_call(body) if body else ""  # a non-object fails as a call
