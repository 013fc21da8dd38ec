"""tool_choice "required" or a named function, as a JSON schema the output must follow, and back.

Forced calls are not parsed out of free text: generation is constrained to a schema (as vLLM's),
so the output is the arguments object itself, or an array of {"name", "parameters"} items.
"""

from __future__ import annotations

import copy
import json
import re
from typing import Any

from pagedray.openai.tool_parsers.base import (
    ParsedCall,
    StreamedDelta,
    ToolCallDelta,
    call_from_object,
    new_call_id,
)
from pagedray.openai.tool_parsers.call_object_stream import CallObjectStream
from pagedray.scheduler.request_failure import refusal

# The "name" string of a call object, cut off before its closing quote.
_PARTIAL_NAME = re.compile(r'"name"\s*:\s*"([a-zA-Z0-9_-]*)$')
# OpenAI's rule for function names.
DEFINITION_KEYS = ("$defs", "definitions")
_FUNCTION_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
_CHOICE_SHAPE = "'none', 'auto', 'required' or a named function"


def _empty_parameters() -> dict[str, Any]:
    return {"type": "object", "properties": {}}


def check_tools(tools: Any, tool_choice: Any, parallel_tool_calls: Any) -> None:
    """Raises `RequestRefused` naming the field unless the three fields make a valid request."""
    names = _check_tool_list(tools)
    kind, name = _choice(tool_choice)
    if kind in ("required", "named") and not names:
        raise refusal("tool_choice", "requires tools")
    if kind == "named" and name not in names:
        raise refusal("tool_choice", f"function {name!r} is not among the tools")
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        raise refusal("parallel_tool_calls", "must be a boolean")


def _check_tool_list(tools: Any) -> list[str]:
    """The function names of a valid tools list."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise refusal("tools", "must be a list")
    names: list[str] = []
    for idx, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise refusal("tools", f'tool {idx} must be {{"type": "function", ...}}')
        function = tool.get("function")
        if not isinstance(function, dict):
            raise refusal("tools", f"tool {idx} has no function")
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise refusal("tools", f"tool {idx} has no function name")
        if not _FUNCTION_NAME.fullmatch(name):
            raise refusal(
                "tools", f"function name {name!r} must be 1 to 64 letters, digits, '_' or '-'"
            )
        if name in names:
            raise refusal("tools", f"duplicate function name {name!r}")
        if function.get("parameters") is not None and not isinstance(function["parameters"], dict):
            raise refusal("tools", f"function {name!r} parameters must be a JSON schema object")
        if not isinstance(function.get("description", ""), str):
            raise refusal("tools", f"function {name!r} description must be a string")
        if not isinstance(function.get("strict", False), bool):
            raise refusal("tools", f"function {name!r} strict must be a boolean")
        names.append(name)
    return names


def _choice(tool_choice: Any) -> tuple[str, str | None]:
    """("none" | "auto" | "required" | "named", the named function); None means "auto"."""
    if tool_choice is None:
        return "auto", None
    if tool_choice in ("none", "auto", "required"):
        return tool_choice, None
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        function = tool_choice.get("function")
        if isinstance(function, dict) and isinstance(function.get("name"), str):
            return "named", function["name"]
    raise refusal("tool_choice", f"must be {_CHOICE_SHAPE}")


def _functions(tools: list[dict[str, Any]] | None) -> dict[str, dict[str, Any]]:
    return {tool["function"]["name"]: tool["function"] for tool in tools or []}


def _parameters(function: dict[str, Any]) -> dict[str, Any]:
    """A copy of the function's parameters schema; none (or {}) is an empty object, as vLLM."""
    return copy.deepcopy(function.get("parameters")) or _empty_parameters()


def tool_choice_schema(
    tools: list[dict[str, Any]] | None, tool_choice: Any, parallel_tool_calls: bool | None
) -> dict[str, Any] | None:
    """The JSON schema the output must follow, or None when generation is free.

    A named function: its parameters (the output is the arguments object). "required": an array
    of {"name", "parameters"} items, one schema per tool, at most one item without parallel calls.
    """
    kind, name = _choice(tool_choice)
    functions = _functions(tools)
    if not functions or kind in ("none", "auto"):
        return None
    if kind == "named":
        return _parameters(functions[name or ""])
    items: list[dict[str, Any]] = []
    defs: dict[str, dict[str, Any]] = {}
    for function_name, function in functions.items():
        parameters = _parameters(function)
        _lift_defs(parameters, defs)
        items.append(
            {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "enum": [function_name]},
                    "parameters": parameters,
                },
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
        )
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
    if parallel_tool_calls is False:
        schema["maxItems"] = 1
    schema.update(defs)
    return schema


def _lift_defs(parameters: dict[str, Any], defs: dict[str, dict[str, Any]]) -> None:
    """Moves `$defs` (and draft-07's `definitions`) to the root, where the parameters'
    "#/$defs/..." and "#/definitions/..." references now point."""
    for key in DEFINITION_KEYS:
        lifted = parameters.pop(key, {})
        if not isinstance(lifted, dict):
            raise refusal("tools", f"a function's parameters.{key} must be an object")
        for name, definition in lifted.items():
            if defs.setdefault(key, {}).setdefault(name, definition) != definition:
                raise refusal("tools", f"functions define {key} {name!r} differently")


def constrained_tool_calls(
    text: str, tools: list[dict[str, Any]] | None, tool_choice: Any
) -> list[ParsedCall]:
    """The calls in output generated under tool_choice_schema.

    Raises ValueError when the text is not such output (generation cut short by max_tokens);
    the caller then returns the text as content.
    """
    kind, name = _choice(tool_choice)
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        raise refusal("tool_choice", "the output is not complete JSON") from None
    if kind == "named" and isinstance(value, dict):
        return [ParsedCall(new_call_id(), name or "", json.dumps(value, ensure_ascii=False))]
    if kind != "required" or not isinstance(value, list) or not value:
        raise refusal("tool_choice", f"the output does not follow {kind!r}")
    calls, functions = [], _functions(tools)
    for item in value:
        call = call_from_object(item)
        if call is None or call[0] not in functions:
            raise refusal("tool_choice", f"{json.dumps(item)[:80]} is not a call of a tool")
        calls.append(ParsedCall(new_call_id(), *call))
    return calls


class ConstrainedToolCallStreamer:
    """Streamed tool-call deltas from output generated under tool_choice_schema.

    No content is ever sent while calls are forced. A named function's call goes out with the
    first piece of text, which is all arguments; "required" items go out as CallObjectStream
    reads them: id and name first, then the parameters as they arrive. Output cut short
    (max_tokens) keeps the partial call it holds, as OpenAI returns one: `finish` sends the
    first call even before its name was written out, when the grammar left one tool it can be.
    """

    def __init__(self, tool_choice: Any, tool_names: list[str] | None = None) -> None:
        kind, self._name = _choice(tool_choice)
        if kind not in ("named", "required"):
            raise refusal("tool_choice", f"{kind!r} does not constrain the output")
        self._tool_names = list(tool_names or [])
        self._started = False  # the named call's id and name have been sent
        self._state = "start"  # required: start (before "["), array, done (after "]")
        self._call: CallObjectStream | None = None
        self._index = 0  # the next item's call index

    def feed(self, delta_text: str) -> StreamedDelta:
        out = StreamedDelta()
        if self._name is not None:
            delta = ToolCallDelta(0, arguments=delta_text)
            if not self._started:
                self._started, delta.id, delta.name = True, new_call_id(), self._name
            out.tool_calls += [delta] if delta.id or delta.arguments else []
            return out
        text = delta_text
        while text:
            text = self._advance(text, out)
        return out

    def finish(self) -> StreamedDelta:
        """Nothing is held back: an item cut short keeps what it sent. A "required" output cut
        before its first call's name was complete still names that call, if the grammar allowed
        one tool only (the ones whose names start as the partial name does)."""
        out = StreamedDelta()
        if self._name is not None:  # the call is known from the start, written or not
            if not self._started:
                self._started = True
                out.tool_calls.append(ToolCallDelta(0, new_call_id(), self._name))
            return out
        started = self._call is not None and self._call.committed
        if self._index > 0 or started or self._state == "done":
            return out
        partial = _PARTIAL_NAME.search(self._call.text) if self._call is not None else None
        prefix = partial.group(1) if partial else ""
        candidates = [name for name in self._tool_names if name.startswith(prefix)]
        if len(candidates) == 1:
            out.tool_calls.append(ToolCallDelta(0, new_call_id(), candidates[0]))
        return out

    def _advance(self, text: str, out: StreamedDelta) -> str:
        """Consumes some of `text` for the "required" array; returns the rest."""
        if self._call is not None:
            deltas, rest = self._call.feed(text)
            out.tool_calls += deltas
            if self._call.ended:
                out.tool_calls += self._call.complete() or []
                self._index += int(self._call.committed)
                self._call = None
            return rest
        body = text.lstrip()
        if not body or self._state == "done":
            return ""
        if self._state == "array" and body[0] == "{":
            self._call = CallObjectStream(self._index)
            return body
        if body[0] in "[]":  # NOTE: "[" inside an item is read by the item's scanner
            self._state = "array" if body[0] == "[" else "done"
        return body[1:]  # "," between items


def tools_for_template(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """The tools as HF chat templates expect them: copied, with missing parameters filled."""
    result = []
    for tool in tools or []:
        tool = {**copy.deepcopy(tool), "type": "function"}
        if tool["function"].get("parameters") is None:
            tool["function"]["parameters"] = _empty_parameters()
        result.append(tool)
    return result
