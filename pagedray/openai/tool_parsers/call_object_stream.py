"""One call object's text as it arrives, turned into streamed tool-call deltas: what every
format's streamer (and the forced calls of `tool_choice`) runs on each call."""

from __future__ import annotations

from pagedray.openai.tool_parsers.base import (
    ARGUMENT_KEYS,
    ToolCallDelta,
    call_from_object,
    decode_json,
    new_call_id,
)


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
        # The scanner: nesting depth, inside a string (after a backslash), the string's start.
        self._depth = 0
        self._in_string = False
        self._escape = False
        self._string_start = 0
        self._key: object = None  # the top-level key being read or whose value comes next
        self._after_colon = False  # at depth 1: a value comes next, not a key

    def feed(self, text: str) -> tuple[list[ToolCallDelta], str]:
        """Deltas for `text`, and the text after the object's end ("" while it is open)."""
        start = len(self.text)
        rest = ""
        self.text += text
        for pos in range(start, len(self.text)):
            if self._step(pos):
                rest = self.text[pos + 1 :]
                self.text = self.text[: pos + 1]
                self.ended = True
                break
        delta = ToolCallDelta(self.index)
        if not self.committed and self._name:
            self.committed = True
            delta.id = new_call_id()
            delta.name = self._name
        if self.committed and self._args_start >= 0:
            stop = self._args_end if self._args_end is not None else len(self.text)
            delta.arguments = self.text[self._args_start + self._sent : stop]
            self._sent += len(delta.arguments)
        return ([delta] if delta.id or delta.arguments else []), rest

    def complete(self) -> list[ToolCallDelta] | None:
        """The rest of the call once the object has ended, or None when it is not a call."""
        call = call_from_object(decode_json(self.text))
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
            self._in_string = True
            self._string_start = pos
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
            self._after_colon = False
            self._key = None
        return False

    def _top_string(self, raw: str) -> None:
        value = decode_json(raw)
        if not self._after_colon:
            self._key = value
        elif self._key == "name" and not self._name and isinstance(value, str):
            self._name = value
