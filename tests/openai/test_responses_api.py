"""The Responses API translation: requests as the `openai` SDK sends them become chat bodies our
chat request accepts, and what we answer, whole or streamed, parses with the SDK's own types.
"""

from __future__ import annotations

import json
import re
from typing import Any

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam, ChatCompletionToolChoiceOptionParam
from openai.types.chat.chat_completion_function_tool_param import ChatCompletionFunctionToolParam
from openai.types.chat.completion_create_params import ResponseFormat
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter, ValidationError

from pagedray.openai.protocol import ChatCompletionRequest, chat_tool_call
from pagedray.openai.response_objects import (
    ResponseEventStream,
    build_response,
    error_event,
    new_call_id,
    new_response_id,
    response_reply,
    sse_event,
)
from pagedray.openai.responses_api import ResponsesRequest, conversation_after, to_chat_body

USAGE = {
    "prompt_tokens": 7,
    "completion_tokens": 5,
    "total_tokens": 12,
    "prompt_tokens_details": {"cached_tokens": 3},
}
WEATHER_TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
EVENTS = TypeAdapter(ResponseStreamEvent)


def _request(**body: Any) -> ResponsesRequest:
    return ResponsesRequest.model_validate({"input": "Hi", **body})


def _response(request: ResponsesRequest, text: str | None, calls: list[dict], **kw: Any) -> dict:
    kw.setdefault("finish_reason", "stop")
    return build_response(
        response_id=new_response_id(),
        request=request,
        model="tiny",
        created_at=1700000000,
        text=text,
        tool_calls=calls,
        usage=USAGE,
        **kw,
    )


# ---- requests --------------------------------------------------------------------------------


def test_string_input_becomes_a_chat_body_our_chat_request_accepts() -> None:
    request = _request(
        model="tiny", instructions="Be brief.", max_output_tokens=9, temperature=0.5, top_p=0.9,
        seed=3, user="u", stream=True, store=False, reasoning={"effort": "low"},
        truncation="auto", include=["message.output_text.logprobs"],
    )  # fmt: skip
    body = to_chat_body(request, None)
    chat = ChatCompletionRequest.model_validate(body)
    assert [m.as_template_input() for m in chat.messages] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
    ]
    assert (chat.model, chat.max_tokens, chat.temperature, chat.top_p) == ("tiny", 9, 0.5, 0.9)
    assert (chat.seed, chat.user, chat.stream) == (3, "u", False)  # the caller decides stream
    assert "response_format" not in body and "tools" not in body


def test_input_items_become_chat_messages() -> None:
    request = _request(
        input=[
            {"role": "developer", "content": "Use tools."},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"}]},
            {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
             "content": [{"type": "output_text", "text": "Let me look.", "annotations": []}]},
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}",
             "id": "fc_1", "status": "completed"},
            {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{\"x\":1}"},
            {"type": "function_call_output", "call_id": "c1", "output": "1"},
            {"type": "function_call_output", "call_id": "c2", "output": "2"},
            {"role": "user", "content": "and?"},
        ]
    )  # fmt: skip
    messages = to_chat_body(request, None)["messages"]
    assert messages == [
        {"role": "developer", "content": "Use tools."},  # the chat template decides how it renders
        {"role": "user", "content": [{"type": "text", "text": "a"}]},
        {
            "role": "assistant",
            "content": [{"type": "text", "text": "Let me look."}],
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
                {"id": "c2", "type": "function", "function": {"name": "g", "arguments": '{"x":1}'}},
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "1"},
        {"role": "tool", "tool_call_id": "c2", "content": "2"},
        {"role": "user", "content": "and?"},
    ]
    TypeAdapter(list[ChatCompletionMessageParam]).validate_python(messages)


def test_tools_tool_choice_and_text_format_take_the_chat_shape() -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}}
    request = _request(
        tools=[WEATHER_TOOL, {"type": "function", "name": "noop", "strict": True}],
        tool_choice={"type": "function", "name": "get_weather"},
        parallel_tool_calls=False,
        text={"format": {"type": "json_schema", "name": "n", "schema": schema, "strict": True}},
    )
    body = to_chat_body(request, None)
    weather = {key: value for key, value in WEATHER_TOOL.items() if key != "type"}
    assert body["tools"] == [
        {"type": "function", "function": weather},
        {"type": "function", "function": {"name": "noop", "strict": True}},
    ]
    assert body["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert body["parallel_tool_calls"] is False
    assert body["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "n", "schema": schema, "strict": True},
    }
    TypeAdapter(list[ChatCompletionFunctionToolParam]).validate_python(body["tools"])
    TypeAdapter(ChatCompletionToolChoiceOptionParam).validate_python(body["tool_choice"])
    TypeAdapter(ResponseFormat).validate_python(body["response_format"])
    json_object = to_chat_body(_request(text={"format": {"type": "json_object"}}), None)
    assert json_object["response_format"] == {"type": "json_object"}
    plain = to_chat_body(_request(text={"format": {"type": "text"}}, tool_choice="none"), None)
    assert "response_format" not in plain and "tool_choice" not in plain  # no tools: no choice


def test_a_follow_up_continues_the_stored_conversation_without_old_instructions() -> None:
    first_request = _request(instructions="Old rules.", tools=[WEATHER_TOOL])
    first = to_chat_body(first_request, None)
    # A call the engine gave no id gets one in the Response; the history must hold the same.
    response = _response(first_request, None, [{**CALL, "id": None}], finish_reason="tool_calls")
    text, calls = response_reply(response)
    call_id = response["output"][0]["call_id"]
    assert (text, calls) == (None, [chat_tool_call(call_id, "get_weather", "{}")])
    stored = conversation_after(first, text, calls)
    assert stored == [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": None, "tool_calls": calls},
    ]
    output = {"type": "function_call_output", "call_id": call_id, "output": "sunny"}
    follow_up = _request(input=[output], instructions="New rules.", previous_response_id="r")
    second = to_chat_body(follow_up, stored)
    assert second["messages"] == [
        {"role": "system", "content": "New rules."},
        *stored,
        {"role": "tool", "tool_call_id": call_id, "content": "sunny"},
    ]
    assert conversation_after(second, "It is sunny.", []) == [
        *stored,
        {"role": "tool", "tool_call_id": call_id, "content": "sunny"},
        {"role": "assistant", "content": "It is sunny."},
    ]
    second["messages"][1]["content"] = "changed"
    assert stored[0]["content"] == "Hi"  # the stored history is copied, not shared
    with pytest.raises(ValueError, match="id"):
        conversation_after(first, None, [{**CALL, "id": None}])


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"tools": [{"type": "web_search"}]}, "tools: only function tools are supported"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input: item 0: content part type 'input_image' is not supported",
        ),
        (  # (a reasoning item is accepted and left out: tests/openai/test_reasoning.py)
            {"input": [{"type": "item_reference", "id": "rs_1"}]},
            "input: item 0: type 'item_reference' is not supported",
        ),
    ],
)
def test_unsupported_inputs_are_refused_by_name(body: dict, message: str) -> None:
    with pytest.raises(ValidationError) as info:
        _request(**body)
    error = info.value.errors()[0]
    # Top-level, as serving.bad_request turns a "field: message" error into a 400 naming field.
    assert (error["loc"], error["msg"]) == ((), f"Value error, {message}")


def test_bad_field_values_are_refused() -> None:
    for body in ({"max_output_tokens": 0}, {"tool_choice": "any"}, {"input": 3}):
        with pytest.raises(ValidationError):
            _request(**body)


# ---- whole responses -------------------------------------------------------------------------


def test_a_text_response_parses_with_the_sdk() -> None:
    request = _request(instructions="Be brief.", metadata={"k": "v"}, temperature=0.2)
    response = Response.model_validate(_response(request, "Hello there.", []))
    assert response.output_text == "Hello there."
    assert response.status == "completed" and response.incomplete_details is None
    assert re.fullmatch(r"resp_[0-9a-f]{48}", response.id)
    assert re.fullmatch(r"msg_[0-9a-f]+", response.output[0].id)
    usage = _response(request, "x", [])["usage"]
    assert (usage["input_tokens"], usage["output_tokens"], usage["total_tokens"]) == (7, 5, 12)
    assert usage["input_tokens_details"]["cached_tokens"] == 3
    metadata = (response.instructions, response.metadata, response.temperature)
    assert metadata == ("Be brief.", {"k": "v"}, 0.2)
    assert response.text is not None and response.text.format is not None
    assert response.text.format.type == "text" and response.parallel_tool_calls


def test_tool_calls_cut_short_make_an_incomplete_response() -> None:
    text = {"format": {"type": "json_schema", "name": "n", "schema": {"type": "object"}}}
    request = _request(tools=[WEATHER_TOOL], tool_choice="required", text=text)
    raw = _response(request, "Checking.", [CALL, {**CALL, "id": None}], finish_reason="length")
    response = Response.model_validate(raw)
    assert response.status == "incomplete"
    assert response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens"
    message, call, last = response.output
    assert message.type == "message" and message.status == "completed"
    assert call.type == "function_call" and (call.call_id, call.name) == ("call_1", "get_weather")
    assert last.type == "function_call" and last.status == "incomplete"
    assert re.fullmatch(r"call_[0-9a-f]+", last.call_id) and re.fullmatch(r"fc_[0-9a-f]+", last.id)
    assert raw["tools"][0]["name"] == "get_weather" and raw["tool_choice"] == "required"
    assert raw["text"] == text and response.text is not None and response.text.format is not None
    assert response.text.format.type == "json_schema"


# ---- streamed responses ----------------------------------------------------------------------


def _stream_events(request: ResponsesRequest, script: list[tuple], finish: str) -> list[dict]:
    """Events for scripted deltas: ("text", delta) or ("call", index, call_id, name, args)."""
    stream = ResponseEventStream(
        response_id=new_response_id(), request=request, model="tiny", created_at=1700000000
    )
    events = stream.start()
    for step in script:
        events += stream.text(step[1]) if step[0] == "text" else stream.tool_call(*step[1:])
    events += stream.finish(finish, USAGE)
    assert events[-1]["response"] == stream.final_response()
    return events


def _check_events(events: list[dict]) -> Response:
    """Each event parses with the SDK; numbers run 0, 1, …; deltas add up to the final text."""
    assert [event["sequence_number"] for event in events] == list(range(len(events)))
    for event in events:
        assert EVENTS.validate_python(event).type == event["type"]
    final = Response.model_validate(events[-1]["response"])
    deltas: dict[int, str] = {}
    for event in events:
        if event["type"].endswith(".delta"):
            deltas[event["output_index"]] = deltas.get(event["output_index"], "") + event["delta"]
    for idx, item in enumerate(final.output):
        assert deltas.get(idx, "") == (
            item.arguments if item.type == "function_call" else item.content[0].text
        )
    return final


def test_a_streamed_text_response() -> None:
    events = _stream_events(_request(), [("text", "Hel"), ("text", ""), ("text", "lo")], "stop")
    assert [event["type"] for event in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    created = events[0]["response"]
    assert created["status"] == "in_progress" and created["output"] == []
    assert _check_events(events).output_text == "Hello"


def test_streamed_text_then_interleaved_tool_calls_cut_short() -> None:
    script = [
        ("text", "Let me check."),
        ("call", 0, "call_a", "get_weather", '{"city":'),
        ("call", 1, None, "get_weather", ""),
        ("call", 0, None, None, ' "Oslo"}'),
        ("call", 1, None, None, '{"city": "Rome"'),
    ]
    events = _stream_events(_request(tools=[WEATHER_TOOL]), script, "length")
    types = [event["type"] for event in events]
    assert types.index("response.output_item.done") < types.index("response.output_item.added", 3)
    assert types[-1] == "response.incomplete"
    final = _check_events(events)
    assert final.status == "incomplete" and final.output_text == "Let me check."
    _, first, second = final.output
    assert first.type == "function_call" and second.type == "function_call"
    assert (first.call_id, first.status) == ("call_a", "completed")
    assert first.arguments == '{"city": "Oslo"}'
    assert second.call_id.startswith("call_") and second.status == "incomplete"
    calls = [
        chat_tool_call("call_a", "get_weather", '{"city": "Oslo"}'),
        chat_tool_call(second.call_id, "get_weather", '{"city": "Rome"'),
    ]
    whole = Response.model_validate(
        _response(_request(tools=[WEATHER_TOOL]), "Let me check.", calls, finish_reason="length")
    )
    assert _without_ids(final.model_dump()) == _without_ids(whole.model_dump())


def _without_ids(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: _without_ids(v) for key, v in value.items() if key not in ("id", "item_id")}
    if isinstance(value, list):
        return [_without_ids(v) for v in value]
    return value


def test_an_error_event_parses_with_the_sdk() -> None:
    stream = ResponseEventStream(
        response_id=new_response_id(), request=_request(), model="tiny", created_at=0
    )
    events = stream.start() + stream.text("a") + stream.error("engine died", "server_error")
    assert events[-1]["sequence_number"] == len(events) - 1
    for event in (events[-1], error_event("boom", None)):
        assert EVENTS.validate_python(event).type == "error"
    with pytest.raises(RuntimeError):
        stream.final_response()


def test_sse_events_stay_on_one_line() -> None:
    event = {"type": "response.output_text.delta", "delta": "a\u2028b\x85c\u2029d\né"}
    framed = sse_event(event)
    name, data, end = framed.splitlines()  # str.splitlines splits at U+2028 and U+0085 too
    assert end == "" and framed.endswith("\n\n")
    assert name == "event: response.output_text.delta"
    assert "\\u2028" in data and "é" in data and json.loads(data.removeprefix("data: ")) == event


# ---- the SDK end to end (over a mock transport) ----------------------------------------------


def _client(answer: Any) -> openai.OpenAI:
    """An SDK client whose server translates each request and answers it with `answer`."""

    def handle(http_request: httpx.Request) -> httpx.Response:
        request = ResponsesRequest.model_validate(json.loads(http_request.content))
        ChatCompletionRequest.model_validate(to_chat_body(request, None))
        return answer(request)

    transport = httpx.MockTransport(handle)
    return openai.OpenAI(
        api_key="x", base_url="http://t/v1", http_client=httpx.Client(transport=transport)
    )


def test_the_sdk_reads_a_whole_response() -> None:
    client = _client(lambda request: httpx.Response(200, json=_response(request, "Hi!", [])))
    response = client.responses.create(
        model="tiny",
        instructions="Be kind.",
        input=[{"role": "user", "content": [{"type": "input_text", "text": "Hello"}]}],
        max_output_tokens=8,
        text={"format": {"type": "json_object"}},
    )
    assert response.output_text == "Hi!" and response.max_output_tokens == 8


def test_the_sdk_reads_a_streamed_response() -> None:
    def answer(request: ResponsesRequest) -> httpx.Response:
        script = [("text", "Hi"), ("text", " \u2028there"), ("call", 0, new_call_id(), "f", "{}")]
        body = "".join(sse_event(e) for e in _stream_events(request, script, "tool_calls"))
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, text=body)

    client = _client(answer)
    with client.responses.stream(model="tiny", input="Hello") as stream:
        types = [event.type for event in stream]
        final = stream.get_final_response()
    assert types[0] == "response.created" and types[-1] == "response.completed"
    assert final.output_text == "Hi \u2028there"
    assert final.output[-1].type == "function_call" and final.output[-1].arguments == "{}"
