"""Anthropic's Messages API end to end: real Ray, real Serve over HTTP, the official `anthropic`
SDK unmodified (its `x-api-key` header included), on the chat path of a random-weight model."""

from __future__ import annotations

import json
from typing import Any, Iterator, Literal

import anthropic
import httpx
import jsonschema
import pytest
from _serve_apps import deploy_tiny
from pydantic import BaseModel, ConfigDict

MODEL = "tiny"
API_KEY = "sk-ant-test"
WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 10},
            "unit": {"enum": ["celsius", "fahrenheit"]},
        },
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
# Anthropic's SDK 2.x no longer sends `temperature`; older clients do, and the server takes it.
GREEDY = {"temperature": 0.0}


@pytest.fixture(scope="module")
def url(serve_url: str, tiny_llama: str) -> Iterator[str]:
    yield from deploy_tiny(
        serve_url, "anthropic", tiny_llama, served_model_name=MODEL, api_key=API_KEY
    )


@pytest.fixture(scope="module")
def client(url: str) -> anthropic.Anthropic:
    # max_retries=0: the SDK would otherwise retry 5xx answers and hide them.
    return anthropic.Anthropic(base_url=url, api_key=API_KEY, max_retries=0)


def _post(url: str, path: str, body: Any, key: str = API_KEY) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, headers={"x-api-key": key}, timeout=60)


def test_create_text_and_count_tokens(client: anthropic.Anthropic) -> None:
    system = [{"type": "text", "text": "Be brief."}]
    message = client.messages.create(
        model=MODEL, max_tokens=8, system=system, messages=ASK, extra_body=GREEDY
    )
    assert message.type == "message" and message.role == "assistant"
    assert message.id.startswith("msg_") and message.model == MODEL
    assert [block.type for block in message.content] == ["text"]
    assert message.stop_reason in ("end_turn", "max_tokens")
    count = client.messages.count_tokens(model=MODEL, system=system, messages=ASK)
    usage = message.usage
    assert usage.input_tokens + (usage.cache_read_input_tokens or 0) == count.input_tokens
    assert 0 < usage.output_tokens <= 8
    # A second turn finds the first's prefix cached: it counts as read from the cache.
    again = client.messages.create(
        model=MODEL, max_tokens=8, system=system, messages=ASK, extra_body=GREEDY
    )
    assert again.content == message.content
    assert again.usage.cache_read_input_tokens > 0
    assert again.usage.input_tokens + again.usage.cache_read_input_tokens == count.input_tokens


def test_stream_text_deltas_and_the_final_message(client: anthropic.Anthropic) -> None:
    kwargs: dict[str, Any] = dict(model=MODEL, max_tokens=12, messages=ASK, extra_body=GREEDY)
    whole = client.messages.create(**kwargs)
    with client.messages.stream(**kwargs) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == whole.content[0].text == final.content[0].text
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == 12


def test_the_raw_event_sequence(url: str) -> None:
    body = {"model": MODEL, "max_tokens": 4, "messages": ASK, "stream": True}
    with httpx.stream(
        "POST", f"{url}/v1/messages", json=body, headers={"x-api-key": API_KEY}, timeout=60
    ) as response:
        assert response.status_code == 200
        lines = [line for line in response.iter_lines() if line]
    names = [line.removeprefix("event: ") for line in lines if line.startswith("event: ")]
    data = [json.loads(line.removeprefix("data: ")) for line in lines if line.startswith("data: ")]
    assert [d["type"] for d in data] == names
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) == {"content_block_delta"}
    assert data[-2]["delta"]["stop_reason"] == "max_tokens" and data[-2]["usage"]["output_tokens"]


def test_a_forced_tool_gives_a_tool_use_that_follows_its_schema(
    client: anthropic.Anthropic,
) -> None:
    choice = {"type": "tool", "name": "get_weather"}
    message = client.messages.create(
        model=MODEL, max_tokens=200, messages=ASK, tools=[WEATHER], tool_choice=choice
    )
    assert message.stop_reason == "tool_use"
    (block,) = message.content
    assert block.type == "tool_use" and block.name == "get_weather"
    assert block.id.startswith("toolu_")
    jsonschema.validate(block.input, WEATHER["input_schema"])
    with client.messages.stream(
        model=MODEL, max_tokens=200, messages=ASK, tools=[WEATHER], tool_choice=choice
    ) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use" and final.content[0].type == "tool_use"
    jsonschema.validate(final.content[0].input, WEATHER["input_schema"])


class City(BaseModel):
    # NOTE: bounded by its types alone: the SDK takes length and range limits out of the schema
    # it sends, and a random model's string would never end without them.
    model_config = ConfigDict(extra="forbid")

    name: Literal["Paris", "Rome", "Oslo"]
    capital: bool


def test_output_config_json_schema_and_the_sdks_parse(client: anthropic.Anthropic) -> None:
    parsed = client.messages.parse(
        model=MODEL, max_tokens=300, messages=ASK, output_format=City, extra_body=GREEDY
    )
    assert parsed.stop_reason == "end_turn"
    assert isinstance(parsed.parsed_output, City), parsed.content


def test_any_tool_and_a_tool_result_round_trip(client: anthropic.Anthropic) -> None:
    choice = {"type": "any", "disable_parallel_tool_use": True}
    first = client.messages.create(
        model=MODEL, max_tokens=200, messages=ASK, tools=[WEATHER], tool_choice=choice
    )
    calls = [block for block in first.content if block.type == "tool_use"]
    assert calls and first.stop_reason == "tool_use"
    messages: list[Any] = [
        *ASK,
        {"role": "assistant", "content": [block.model_dump() for block in first.content]},
        {
            "role": "user",
            "content": [
                *[
                    {"type": "tool_result", "tool_use_id": call.id, "content": "sunny, 21C"}
                    for call in calls
                ],
                {"type": "text", "text": "And tomorrow?"},
            ],
        },
    ]
    second = client.messages.create(model=MODEL, max_tokens=4, messages=messages, tools=[WEATHER])
    assert second.stop_reason in ("end_turn", "max_tokens", "tool_use")
    # The calls and their results reached the model through the chat template.
    counted = client.messages.count_tokens(model=MODEL, messages=messages, tools=[WEATHER])
    assert counted.input_tokens > first.usage.input_tokens + first.usage.output_tokens


def test_stop_sequences_and_prefill(client: anthropic.Anthropic, url: str) -> None:
    free = client.messages.create(model=MODEL, max_tokens=16, messages=ASK, extra_body=GREEDY)
    text = free.content[0].text
    stop = text[4:7]
    stopped = client.messages.create(
        model=MODEL, max_tokens=16, messages=ASK, extra_body=GREEDY, stop_sequences=[stop]
    )
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == stop
    assert stopped.content[0].text == text[: text.index(stop)]
    # An assistant message last is a prefill: the answer continues it, as vLLM's
    # continue_final_message does on the chat route.
    prefill = [*ASK, {"role": "assistant", "content": "It is"}]
    continued = client.messages.create(
        model=MODEL, max_tokens=6, messages=prefill, extra_body=GREEDY
    )
    chat = httpx.post(
        f"{url}/v1/chat/completions",
        json={
            "messages": prefill,
            "max_tokens": 6,
            "temperature": 0.0,
            "add_generation_prompt": False,
            "continue_final_message": True,
        },
        headers={"Authorization": f"Bearer {API_KEY}"},
        timeout=60,
    ).json()
    assert continued.content[0].text == chat["choices"][0]["message"]["content"]


def test_errors_in_anthropics_shape(client: anthropic.Anthropic, url: str) -> None:
    with pytest.raises(anthropic.NotFoundError) as not_found:
        client.messages.create(model="claude-opus-4", max_tokens=4, messages=ASK)
    assert not_found.value.body["error"]["type"] == "not_found_error"
    wrong_key = anthropic.Anthropic(base_url=url, api_key="nope", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as unauthorized:
        wrong_key.messages.create(model=MODEL, max_tokens=4, messages=ASK)
    assert unauthorized.value.body == {
        "type": "error",
        "error": {"type": "authentication_error", "message": "invalid API key"},
    }
    base = {"model": MODEL, "max_tokens": 4, "messages": ASK}
    image = [{"role": "user", "content": [{"type": "image", "source": {}}]}]
    refusals = [
        ({"model": MODEL, "messages": ASK}, "max_tokens"),
        ({**base, "temperature": 1.5}, "temperature"),
        ({**base, "messages": [{"role": "system", "content": "x"}]}, "role"),
        ({**base, "messages": image}, "image blocks are not supported"),
        ({**base, "tools": [{"type": "web_search_20250305", "name": "w"}]}, "server tool"),
        ({**base, "max_tokens": 5000}, "max_tokens"),
    ]
    for body, words in refusals:
        response = _post(url, "/v1/messages", body)
        assert response.status_code == 400, response.text
        assert response.json()["type"] == "error", response.text
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error" and words in error["message"], error
    too_large = _post(url, "/v1/messages", {"model": MODEL, "messages": [], "x": "a" * 5_000_000})
    assert too_large.status_code == 413
    assert too_large.json()["error"]["type"] == "request_too_large"
    # The OpenAI routes keep OpenAI's shape, and take the same key as a bearer token.
    openai_error = _post(url, "/v1/chat/completions", {"messages": []})
    assert openai_error.status_code == 400 and set(openai_error.json()) == {"error"}
