"""Anthropic's Messages API piece by piece: the request onto the chat path, the answer back
(whole and as events), and errors in Anthropic's shape. End to end with the `anthropic` SDK:
tests/cluster/test_anthropic_api.py."""

from __future__ import annotations

import asyncio
import json
from typing import Any, AsyncIterator

import pytest
from fastapi import FastAPI
from fastapi.responses import JSONResponse, StreamingResponse
from fastapi.testclient import TestClient
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedray.engine.output_processor import ChoiceDelta
from pagedray.engine.wire import RequestStepOutput
from pagedray.openai.answers import AnswerContext
from pagedray.openai.anthropic_api import CountTokensRequest, MessagesRequest, to_chat_body
from pagedray.openai.anthropic_errors import AnthropicErrors
from pagedray.openai.anthropic_flow import message_events, stop_reason, tool_input
from pagedray.openai.ingress_guard import http_error, route_path
from pagedray.openai.protocol import ChatCompletionRequest
from pagedray.openai.serving import LogprobFormatter, error_response
from pagedray.openai.tool_calls import ToolCallOutput
from pagedray.scheduler.request_failure import FailureKind, RequestFailure

ARGS = '{"x": 1}'
TOOL = {"name": "f", "input_schema": {"type": "object", "properties": {"x": {"type": "integer"}}}}


def _request(**fields: Any) -> MessagesRequest:
    return MessagesRequest.model_validate(
        {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}], **fields}
    )


def test_a_conversation_becomes_a_chat_body() -> None:
    request = _request(
        system=[{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Be kind."}],
        messages=[
            {"role": "user", "content": [{"type": "text", "text": "Weather?"}]},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "hm", "signature": "s"},
                    {"type": "text", "text": "Let me look."},
                    {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {"x": 1}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
                    {"type": "text", "text": "Thanks."},
                ],
            },
        ],
        stop_sequences=["END"],
        temperature=0.2,
        top_k=5,
        metadata={"user_id": "u1"},
        tools=[TOOL],
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
    )
    body = to_chat_body(request)
    assert body["messages"] == [
        {"role": "system", "content": "Be brief.\nBe kind."},
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": "Let me look.",
            "tool_calls": [
                {"id": "toolu_1", "type": "function", "function": {"name": "f", "arguments": ARGS}}
            ],
        },
        {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"},
        {"role": "user", "content": "Thanks."},
    ]  # fmt: skip
    assert (body["stop"], body["temperature"], body["top_k"], body["user"]) == (
        ["END"],
        0.2,
        5,
        "u1",
    )
    assert body["tool_choice"] == "required" and body["parallel_tool_calls"] is False
    assert body["tools"][0]["function"] == {"name": "f", "parameters": TOOL["input_schema"]}
    chat = ChatCompletionRequest.model_validate(body)
    assert chat.max_tokens == 8 and chat.chat_ending().add_generation_prompt


@pytest.mark.parametrize(
    ("choice", "chat_choice"),
    [
        ({"type": "auto"}, "auto"),
        ({"type": "none"}, "none"),
        ({"type": "tool", "name": "f"}, {"type": "function", "function": {"name": "f"}}),
    ],
)
def test_tool_choices(choice: dict[str, Any], chat_choice: Any) -> None:
    assert to_chat_body(_request(tools=[TOOL], tool_choice=choice))["tool_choice"] == chat_choice


def test_an_assistant_message_last_is_continued() -> None:
    messages = [
        {"role": "user", "content": "Count"},
        {"role": "assistant", "content": [{"type": "text", "text": "1, 2,"}]},
    ]
    body = to_chat_body(_request(messages=messages))
    assert body["messages"][-1] == {"role": "assistant", "content": "1, 2,"}
    assert (body["add_generation_prompt"], body["continue_final_message"]) == (False, True)
    counted = to_chat_body(CountTokensRequest.model_validate({"model": "m", "messages": messages}))
    assert "max_tokens" not in counted and counted["continue_final_message"]


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": 1.5}, "temperature"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "system", "content": "x"}]}, "role"),
        ({"messages": [{"role": "user", "content": [{"type": "image"}]}]}, "image blocks"),
        ({"tools": [{"type": "bash_20250124", "name": "bash"}]}, "server tool 'bash_20250124'"),
        ({"tool_choice": {"type": "tool"}}, "a name is required"),
    ],
)
def test_refused_requests_name_the_field(fields: dict[str, Any], words: str) -> None:
    with pytest.raises(ValidationError, match=words):
        _request(**fields)


@pytest.mark.parametrize(
    ("arguments", "expected"),
    [
        ('{"city": "Paris", "days": 3}', {"city": "Paris", "days": 3}),
        ('{"city": "Par', {"city": "Par"}),
        ('{"city": "Paris", "da', {"city": "Paris"}),
        ('{"city": "Paris", "days": ', {"city": "Paris"}),
        ('{"a": {"b": [1, 2', {"a": {"b": [1, 2]}}),
        ('{"a": "x\\', {}),
        ("", {}),
        ("[1, 2]", {}),
    ],
)
def test_tool_input_of_arguments_whole_or_cut(arguments: str, expected: dict[str, Any]) -> None:
    assert tool_input(arguments) == expected


def test_stop_reasons() -> None:
    assert stop_reason("length", None, made_calls=True) == "max_tokens"
    assert stop_reason("stop", None, made_calls=True) == "tool_use"
    assert stop_reason("tool_calls", None, made_calls=True) == "tool_use"
    assert stop_reason("stop", "END", made_calls=False) == "stop_sequence"
    assert stop_reason("stop", 2, made_calls=False) == "end_turn"  # a stop token, EOS say
    assert stop_reason("stop", None, made_calls=False) == "end_turn"


# ---- the stream of events ------------------------------------------------------------------------


class _Streams:
    """Stands for `EngineStreams`: the merged outputs of one engine request."""

    def __init__(self, outputs: list[RequestStepOutput]) -> None:
        self.outputs = outputs

    async def merged(self) -> AsyncIterator[tuple[int, RequestStepOutput]]:
        for output in self.outputs:
            yield 0, output


def _delta(text: str, finish: str | None = None, stop: str | None = None) -> ChoiceDelta:
    return ChoiceDelta("r", 0, text, [1], None, finish, stop)


def _events(outputs: list[RequestStepOutput], tools: ToolCallOutput | None) -> list[Any]:
    ctx = AnswerContext("msg_1", "m", 1, 1, LogprobFormatter(None), None, tool_calls=tools)
    ctx.num_prompt_tokens = 7

    async def run() -> list[str]:
        return [text async for text in message_events("msg_1", ctx, _Streams(outputs))]  # type: ignore[arg-type]

    texts = asyncio.run(run())
    events = []
    for text in texts:
        name_line, data_line = text.strip().split("\n")
        data = json.loads(data_line.removeprefix("data: "))
        assert name_line == f"event: {data['type']}"
        events.append(data)
    return events


def test_text_then_a_forced_call_as_events() -> None:
    usage = {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10, "cached_tokens": 4}
    outputs = [
        RequestStepOutput("r", [_delta('{"x"')]),
        RequestStepOutput("r", [_delta(": 1}", finish="stop")], finished=True, usage=usage),
    ]
    named = ToolCallOutput.of(
        [{"type": "function", "function": {"name": "f", "parameters": TOOL["input_schema"]}}],
        {"type": "function", "function": {"name": "f"}},
        "auto",
        None,
    )
    events = _events(outputs, named)
    assert [e["type"] for e in events] == [
        "message_start", "ping", "content_block_start", "content_block_delta",
        "content_block_delta", "content_block_stop", "message_delta", "message_stop",
    ]  # fmt: skip
    assert events[0]["message"]["usage"]["input_tokens"] == 7
    block = events[2]["content_block"]
    assert block["type"] == "tool_use" and block["name"] == "f" and block["id"].startswith("toolu_")
    partial = "".join(e["delta"]["partial_json"] for e in events[3:5])
    assert json.loads(partial) == {"x": 1}
    assert events[6]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert events[6]["usage"] == {
        "input_tokens": 3,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 4,
        "output_tokens": 3,
    }


def test_a_stop_sequence_and_an_error_mid_stream() -> None:
    usage = {"prompt_tokens": 7, "completion_tokens": 2, "total_tokens": 9, "cached_tokens": 0}
    stopped = _events(
        [RequestStepOutput("r", [_delta("Hi", finish="stop", stop="END")], True, usage)], None
    )
    assert stopped[3]["delta"] == {"type": "text_delta", "text": "Hi"}
    assert stopped[-2]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "END"}
    failure = RequestFailure(FailureKind.DEAD, "engine unavailable (request r)")
    failed = _events(
        [RequestStepOutput("r", [_delta("Hi")]), RequestStepOutput("r", error=failure)], None
    )
    assert failed[-1] == {
        "type": "error",
        "error": {"type": "overloaded_error", "message": "engine unavailable (request r)"},
    }


# ---- errors --------------------------------------------------------------------------------------


def test_errors_on_anthropics_paths_take_its_shape() -> None:
    app = FastAPI()

    @app.post("/v1/messages")
    async def refused() -> JSONResponse:
        return error_response(413, "body: larger than the limit", param="body")

    @app.post("/v1/messages/count_tokens")
    async def streamed() -> StreamingResponse:
        return StreamingResponse(iter([b"event: ping\n\n"]), media_type="text/event-stream")

    @app.post("/v1/chat/completions")
    async def openai_refused() -> JSONResponse:
        return error_response(400, "messages: empty", param="messages")

    app.add_exception_handler(StarletteHTTPException, http_error)  # as the ingress's app
    app.add_middleware(AnthropicErrors, path_of=route_path)
    client = TestClient(app)
    response = client.post("/v1/messages")
    assert response.status_code == 413
    assert response.json() == {
        "type": "error",
        "error": {"type": "request_too_large", "message": "body: larger than the limit"},
    }
    assert int(response.headers["content-length"]) == len(response.content)
    assert client.post("/v1/messages/count_tokens").text == "event: ping\n\n"
    assert client.post("/v1/chat/completions").json()["error"]["param"] == "messages"
    missing = client.get("/v1/messages/nowhere")
    assert missing.status_code == 404 and missing.json()["type"] == "error"
