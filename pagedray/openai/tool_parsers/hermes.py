"""The `hermes` format, vLLM's parser of that name: `<tool_call>{"name": ..., "arguments":
{...}}</tool_call>` blocks in the text (Qwen 2/2.5/3, Hermes 2 Pro)."""

from __future__ import annotations

from pagedray.openai.tool_parsers.base import (
    JSON_DECODER,
    ExtractedToolCalls,
    ParsedCall,
    StreamedDelta,
    ToolCallStreamer,
    call_from_object,
    content_or_none,
    held_suffix,
    new_call_id,
)
from pagedray.openai.tool_parsers.text_streamer import TextCallStreamer

HERMES_OPEN = "<tool_call>"
HERMES_CLOSE = "</tool_call>"


class HermesToolParser:
    """`<tool_call>` blocks. A block whose JSON is not a call makes the whole text content (as
    vLLM); an unclosed block at the end is a call when its JSON is complete, else content
    (generation cut short)."""

    name = "hermes"

    def extract(self, text: str) -> ExtractedToolCalls:
        pos = 0
        parts: list[str] = []
        calls: list[ParsedCall] = []
        while (start := text.find(HERMES_OPEN, pos)) >= 0:
            block = self._parse_block(text, start + len(HERMES_OPEN))
            if block is None:  # a broken block, or an unclosed one at the end
                if HERMES_CLOSE in text[start:]:
                    return ExtractedToolCalls(content_or_none(text), [])
                break
            parts.append(text[pos:start])
            calls.append(block[0])
            pos = block[1]
        parts.append(text[pos:])
        return ExtractedToolCalls(content_or_none("".join(parts)), calls)

    @staticmethod
    def _parse_block(text: str, pos: int) -> tuple[ParsedCall, int] | None:
        body = text[pos:].lstrip()
        try:
            obj, end = JSON_DECODER.raw_decode(body)
        except ValueError:
            return None
        call = call_from_object(obj)
        rest = body[end:].lstrip()
        if call is None or not (rest.startswith(HERMES_CLOSE) or HERMES_CLOSE.startswith(rest)):
            return None
        return ParsedCall(new_call_id(), *call), len(text) - len(rest[len(HERMES_CLOSE) :])

    def streamer(self) -> ToolCallStreamer:
        return HermesStreamer()


class HermesStreamer(TextCallStreamer):
    """States: text, call (from <tool_call>), close (before </tool_call>), plain."""

    _first_state = "text"
    _after_call = "close"

    def _on_text(self, text: str, out: StreamedDelta) -> str:
        found = text.find(HERMES_OPEN)
        if found < 0:
            keep = len(text) - held_suffix(text, HERMES_OPEN)
            out.content += text[:keep]
            self._held = text[keep:]
            return ""
        out.content += text[:found]
        marker = len(self._all) - len(text) + found
        return self._start_call(text[found + len(HERMES_OPEN) :], marker)  # a bad call is content

    def _on_close(self, text: str, out: StreamedDelta) -> str:
        body = text.lstrip()
        if body.startswith(HERMES_CLOSE):
            self._state = "text"
            return body[len(HERMES_CLOSE) :]
        if HERMES_CLOSE.startswith(body):
            self._held = body
            return ""
        self._state = "plain"  # stray text where the closing marker belongs
        return body
