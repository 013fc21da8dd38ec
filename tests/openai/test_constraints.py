"""The OpenAI-side constraint fields: response_format and structured_outputs to the engine's
constraint, forced tool choices to JSON schemas, and streamed tool-call deltas' JSON."""

from __future__ import annotations

import json

import jsonschema
import pytest

from pagedray.openai.constraints import DeltaFunctionCall, DeltaToolCall
from pagedray.openai.protocol import ChatCompletionRequest, CompletionRequest


def _chat(**fields: object) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "x"}], **fields}
    )


def test_continuation_deltas_leave_unset_keys_out() -> None:
    first = DeltaToolCall(
        index=0, id="call_1", type="function", function=DeltaFunctionCall(name="f", arguments="")
    )
    rest = DeltaToolCall(index=0, function=DeltaFunctionCall(arguments='{"a": 1}'))
    assert json.loads(first.model_dump_json()) == {
        "index": 0,
        "id": "call_1",
        "type": "function",
        "function": {"name": "f", "arguments": ""},
    }
    assert json.loads(rest.model_dump_json()) == {"index": 0, "function": {"arguments": '{"a": 1}'}}


def test_response_format_and_structured_outputs_become_one_constraint() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    body = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}
    params = _chat(response_format=body).to_sampling_params()
    assert params.structured_outputs is not None and params.structured_outputs.json == schema
    params = CompletionRequest(prompt="x", structured_outputs={"choice": ["a", "b"]})
    constraint = params.to_sampling_params().structured_outputs
    assert constraint is not None and constraint.choice == ["a", "b"]
    assert _chat(response_format={"type": "text"}).to_sampling_params().structured_outputs is None
    with pytest.raises(ValueError, match="not both"):
        both = {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}
        _chat(**both).to_sampling_params()


TOOL = {
    "type": "function",
    "function": {
        "name": "f",
        "parameters": {
            "type": "object",
            "properties": {"p": {"$ref": "#/definitions/P"}},
            "required": ["p"],
            "definitions": {"P": {"type": "integer", "minimum": 0}},
        },
    },
}


def test_required_choice_keeps_draft7_definitions_resolvable() -> None:
    params = _chat(tools=[TOOL], tool_choice="required").to_sampling_params()
    assert params.structured_outputs is not None
    schema = params.structured_outputs.json
    jsonschema.validate([{"name": "f", "parameters": {"p": 3}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "f", "parameters": {"p": -1}}], schema)


def test_malformed_definitions_are_400s_not_crashes() -> None:
    bad = {**TOOL, "function": {**TOOL["function"], "parameters": {"$defs": []}}}
    with pytest.raises(ValueError, match=r"tools: .*\$defs must be an object"):
        _chat(tools=[bad], tool_choice="required").to_sampling_params()
    with pytest.raises(ValueError, match="nested too deeply"):
        _chat(structured_outputs={"json": "[" * 100_000}).to_sampling_params()
