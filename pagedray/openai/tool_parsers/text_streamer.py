"""The streaming loop every text format shares: a state machine over the generated text, each
state's handler consuming some of it; a format adds the states before and between its calls."""

from __future__ import annotations

from pagedray.openai.tool_parsers.base import StreamedDelta
from pagedray.openai.tool_parsers.call_object_stream import CallObjectStream


class TextCallStreamer:
    """Feeds each piece of text to the current state's `_on_<state>` handler, which returns the
    rest. The `call` state reads one call object; a call that turns out not to be one makes its
    text (and all that follows) content."""

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
        out = StreamedDelta()
        text = self._held + delta_text
        self._held = ""
        while text:
            text = getattr(self, "_on_" + self._state)(text, out)
        return out

    def _on_plain(self, text: str, out: StreamedDelta) -> str:
        out.content += text
        return ""

    def _start_call(self, text: str, revert_from: int | None = None) -> str:
        """Starts a call at `text`; if it fails, _all[revert_from:] becomes content."""
        self._state = "call"
        self._call = CallObjectStream(self._index)
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
        self._index += 1
        self._call = None
        self._state = self._after_call
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
