"""What every tool-call format shares: the calls and deltas it makes, the parser and streamer
interfaces, and the reading of one call object (`{"name": ..., "arguments": {...}}`)."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any, Protocol

# Where a call object keeps its arguments; the first of these keys present wins.
ARGUMENT_KEYS = ("arguments", "parameters")


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


# NOTE: plain json accepts NaN and Infinity, which json.dumps writes back as invalid JSON.
JSON_DECODER = json.JSONDecoder(parse_constant=_reject_constant)


def decode_json(text: str) -> Any:
    """The JSON value of `text`, or None when it is not JSON."""
    try:
        return JSON_DECODER.decode(text)
    except ValueError:
        return None


@dataclass
class ParsedCall:
    """One complete tool call read out of text, as a non-streamed response carries it."""

    id: str  # "call_" + 24 hex digits
    name: str
    arguments: str  # a JSON object, json.dumps(..., ensure_ascii=False)


@dataclass
class ExtractedToolCalls:
    """A whole generation split into text for the user and tool calls."""

    content: str | None  # text outside the calls; None when empty or whitespace only
    tool_calls: list[ParsedCall]


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
        args = decode_json(args)
    if not isinstance(args, dict):
        return None
    return obj["name"], json.dumps(args, ensure_ascii=False)


def held_suffix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that may be the start of `marker`."""
    sizes = range(min(len(text), len(marker) - 1), 0, -1)
    return next((size for size in sizes if marker.startswith(text[-size:])), 0)
