"""The request and response fields of structured outputs and tool calling, in OpenAI's shapes
(with vLLM's `structured_outputs` extension), and their translation into the engine's
`StructuredOutputsParams`.

`response_format` is OpenAI's (`json_object`, `json_schema` with `strict`); `structured_outputs`
is vLLM's (`json`, `regex`, `choice`, `grammar`, `json_object`). A forced tool choice
(`required`, or a named function) is itself a JSON schema constraint, so the call's arguments
always parse and follow the function's parameters.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    model_serializer,
)

from pagedray.openai.tool_choice import check_tools, tool_choice_schema
from pagedray.scheduler.request_failure import RequestRefused, refusal
from pagedray.scheduler.structured_outputs import StructuredOutputsParams

# ---- requests -------------------------------------------------------------------------------


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"] = "function"
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class ConstraintFields(BaseModel):
    """`response_format` and `structured_outputs`, shared by completions and chat."""

    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None

    def constraint(self) -> StructuredOutputsParams | None:
        """The engine's constraint; raises ValueError naming the field at fault."""
        response_format = self.response_format
        if response_format is not None and response_format.type != "text":
            if self.structured_outputs is not None:
                raise refusal(
                    "response_format", "give response_format or structured_outputs, not both"
                )
            return _from_response_format(response_format)
        if self.structured_outputs is None:
            return None
        return StructuredOutputsParams.from_fields(self.structured_outputs)


def _from_response_format(response_format: ResponseFormat) -> StructuredOutputsParams:
    if response_format.type == "json_object":
        return StructuredOutputsParams(json_object=True)
    json_schema = response_format.json_schema
    if json_schema is None or json_schema.schema_ is None:
        raise refusal("response_format", "json_schema.schema is required for type json_schema")
    try:
        return StructuredOutputsParams(json=json_schema.schema_)
    except ValueError as exc:
        raise refusal("response_format", f"json_schema.schema: {_reason(exc)}") from None


class ToolFields(BaseModel):
    """Chat's `tools`, `tool_choice` and `parallel_tool_calls`, as OpenAI sends them."""

    tools: list[ToolDefinition] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None

    def tool_dicts(self) -> list[dict[str, Any]] | None:
        return [tool.model_dump(exclude_none=True) for tool in self.tools] if self.tools else None

    def tool_choice_value(self) -> Any:
        """OpenAI's default: "auto" with tools, "none" without."""
        if self.tool_choice is None:
            return "auto" if self.tools else "none"
        if isinstance(self.tool_choice, NamedToolChoice):
            return self.tool_choice.model_dump()
        return self.tool_choice

    def tool_constraint(self) -> StructuredOutputsParams | None:
        """A forced choice's schema (`required`, or a named function); raises ValueError."""
        tools, choice = self.tool_dicts(), self.tool_choice_value()
        check_tools(tools, choice, self.parallel_tool_calls)
        schema = tool_choice_schema(tools, choice, self.parallel_tool_calls is not False)
        if schema is None:
            return None
        try:
            return StructuredOutputsParams(json=schema)
        except ValueError as exc:
            reason = f"a function's parameters are not a usable schema: {_reason(exc)}"
            raise refusal("tools", reason) from None


# ---- responses ------------------------------------------------------------------------------


class FunctionCall(BaseModel):
    name: str
    arguments: str  # a JSON object, serialized


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class _WithoutNulls(BaseModel):
    """Streamed tool-call deltas leave unset keys out, as OpenAI sends them: some clients merge
    deltas key by key, and a null would overwrite what an earlier delta set."""

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {key: value for key, value in handler(self).items() if value is not None}


class DeltaFunctionCall(_WithoutNulls):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(_WithoutNulls):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


def _reason(exc: ValueError) -> str:
    """Why a schema was refused, without the field name it was refused under."""
    return exc.detail if isinstance(exc, RequestRefused) else str(exc)
