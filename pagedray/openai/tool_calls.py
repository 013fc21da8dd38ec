"""How one chat request's generated text becomes OpenAI tool calls, whole or streamed.

With `tool_choice="auto"` the model writes calls in its own format and the configured parser
(`--tool-call-parser`, vLLM's flag) reads them out of the text; with `required` or a named
function the output was constrained to the calls' JSON (see `constraints.py`) and is read as
such. `finish_reason` becomes "tool_calls" when the model chose to call ("auto", "required"), as
OpenAI reports it; a named function keeps "stop", as OpenAI's forced calls do.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagedray.openai.constraints import DeltaFunctionCall, DeltaToolCall, FunctionCall, ToolCall
from pagedray.openai.tool_choice import ConstrainedToolCallStreamer, constrained_tool_calls
from pagedray.openai.tool_parsers import (
    ParsedCall,
    ToolCallParser,
    ToolCallStreamer,
    content_or_none,
    tool_parser_for,
)
from pagedray.openai.tool_parsers.base import new_call_id


@dataclass
class ToolCallOutput:
    """A chat request's tools and choice; None of it applies when there are no tools or the
    choice is "none" (`ToolCallOutput.of` returns None then)."""

    tools: list[dict[str, Any]]
    tool_choice: Any  # "auto", "required" or {"type": "function", "function": {"name"}}
    parser: ToolCallParser | None  # "auto" only: reads calls out of free text

    @classmethod
    def of(
        cls, tools: list[dict[str, Any]] | None, tool_choice: Any, parser_name: str, template: Any
    ) -> ToolCallOutput | None:
        if not tools or tool_choice == "none":
            return None
        template_text = template if isinstance(template, str) else None
        parser = tool_parser_for(parser_name, template_text) if tool_choice == "auto" else None
        return cls(tools, tool_choice, parser)

    def extract(
        self, text: str, finish_reason: str | None
    ) -> tuple[str | None, list[ToolCall] | None, str | None]:
        """(content, tool calls or None, finish reason) of a whole generation."""
        if self.parser is not None:
            extracted = self.parser.extract(text)
            calls, content = extracted.tool_calls, extracted.content
        else:
            try:
                calls, content = constrained_tool_calls(text, self.tools, self.tool_choice), None
            except ValueError:  # cut short (max_tokens): the partial calls, as when streamed
                return None, self._partial_calls(text), finish_reason
        if not calls:
            return content_or_none(text) if self.parser else text, None, finish_reason
        return content, [_call(c) for c in calls], self.finish_reason(finish_reason)

    def finish_reason(self, finish_reason: str | None) -> str | None:
        """The reason to report for a choice that made calls."""
        named = isinstance(self.tool_choice, dict)
        return "tool_calls" if finish_reason == "stop" and not named else finish_reason

    def streamer(self) -> ChoiceToolStream:
        if self.parser is not None:
            return ChoiceToolStream(self, self.parser.streamer())
        names = [tool["function"]["name"] for tool in self.tools]
        return ChoiceToolStream(self, ConstrainedToolCallStreamer(self.tool_choice, names))

    def _partial_calls(self, text: str) -> list[ToolCall] | None:
        """The calls of forced output cut short, exactly as its stream would send them: each
        with the arguments written so far (OpenAI's shape for `finish_reason: "length"`)."""
        _, deltas = self.streamer().feed(text, finished=True)
        calls: dict[int, ToolCall] = {}
        for delta in deltas or []:
            function = delta.function
            if delta.index not in calls:
                name = function.name if function is not None else None
                call_id = delta.id or new_call_id()
                calls[delta.index] = ToolCall(
                    id=call_id, function=FunctionCall(name=name or "", arguments="")
                )
            if function is not None and function.arguments:
                calls[delta.index].function.arguments += function.arguments
        return [calls[index] for index in sorted(calls)] or None


@dataclass
class ChoiceToolStream:
    """One streamed choice's text split into content and tool-call deltas."""

    output: ToolCallOutput
    streamer: ToolCallStreamer
    made_calls: bool = False

    def feed(self, text: str, finished: bool) -> tuple[str | None, list[DeltaToolCall] | None]:
        """(content, tool-call deltas) for a piece of text; `finished`: its last piece."""
        parts = [self.streamer.feed(text)] if text else []
        if finished:
            parts.append(self.streamer.finish())
        content = "".join(part.content for part in parts)
        deltas = [_delta(d) for part in parts for d in part.tool_calls]
        self.made_calls = self.made_calls or bool(deltas)
        return content or None, deltas or None

    def finish_reason(self, finish_reason: str | None) -> str | None:
        if not self.made_calls:
            return finish_reason
        return self.output.finish_reason(finish_reason)


def _call(call: ParsedCall) -> ToolCall:
    return ToolCall(id=call.id, function=FunctionCall(name=call.name, arguments=call.arguments))


def _delta(delta: Any) -> DeltaToolCall:
    if delta.id is not None:  # a call's first delta: id, type and name, as OpenAI sends it
        function = DeltaFunctionCall(name=delta.name, arguments=delta.arguments)
        return DeltaToolCall(index=delta.index, id=delta.id, type="function", function=function)
    return DeltaToolCall(index=delta.index, function=DeltaFunctionCall(arguments=delta.arguments))
