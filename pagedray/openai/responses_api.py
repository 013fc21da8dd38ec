"""OpenAI's Responses API (`/v1/responses`) as a translation onto our chat-completions path.

A Responses request becomes a chat body (`to_chat_body`), the chat result becomes a Response
object (`response_objects.build_response`), and the conversation is stored so
`previous_response_id` can continue it (`conversation_after`). No engine, no Ray.
"""

from __future__ import annotations

import copy
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, model_validator

from pagedray.openai.protocol import chat_tool_call
from pagedray.scheduler.request_failure import refusal

# The key under which `to_chat_body` records how many leading messages came from
# `instructions`; ChatCompletionRequest ignores unknown keys, and `conversation_after` drops those
# messages, as OpenAI does not carry instructions over to a follow-up response.
NUM_INSTRUCTION_MESSAGES_KEY = "num_instruction_messages"

_TEXT_PART_TYPES = ("input_text", "output_text")
_ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")

# ---- request ---------------------------------------------------------------------------------


class InputTextPart(BaseModel):
    """A text part of an input message (`output_text` when an earlier output is sent back)."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["input_text", "output_text"]
    text: str


class InputMessage(BaseModel):
    """A message item, with or without `"type": "message"` (the SDK's "easy" message)."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[InputTextPart]


class FunctionCallItem(BaseModel):
    """A function call the model made earlier, sent back as input."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class FunctionCallOutputItem(BaseModel):
    """The result of a function call, answering the call with the same `call_id`."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["function_call_output"]
    call_id: str
    output: str


class ReasoningInputItem(BaseModel):
    """An earlier answer's reasoning item, sent back with its output: accepted and left out of
    the conversation, as thinking models' templates leave earlier thinking out."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["reasoning"]


def _item_type(item: Any) -> str:
    if isinstance(item, dict):
        return str(item.get("type", "message"))
    return str(getattr(item, "type", "message"))


InputItem = Annotated[
    Annotated[InputMessage, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningInputItem, Tag("reasoning")],
    Discriminator(_item_type),
]


class FunctionTool(BaseModel):
    """A function tool in Responses' flat shape (name at the top level, not under `function`)."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedToolChoice(BaseModel):
    """`tool_choice` forcing one named function."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["function"]
    name: str


class TextFormatText(BaseModel):
    """Plain text output (the default)."""

    type: Literal["text"] = "text"


class TextFormatJsonObject(BaseModel):
    """Any JSON object."""

    type: Literal["json_object"]


class TextFormatJsonSchema(BaseModel):
    """JSON that follows `schema` (named `schema_` here, as `schema` shadows a BaseModel method)."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    type: Literal["json_schema"]
    name: str
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None
    description: str | None = None


class TextConfig(BaseModel):
    """The `text` field: the output format."""

    model_config = ConfigDict(extra="ignore")

    format: TextFormatText | TextFormatJsonObject | TextFormatJsonSchema = Field(
        default_factory=TextFormatText, discriminator="type"
    )


class ResponsesRequest(BaseModel):
    """A `POST /v1/responses` body; `reasoning.effort` becomes chat's `reasoning_effort`
    (`truncation` and `include` are ignored)."""

    # Unknown fields are ignored, as OpenAI clients send fields that do not change sampling.
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool = True
    stream: bool = False
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: dict[str, Any] | None = None  # {"effort": ..., "summary": ...}
    metadata: dict[str, str] | None = None
    user: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _check_supported(cls, data: Any) -> Any:
        # Before field validation, so an unsupported tool or part is named in one clear
        # "field: message" error rather than a union's list of mismatches.
        if isinstance(data, dict):
            _check_tools(data.get("tools"))
            _check_input(data.get("input"))
        return data


def _check_tools(tools: Any) -> None:
    if not isinstance(tools, list):
        return
    for tool in tools:
        if isinstance(tool, dict) and tool.get("type") != "function":
            raise refusal("tools", "only function tools are supported")


def _check_input(items: Any) -> None:
    if not isinstance(items, list):
        return
    for idx, item in enumerate(items):
        if not isinstance(item, dict):
            continue
        item_type = item.get("type", "message")
        if item_type not in _ITEM_TYPES:
            raise refusal("input", f"item {idx}: type {item_type!r} is not supported")
        content = item.get("content")
        if item_type != "message" or not isinstance(content, list):
            continue
        for part in content:
            part_type = part.get("type") if isinstance(part, dict) else None
            if part_type not in _TEXT_PART_TYPES:
                raise refusal(
                    "input", f"item {idx}: content part type {part_type!r} is not supported"
                )


# ---- conversion to a chat request --------------------------------------------------------------


def to_chat_body(request: ResponsesRequest, history: list[dict] | None) -> dict:
    """The chat-completions body for `request`, after `history` (the previous response's stored
    conversation). `stream` is left to the caller."""
    messages: list[dict[str, Any]] = []
    if request.instructions:
        messages.append({"role": "system", "content": request.instructions})
    body: dict[str, Any] = {NUM_INSTRUCTION_MESSAGES_KEY: len(messages)}
    messages.extend(copy.deepcopy(history or []))
    messages.extend(_input_messages(request.input))
    body["messages"] = messages
    optional = {
        "model": request.model,
        "max_tokens": request.max_output_tokens,
        "temperature": request.temperature,
        "top_p": request.top_p,
        "seed": request.seed,
        "user": request.user,
        "reasoning_effort": (request.reasoning or {}).get("effort"),
    }
    body.update({key: value for key, value in optional.items() if value is not None})
    # NOTE: OpenAI's chat API refuses an empty `tools` and a `tool_choice` without tools.
    if request.tools:
        body["tools"] = [_chat_tool(tool) for tool in request.tools]
        if request.tool_choice is not None:
            body["tool_choice"] = _chat_tool_choice(request.tool_choice)
        if request.parallel_tool_calls is not None:
            body["parallel_tool_calls"] = request.parallel_tool_calls
    if request.text is not None and not isinstance(request.text.format, TextFormatText):
        body["response_format"] = _chat_response_format(request.text.format)
    return body


def _input_messages(input_items: str | list[Any]) -> list[dict[str, Any]]:
    if isinstance(input_items, str):
        return [{"role": "user", "content": input_items}]
    messages: list[dict[str, Any]] = []
    for item in input_items:
        if isinstance(item, InputMessage):
            messages.append({"role": item.role, "content": _chat_content(item.content)})
        elif isinstance(item, FunctionCallItem):
            call = chat_tool_call(item.call_id, item.name, item.arguments)
            # A call joins the assistant turn before it: the calls of one turn (and the text
            # the model wrote with them) are one chat message.
            if messages and messages[-1]["role"] == "assistant":
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
    return messages


def _chat_content(content: str | list[InputTextPart]) -> str | list[dict[str, Any]]:
    if isinstance(content, str):
        return content
    return [{"type": "text", "text": part.text} for part in content]


def _chat_tool(tool: FunctionTool) -> dict[str, Any]:
    function = tool.model_dump(exclude={"type"}, exclude_none=True)
    return {"type": "function", "function": function}


def _chat_tool_choice(choice: str | NamedToolChoice) -> str | dict[str, Any]:
    if isinstance(choice, NamedToolChoice):
        return {"type": "function", "function": {"name": choice.name}}
    return choice


def _chat_response_format(fmt: TextFormatJsonObject | TextFormatJsonSchema) -> dict[str, Any]:
    if isinstance(fmt, TextFormatJsonObject):
        return {"type": "json_object"}
    json_schema = fmt.model_dump(by_alias=True, exclude={"type"}, exclude_none=True)
    return {"type": "json_schema", "json_schema": json_schema}


def conversation_after(
    chat_body: dict, output_text: str | None, tool_calls: list[dict]
) -> list[dict]:
    """The chat messages to store for a response: its body's messages without those from
    `instructions`, then the assistant's reply.

    `tool_calls` (chat format) must carry the call ids the Response shows, so a follow-up's
    `function_call_output` answers a call the history holds: take both from `response_reply`.
    """
    if any(not call.get("id") for call in tool_calls):
        raise refusal("conversation_after", "every tool call needs the id its Response shows")
    num_instructions = chat_body.get(NUM_INSTRUCTION_MESSAGES_KEY, 0)
    messages = copy.deepcopy(chat_body["messages"][num_instructions:])
    reply: dict[str, Any] = {"role": "assistant", "content": output_text or ""}
    if tool_calls:
        reply["content"] = output_text or None
        reply["tool_calls"] = [
            chat_tool_call(call["id"], call["function"]["name"], call["function"]["arguments"])
            for call in tool_calls
        ]
    messages.append(reply)
    return messages
