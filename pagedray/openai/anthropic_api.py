"""Anthropic's Messages API (`/v1/messages`, `/v1/messages/count_tokens`) as a translation onto
the chat-completions path, as vLLM's `entrypoints/anthropic` and llama.cpp's server do it.

A Messages request becomes a chat body (`to_chat_body`): the system prompt a system message,
`tool_use` blocks an assistant's tool calls, `tool_result` blocks tool messages, the tools and
`tool_choice` chat's. Everything after that (the template, structured tool arguments, admission,
routing, metrics) is the chat path's. `anthropic_flow.py` shapes what comes back. No engine, no
Ray.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, model_validator

from pagedray.openai.protocol import chat_tool_call
from pagedray.scheduler.request_failure import refusal

# What a chat request's error names, in the field this API calls it.
CHAT_TO_ANTHROPIC_FIELDS = {
    "stop": "stop_sequences",
    "max_completion_tokens": "max_tokens",
    "parallel_tool_calls": "tool_choice",
    "continue_final_message": "messages",
    "response_format": "output_config",
}
# Blocks a text model cannot take: refused with a message naming them.
_BLOCK_TYPES_REFUSED = ("image", "document", "search_result", "container_upload")


class _Block(BaseModel):
    # cache_control, citations and the like change nothing here.
    model_config = ConfigDict(extra="ignore")


class TextBlock(_Block):
    type: Literal["text"]
    text: str


class ToolUseBlock(_Block):
    """A call the assistant made earlier, sent back in the conversation."""

    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(_Block):
    """A user's answer to a `tool_use` with the same id: text, or text blocks."""

    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] = ""
    is_error: bool = False

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(block.text for block in self.content)


class ThinkingBlock(_Block):
    """An earlier turn's reasoning, echoed back by clients: accepted and left out, as thinking
    models' templates leave earlier thinking out."""

    type: Literal["thinking", "redacted_thinking"]


def _block_type(block: Any) -> str:
    value = block.get("type") if isinstance(block, dict) else getattr(block, "type", None)
    return str(value)


ContentBlock = Annotated[
    Annotated[TextBlock, Tag("text")]
    | Annotated[ToolUseBlock, Tag("tool_use")]
    | Annotated[ToolResultBlock, Tag("tool_result")]
    | Annotated[ThinkingBlock, Tag("thinking")]
    | Annotated[ThinkingBlock, Tag("redacted_thinking")],
    Discriminator(_block_type),
]


class AnthropicMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]


class AnthropicTool(BaseModel):
    """A client tool (`type` absent or "custom"); Anthropic's server tools run on its side."""

    model_config = ConfigDict(extra="ignore")

    name: str
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None


class AnthropicToolChoice(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None

    @model_validator(mode="after")
    def _named(self) -> AnthropicToolChoice:
        if self.type == "tool" and not self.name:
            raise refusal("tool_choice", "a name is required when type is 'tool'")
        return self


class OutputFormat(BaseModel):
    """Structured outputs: the text follows `schema` (named `schema_` here, as `schema` shadows
    a BaseModel method)."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(BaseModel):
    # `effort` is not read: `thinking` turns a thinking model's thinking off.
    model_config = ConfigDict(extra="ignore")

    format: OutputFormat | None = None


class Metadata(BaseModel):
    model_config = ConfigDict(extra="ignore")

    user_id: str | None = None


class _Conversation(BaseModel):
    """What both routes read: the conversation, its system prompt and its tools."""

    # Unknown fields (service_tier, container, ...) change nothing here.
    model_config = ConfigDict(extra="ignore")

    model: str
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    # {"type": "enabled", "budget_tokens": N} or {"type": "disabled"}: disabled turns a thinking
    # model's thinking off (reasoning_effort "none", as vLLM maps it); the budget is held as
    # `thinking_token_budget` (vLLM's mapping) by a server with a reasoning parser.
    thinking: dict[str, Any] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None

    @model_validator(mode="before")
    @classmethod
    def _check_supported(cls, data: Any) -> Any:
        # Before field validation, so an unsupported block or tool is named in one clear
        # "field: message" error rather than a union's list of mismatches.
        if isinstance(data, dict):
            _check_blocks(data.get("messages"))
            _check_tools(data.get("tools"))
        return data


class MessagesRequest(_Conversation):
    """A `POST /v1/messages` body."""

    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    stream: bool = False
    output_config: OutputConfig | None = None
    metadata: Metadata | None = None
    # Anthropic's API no longer documents these (its SDK 2.x does not send them); older clients
    # do, and they still shape sampling here.
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = None
    top_k: int | None = None

    @property
    def thinking_budget(self) -> int | None:
        """`thinking: {"type": "enabled", "budget_tokens": N}`'s N."""
        thinking = self.thinking or {}
        budget = thinking.get("budget_tokens")
        enabled = thinking.get("type") == "enabled"
        if not enabled or isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
            return None
        return budget


class CountTokensRequest(_Conversation):
    """A `POST /v1/messages/count_tokens` body."""


def _check_blocks(messages: Any) -> None:
    if not isinstance(messages, list):
        return
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        for j, block in enumerate(content if isinstance(content, list) else []):
            kind = block.get("type") if isinstance(block, dict) else None
            if kind in _BLOCK_TYPES_REFUSED:
                raise refusal(
                    f"messages.{i}.content.{j}",
                    f"{kind} blocks are not supported (the model reads text)",
                )


def _check_tools(tools: Any) -> None:
    if not isinstance(tools, list):
        return
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind not in (None, "custom"):
            raise refusal(
                f"tools.{i}",
                f"server tool {kind!r} is not supported; tools run by the client "
                "(with an input_schema) are",
            )


# ---- conversion to a chat request --------------------------------------------------------------


def to_chat_body(request: MessagesRequest | CountTokensRequest) -> dict[str, Any]:
    """The chat-completions body for a Messages request. A conversation that ends with the
    assistant's text continues that text (Anthropic's prefill), as vLLM's
    `continue_final_message` does; `stream` is left to the caller."""
    messages: list[dict[str, Any]] = []
    system = _system_text(request.system)
    if system:
        messages.append({"role": "system", "content": system})
    for message in request.messages:
        messages.extend(_chat_messages(message))
    body: dict[str, Any] = {"model": request.model, "messages": messages}
    last = messages[-1] if messages else None
    if last is not None and last["role"] == "assistant" and not last.get("tool_calls"):
        body.update(add_generation_prompt=False, continue_final_message=True)
    if request.tools:
        body["tools"] = [_chat_tool(tool) for tool in request.tools]
        _add_tool_choice(body, request.tool_choice)
    if request.thinking is not None and request.thinking.get("type") == "disabled":
        body["reasoning_effort"] = "none"  # counted as the Messages call renders it too
    if isinstance(request, MessagesRequest) and request.thinking_budget is not None:
        body["thinking_token_budget"] = request.thinking_budget
    if isinstance(request, MessagesRequest):
        body["max_tokens"] = request.max_tokens
        optional = {
            "stop": request.stop_sequences,
            "temperature": request.temperature,
            "top_p": request.top_p,
            "top_k": request.top_k,
            "user": request.metadata.user_id if request.metadata else None,
        }
        body.update({key: value for key, value in optional.items() if value is not None})
        output_format = request.output_config.format if request.output_config else None
        if output_format is not None:
            json_schema = {"name": "output", "schema": output_format.schema_, "strict": True}
            body["response_format"] = {"type": "json_schema", "json_schema": json_schema}
    return body


def _system_text(system: str | list[TextBlock] | None) -> str:
    if system is None or isinstance(system, str):
        return system or ""
    return "\n".join(block.text for block in system)


def _chat_messages(message: AnthropicMessage) -> list[dict[str, Any]]:
    """One Anthropic message as chat messages: a user's `tool_result` blocks become tool
    messages (before its text, as Anthropic orders them), an assistant's `tool_use` blocks
    its tool calls."""
    if isinstance(message.content, str):
        return [{"role": message.role, "content": message.content}]
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    for block in message.content:
        if isinstance(block, TextBlock):
            texts.append(block.text)
        elif isinstance(block, ToolUseBlock):
            arguments = json.dumps(block.input, ensure_ascii=False)
            calls.append(chat_tool_call(block.id, block.name, arguments))
        elif isinstance(block, ToolResultBlock):
            content = block.text()
            results.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": content})
    chat: list[dict[str, Any]] = list(results)
    text = "".join(texts)
    if calls:
        chat.append({"role": "assistant", "content": text or None, "tool_calls": calls})
    elif text or not results:
        chat.append({"role": message.role, "content": text})
    return chat


def _chat_tool(tool: AnthropicTool) -> dict[str, Any]:
    function: dict[str, Any] = {"name": tool.name, "parameters": tool.input_schema}
    if tool.description is not None:
        function["description"] = tool.description
    return {"type": "function", "function": function}


def _add_tool_choice(body: dict[str, Any], choice: AnthropicToolChoice | None) -> None:
    if choice is None:
        return
    if choice.type == "tool":
        body["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
    else:
        body["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
    if choice.disable_parallel_tool_use is not None:
        body["parallel_tool_calls"] = not choice.disable_parallel_tool_use


__all__ = [
    "CHAT_TO_ANTHROPIC_FIELDS",
    "CountTokensRequest",
    "MessagesRequest",
    "to_chat_body",
]
