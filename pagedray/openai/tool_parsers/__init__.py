"""Tool calls parsed out of generated text, one module per model family's format, as vLLM's
parsers are: models write calls as text, the API returns `tool_calls`. Streaming gives the same
answer as the whole-text parse: text that may yet become a call marker is held back.
"""

from __future__ import annotations

from pagedray.openai.tool_parsers.base import (
    ExtractedToolCalls,
    ParsedCall,
    StreamedDelta,
    ToolCallDelta,
    ToolCallParser,
    ToolCallStreamer,
    content_or_none,
)
from pagedray.openai.tool_parsers.hermes import HERMES_OPEN, HermesToolParser
from pagedray.openai.tool_parsers.llama3_json import PYTHON_TAG, Llama3JsonToolParser

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


__all__ = [
    "TOOL_CALL_PARSERS",
    "ExtractedToolCalls",
    "ParsedCall",
    "StreamedDelta",
    "ToolCallDelta",
    "ToolCallParser",
    "ToolCallStreamer",
    "content_or_none",
    "tool_parser_for",
]
