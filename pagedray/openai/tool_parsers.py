"""Tool calls parsed out of generated text, as vLLM's `hermes` and `llama3_json` parsers do.

Models write calls as text in a fixed format; the API returns `tool_calls`. Streaming gives the
same answer as the whole-text parse: text that may yet become a call marker is held back.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Protocol

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
# Where a call object keeps its arguments; the first of these keys present wins.
ARGUMENT_KEYS = ("arguments", "parameters")
# Between Llama 3 calls: whitespace and the `;` the 3.1/3.2 format puts there.
_SEPARATORS = re.compile(r"^[\s;]+")


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


# NOTE: plain json accepts NaN and Infinity, which json.dumps writes back as invalid JSON.
_DECODER = json.JSONDecoder(parse_constant=_reject_constant)


def _decode(text: str) -> Any:
    """The JSON value of `text`, or None when it is not JSON."""
    try:
        return _DECODER.decode(text)
    except ValueError:
        return None


@dataclass
class ToolCall:
    """One complete tool call, as a non-streamed response carries it."""

    id: str  # "call_" + 24 hex digits
    name: str
    arguments: str  # a JSON object, json.dumps(..., ensure_ascii=False)


@dataclass
class ExtractedToolCalls:
    """A whole generation split into text for the user and tool calls."""

    content: str | None  # text outside the calls; None when empty or whitespace only
    tool_calls: list[ToolCall]


@dataclass
class ToolCallDelta:
    """One OpenAI streamed `delta.tool_calls[]` entry."""

    index: int  # which call of this choice: 0, 1, ...
    id: str | None = None  # set, with name, only on a call's first delta
    name: str | None = None
    arguments: str = ""  # a fragment of the arguments JSON text


@dataclass
class StreamedDelta:
    """What one streamed chunk of generated text turns into."""

    content: str = ""  # text to send as delta.content
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


class ToolCallStreamer(Protocol):
    """A per-choice incremental parser: feed it each new piece of text, then finish it."""

    def feed(self, delta_text: str) -> StreamedDelta: ...
    def finish(self) -> StreamedDelta: ...


class ToolCallParser(Protocol):
    """One model family's tool-call format."""

    name: str

    def extract(self, text: str) -> ExtractedToolCalls: ...
    def streamer(self) -> ToolCallStreamer: ...


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]  # as vLLM makes them


def content_or_none(text: str) -> str | None:
    return text if text.strip() else None


def call_from_object(obj: Any) -> tuple[str, str] | None:
    """(name, arguments JSON) of a decoded call object, or None when it is not a call."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    keys = [key for key in obj if key in ARGUMENT_KEYS]
    args = obj[keys[0]] if keys else {}
    if isinstance(args, str):  # some models write the arguments as a JSON string
        args = _decode(args)
    if not isinstance(args, dict):
        return None
    return obj["name"], json.dumps(args, ensure_ascii=False)


def _held_suffix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that may be the start of `marker`."""
    sizes = range(min(len(text), len(marker) - 1), 0, -1)
    return next((size for size in sizes if marker.startswith(text[-size:])), 0)


class CallObjectStream:
    """One call object's text as it arrives, turned into deltas for call number `index`.

    A small scanner follows the JSON without parsing it (braces inside strings do not count):
    the id and name go out once the top-level "name" string is complete. An arguments object
    that starts after the name is sent as raw text while it arrives, so its fragments join into
    the very JSON the model wrote; otherwise the arguments go out whole when the object ends.
    """

    def __init__(self, index: int) -> None:
        self.index = index
        self.text = ""  # the object's text from its "{", up to its end once known
        self.ended = False
        self.committed = False  # the id and name have been sent
        self._name = ""
        self._args_start = -1  # the arguments object's "{", when it comes after the name
        self._args_end: int | None = None  # just past its "}"
        self._sent = 0  # characters of the raw arguments text already sent
        self._depth, self._in_string, self._escape, self._string_start = 0, False, False, 0
        self._key: object = None  # the top-level key being read or whose value comes next
        self._after_colon = False  # at depth 1: a value comes next, not a key

    def feed(self, text: str) -> tuple[list[ToolCallDelta], str]:
        """Deltas for `text`, and the text after the object's end ("" while it is open)."""
        start, rest = len(self.text), ""
        self.text += text
        for pos in range(start, len(self.text)):
            if self._step(pos):
                rest, self.text, self.ended = self.text[pos + 1 :], self.text[: pos + 1], True
                break
        delta = ToolCallDelta(self.index)
        if not self.committed and self._name:
            self.committed, delta.id, delta.name = True, new_call_id(), self._name
        if self.committed and self._args_start >= 0:
            stop = self._args_end if self._args_end is not None else len(self.text)
            delta.arguments = self.text[self._args_start + self._sent : stop]
            self._sent += len(delta.arguments)
        return ([delta] if delta.id or delta.arguments else []), rest

    def complete(self) -> list[ToolCallDelta] | None:
        """The rest of the call once the object has ended, or None when it is not a call."""
        call = call_from_object(_decode(self.text))
        if call is None:
            return None
        if not self.committed:
            self.committed = True
            return [ToolCallDelta(self.index, new_call_id(), *call)]
        return [] if self._args_start >= 0 else [ToolCallDelta(self.index, arguments=call[1])]

    def _step(self, pos: int) -> bool:
        """Scans one character; True when it closes the object."""
        char = self.text[pos]
        if self._depth == 0 and char != "{":
            return not char.isspace()  # anything but an object ends the scan at once
        if self._in_string:
            if self._escape:
                self._escape = False
            elif char == "\\":
                self._escape = True
            elif char == '"':
                self._in_string = False
                if self._depth == 1:
                    self._top_string(self.text[self._string_start : pos + 1])
        elif char == '"':
            self._in_string, self._string_start = True, pos
        elif char in "{[":
            args = self._depth == 1 and self._after_colon and self._key in ARGUMENT_KEYS
            if args and char == "{" and self._name and self._args_start < 0:
                self._args_start = pos
            self._depth += 1
        elif char in "}]":
            self._depth -= 1
            if self._depth == 1 and self._args_start >= 0 and self._args_end is None:
                self._args_end = pos + 1
            return self._depth == 0
        elif self._depth == 1 and char == ":":
            self._after_colon = True
        elif self._depth == 1 and char == ",":
            self._after_colon, self._key = False, None
        return False

    def _top_string(self, raw: str) -> None:
        value = _decode(raw)
        if not self._after_colon:
            self._key = value
        elif self._key == "name" and not self._name and isinstance(value, str):
            self._name = value


class _Streamer:
    """The loop both formats share: each state's handler consumes text and returns the rest."""

    _first_state = "plain"
    _after_call = "plain"  # the state after a complete call

    def __init__(self) -> None:
        self._state = self._first_state
        self._all = ""  # everything fed so far, to give back as content when a call fails
        self._held = ""  # text kept back until the next feed decides it
        self._call: CallObjectStream | None = None
        self._index = 0  # the next call's index
        self._revert_from = 0  # where in _all the current call's text starts

    def feed(self, delta_text: str) -> StreamedDelta:
        self._all += delta_text
        out, text, self._held = StreamedDelta(), self._held + delta_text, ""
        while text:
            text = getattr(self, "_on_" + self._state)(text, out)
        return out

    def _on_plain(self, text: str, out: StreamedDelta) -> str:
        out.content += text
        return ""

    def _start_call(self, text: str, revert_from: int | None = None) -> str:
        """Starts a call at `text`; if it fails, _all[revert_from:] becomes content."""
        self._state, self._call = "call", CallObjectStream(self._index)
        self._revert_from = len(self._all) - len(text) if revert_from is None else revert_from
        return text

    def _on_call(self, text: str, out: StreamedDelta) -> str:
        assert self._call is not None
        deltas, rest = self._call.feed(text)
        out.tool_calls += deltas
        if not self._call.ended:
            return ""
        done = self._call.complete()
        if done is None:
            return self._fail(rest, out)
        out.tool_calls += done
        self._index, self._call, self._state = self._index + 1, None, self._after_call
        return rest

    def _fail(self, rest: str, out: StreamedDelta) -> str:
        """Not a call after all: its text becomes content, and so does all that follows."""
        self._state = "plain"
        if self._call is not None and self._call.committed:
            return rest  # NOTE: its id and name are out already; nothing can take them back
        out.content += self._all[self._revert_from :]
        return ""

    def finish(self) -> StreamedDelta:
        """Flushes what was held back: undecided text, and a call cut short before its name."""
        out = StreamedDelta(self._held if self._state in ("text", "start") else "")
        if self._state == "call" and self._call is not None and not self._call.committed:
            out.content = self._all[self._revert_from :]
        return out


class _HermesStreamer(_Streamer):
    """States: text, call (from <tool_call>), close (before </tool_call>), plain."""

    _first_state, _after_call = "text", "close"

    def _on_text(self, text: str, out: StreamedDelta) -> str:
        found = text.find(HERMES_OPEN)
        if found < 0:
            keep = len(text) - _held_suffix(text, HERMES_OPEN)
            out.content, self._held = out.content + text[:keep], text[keep:]
            return ""
        out.content, marker = out.content + text[:found], len(self._all) - len(text) + found
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


class _Llama3JsonStreamer(_Streamer):
    """States: start (deciding text or calls), between (calls), call, plain."""

    _first_state, _after_call = "start", "between"

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
            self._state, out.content = "plain", self._all
            return ""
        return self._start_call(body, 0)  # the first call failing makes the whole text content

    def _on_between(self, text: str, out: StreamedDelta) -> str:
        body = _SEPARATORS.sub("", text, count=1)
        return self._start_call(body) if body else ""  # a non-object fails as a call


class HermesToolParser:
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`: Qwen 2/2.5/3, Hermes 2 Pro.

    A block whose JSON is not a call makes the whole text content (as vLLM); an unclosed block
    at the end is a call when its JSON is complete, else content (generation cut short).
    """

    name = "hermes"

    def extract(self, text: str) -> ExtractedToolCalls:
        pos, parts, calls = 0, [], []
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
    def _parse_block(text: str, pos: int) -> tuple[ToolCall, int] | None:
        body = text[pos:].lstrip()
        try:
            obj, end = _DECODER.raw_decode(body)
        except ValueError:
            return None
        call, rest = call_from_object(obj), body[end:].lstrip()
        if call is None or not (rest.startswith(HERMES_CLOSE) or HERMES_CLOSE.startswith(rest)):
            return None
        return ToolCall(new_call_id(), *call), len(text) - len(rest[len(HERMES_CLOSE) :])

    def streamer(self) -> ToolCallStreamer:
        return _HermesStreamer()


class Llama3JsonToolParser:
    """Llama 3.1/3.2 JSON calls: `<|python_tag|>`? `{"name": ..., "parameters": {...}}`, `;`-joined.

    Text that does not start with `{` (past the tag) is plain content, and so is the whole text
    when any part of it fails to be a call.
    """

    name = "llama3_json"

    def extract(self, text: str) -> ExtractedToolCalls:
        body = text.strip().removeprefix(PYTHON_TAG).lstrip()
        calls: list[ToolCall] = []
        while body.startswith("{"):
            try:
                obj, end = _DECODER.raw_decode(body)
            except ValueError:
                break
            if (call := call_from_object(obj)) is None:
                break
            calls.append(ToolCall(new_call_id(), *call))
            body = _SEPARATORS.sub("", body[end:], count=1)
        if body or not calls:
            return ExtractedToolCalls(content_or_none(text), [])
        return ExtractedToolCalls(None, calls)

    def streamer(self) -> ToolCallStreamer:
        return _Llama3JsonStreamer()


TOOL_CALL_PARSERS: dict[str, ToolCallParser] = {
    "hermes": HermesToolParser(),
    "llama3_json": Llama3JsonToolParser(),
}


def tool_parser_for(name: str, chat_template: str | None) -> ToolCallParser:
    """The parser called `name`; "auto" picks it from the chat template's text."""
    if name == "auto":
        template = chat_template or ""
        if HERMES_OPEN not in template and (PYTHON_TAG in template or "ipython" in template):
            return TOOL_CALL_PARSERS["llama3_json"]
        return TOOL_CALL_PARSERS["hermes"]
    if name not in TOOL_CALL_PARSERS:
        choices = ", ".join(["auto", *TOOL_CALL_PARSERS])
        raise ValueError(f"tool_call_parser: unknown parser {name!r}; choose one of {choices}")
    return TOOL_CALL_PARSERS[name]
