"""Structured outputs, tool calling and the Responses API end to end: real Ray, real Serve over
HTTP, the official `openai` SDK, a random-weight model whose free text is gibberish.

One app: two engine replicas (power-of-two routing, so follow-ups land on both) behind two
ingress replicas, sharing one `ResponseStore` replica.
"""

from __future__ import annotations

import concurrent.futures
import json
import re
import time
from typing import Annotated, Any, Iterator, Literal

import httpx
import jsonschema
import openai
import pytest
from _serve_apps import deploy_tiny
from pydantic import BaseModel, ConfigDict, Field

MODEL = "tiny"

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 10},
                "unit": {"enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "unit", "days"],
            "additionalProperties": False,
        },
    },
}
SEARCH = {
    "type": "function",
    "function": {
        "name": "search",
        "parameters": {
            "type": "object",
            "properties": {"query": {"type": "string", "maxLength": 12}},
            "required": ["query"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, SEARCH]
PARAMETERS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}


class Address(BaseModel):
    model_config = ConfigDict(extra="forbid")  # additionalProperties: false, as strict needs

    city: str = Field(max_length=10)
    zip_code: str = Field(pattern=r"^[0-9]{5}$")


class Person(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(max_length=12)
    age: int = Field(ge=0, le=120)
    role: Literal["admin", "user", "guest"]
    scores: list[Annotated[int, Field(ge=0, le=100)]] = Field(min_length=1, max_length=3)
    address: Address


@pytest.fixture(scope="module")
def url(serve_url: str, tiny_llama: str) -> Iterator[str]:
    yield from deploy_tiny(
        serve_url,
        "structured",
        tiny_llama,
        served_model_name=MODEL,
        num_replicas=2,
        num_ingress_replicas=2,
        routing="power-of-two",
        num_kv_blocks=128,
    )


@pytest.fixture(scope="module")
def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def _chat(client: openai.OpenAI, **kwargs: Any) -> Any:
    messages = kwargs.pop("messages", [{"role": "user", "content": "Answer."}])
    return client.chat.completions.create(model=MODEL, messages=messages, **kwargs)


# ---- structured outputs ------------------------------------------------------------------------


def test_sdk_parse_with_a_pydantic_model(client: openai.OpenAI) -> None:
    parse = getattr(getattr(client, "beta", None), "chat", client.chat).completions.parse
    for temperature in (0.0, 1.0):
        completion = parse(
            model=MODEL,
            messages=[{"role": "user", "content": "Who?"}],
            response_format=Person,
            max_tokens=400,
            temperature=temperature,
            seed=3,
        )
        message = completion.choices[0].message
        assert completion.choices[0].finish_reason == "stop"
        assert isinstance(message.parsed, Person), message.content


def test_streamed_json_schema_with_three_choices(client: openai.OpenAI) -> None:
    schema = Person.model_json_schema()
    response_format = {
        "type": "json_schema",
        "json_schema": {"name": "person", "schema": schema, "strict": True},
    }
    stream = _chat(
        client, response_format=response_format, n=3, temperature=1.0, max_tokens=400, stream=True
    )
    texts, finish = ["", "", ""], [None, None, None]
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            finish[choice.index] = choice.finish_reason or finish[choice.index]
    assert finish == ["stop"] * 3
    for text in texts:
        Person.model_validate_json(text)


def test_completions_take_response_format_and_vllms_structured_outputs(
    client: openai.OpenAI,
) -> None:
    completion = client.completions.create(
        model=MODEL,
        prompt="Hello",
        max_tokens=300,
        temperature=1.0,
        seed=11,
        extra_body={"response_format": {"type": "json_object"}},  # vLLM takes it here too
    )
    assert isinstance(json.loads(completion.choices[0].text), dict)
    choices = ["alpha", "beta", "gamma"]
    completion = client.completions.create(
        model=MODEL,
        prompt="Pick",
        max_tokens=10,
        n=2,
        temperature=1.0,
        extra_body={"structured_outputs": {"choice": choices}},
    )
    assert all(choice.text in choices for choice in completion.choices)
    regex = r"[A-Z]{2}-[0-9]{3}"
    completion = client.completions.create(
        model=MODEL,
        prompt="Code",
        max_tokens=20,
        extra_body={"structured_outputs": {"regex": regex}},
    )
    assert re.fullmatch(regex, completion.choices[0].text)


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "strin"}},
                }
            },
            "response_format",
            "Invalid type",
        ),
        ({"response_format": {"type": "json_schema"}}, "response_format", "schema is required"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "loop", "schema": {"allOf": [{"$ref": "#"}]}},
                }
            },
            "response_format",
            "admits no finite value",
        ),
        ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs", "unclosed group"),
        (
            {"structured_outputs": {"regex": "a", "choice": ["a"]}},
            "structured_outputs",
            "exactly one",
        ),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
            "nope",
        ),
        ({"tool_choice": "required"}, "tool_choice", "requires tools"),
        ({"structured_outputs": {"json": "[" * 50_000}}, "structured_outputs", "too deeply"),
        (
            {
                "messages": [
                    {"role": "user", "content": "x"},
                    {
                        "role": "assistant",
                        "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f"}}],
                    },
                ]
            },
            "messages",
            "arguments",
        ),
    ],
)
def test_bad_constraints_are_400_naming_the_field(
    url: str, body: dict[str, Any], param: str, words: str
) -> None:
    request = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], **body}
    response = httpx.post(f"{url}/v1/chat/completions", json=request, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"], error


def test_logprobs_of_ruled_out_tokens_are_finite(client: openai.OpenAI) -> None:
    """Tokens the grammar rules out have logprob -inf, which JSON cannot carry: vLLM's floor."""
    completion = _chat(
        client,
        logprobs=True,
        top_logprobs=5,
        max_tokens=5,
        extra_body={"structured_outputs": {"choice": ["yes", "no"]}},
    )
    entries = completion.choices[0].logprobs.content
    assert entries
    for entry in entries:
        assert all(top.logprob is not None and top.logprob >= -9999.0 for top in entry.top_logprobs)


# ---- tool calling ------------------------------------------------------------------------------


def _check_calls(calls: list[Any], names: set[str]) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])


def test_required_and_named_tool_choice_make_valid_calls(client: openai.OpenAI) -> None:
    for temperature in (0.0, 1.0):
        required = _chat(
            client,
            tools=TOOLS,
            tool_choice="required",
            max_tokens=250,
            temperature=temperature,
            seed=1,
        )
        choice = required.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        _check_calls(choice.message.tool_calls, {"get_weather", "search"})
    named = _chat(
        client,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "search"}},
        parallel_tool_calls=False,
        max_tokens=200,
    )
    assert named.choices[0].finish_reason == "stop"
    _check_calls(named.choices[0].message.tool_calls, {"search"})
    assert len(named.choices[0].message.tool_calls) == 1


def test_a_tool_round_trip(client: openai.OpenAI) -> None:
    first = _chat(
        client,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0.0,
        max_tokens=250,
    )
    calls = first.choices[0].message.tool_calls
    messages: list[Any] = [
        {"role": "user", "content": "Weather?"},
        first.choices[0].message.model_dump(exclude_none=True),
        *[{"role": "tool", "tool_call_id": c.id, "content": "sunny, 21C"} for c in calls],
    ]
    second = _chat(client, messages=messages, tools=TOOLS, max_tokens=8)
    assert second.choices[0].finish_reason in ("stop", "length")
    # The conversation, calls and results included, reached the model through the template.
    assert second.usage.prompt_tokens > first.usage.prompt_tokens


def test_streamed_required_calls_reassemble(client: openai.OpenAI) -> None:
    stream = _chat(
        client, tools=TOOLS, tool_choice="required", temperature=0.0, max_tokens=250, stream=True
    )
    calls: dict[int, dict[str, Any]] = {}
    finish = None
    for chunk in stream:
        for choice in chunk.choices:
            assert not choice.delta.content
            for delta in choice.delta.tool_calls or []:
                if delta.index not in calls:  # the first delta of a call names it
                    assert delta.id and delta.function.name
                    calls[delta.index] = {"name": delta.function.name, "arguments": ""}
                calls[delta.index]["arguments"] += delta.function.arguments or ""
            finish = choice.finish_reason or finish
    assert finish == "tool_calls" and calls
    for call in calls.values():
        jsonschema.validate(json.loads(call["arguments"]), PARAMETERS[call["name"]])


def _streamed_calls(stream: Any) -> tuple[list[tuple[str, str]], str | None, str]:
    calls: dict[int, list[str]] = {}
    finish, content = None, ""
    for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for delta in choice.delta.tool_calls or []:
                entry = calls.setdefault(delta.index, ["", ""])
                entry[0] += delta.function.name or ""
                entry[1] += delta.function.arguments or ""
            finish = choice.finish_reason or finish
    return [(name, arguments) for name, arguments in calls.values()], finish, content


@pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "function": {"name": "search"}}]
)
def test_a_forced_call_cut_by_max_tokens_is_a_partial_call(
    client: openai.OpenAI, choice: Any
) -> None:
    """What langchain's with_structured_output and bind_tools(tool_choice="any") read: whole or
    streamed, the call cut short is in tool_calls with its arguments so far, as OpenAI's."""
    kwargs = dict(tools=[SEARCH], tool_choice=choice, temperature=0.0, max_tokens=12)
    whole = _chat(client, **kwargs).choices[0]
    assert whole.finish_reason == "length" and whole.message.content is None
    calls = [(c.function.name, c.function.arguments) for c in whole.message.tool_calls or []]
    assert len(calls) == 1 and calls[0][0] == "search"
    streamed, finish, content = _streamed_calls(_chat(client, **kwargs, stream=True))
    assert (streamed, finish, content) == (calls, "length", "")


HERMES_CALL = '<tool_call>\n{"name": "search", "arguments": {"query": "ray"}}\n</tool_call>'


@pytest.mark.parametrize("stream", [False, True])
def test_auto_reads_the_models_hermes_calls(client: openai.OpenAI, stream: bool) -> None:
    """The model is made to write a Hermes call (a regex constraint on the exact text); with
    tool_choice auto the parser, picked by the chat template, reads it out."""
    pattern = re.escape("Sure. " + HERMES_CALL)
    kwargs = {"extra_body": {"structured_outputs": {"regex": pattern}}}
    if not stream:
        choice = _chat(client, tools=TOOLS, max_tokens=100, **kwargs).choices[0]
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content == "Sure. "
        [call] = choice.message.tool_calls
        assert (call.function.name, json.loads(call.function.arguments)) == (
            "search",
            {"query": "ray"},
        )
        return
    content, arguments, names = "", "", []
    for chunk in _chat(client, tools=TOOLS, max_tokens=100, stream=True, **kwargs):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for delta in choice.delta.tool_calls or []:
                names += [delta.function.name] if delta.function.name else []
                arguments += delta.function.arguments or ""
    assert content == "Sure. " and names == ["search"]
    assert json.loads(arguments) == {"query": "ray"}


# ---- the Responses API -------------------------------------------------------------------------


def test_responses_create_stream_retrieve(client: openai.OpenAI) -> None:
    created = client.responses.create(
        model=MODEL,
        input="Describe a person.",
        instructions="Answer in JSON.",
        max_output_tokens=400,
        text={
            "format": {
                "type": "json_schema",
                "name": "person",
                "schema": Person.model_json_schema(),
            }
        },
    )
    assert created.status == "completed"
    Person.model_validate_json(created.output_text)
    assert client.responses.retrieve(created.id).output_text == created.output_text
    events = list(
        client.responses.create(model=MODEL, input="Hi", max_output_tokens=6, stream=True)
    )
    assert events[0].type == "response.created" and events[-1].type in (
        "response.completed",
        "response.incomplete",
    )
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == events[-1].response.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))
    stored = client.responses.retrieve(events[-1].response.id)
    assert stored.output_text == text


def test_responses_function_tools(client: openai.OpenAI) -> None:
    tools = [{"type": "function", **SEARCH["function"]}]
    response = client.responses.create(
        model=MODEL,
        input="Find ray",
        tools=tools,
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0.0,
        max_output_tokens=200,
    )
    [call] = [item for item in response.output if item.type == "function_call"]
    jsonschema.validate(json.loads(call.arguments), PARAMETERS["search"])
    follow_up = client.responses.create(
        model=MODEL,
        previous_response_id=response.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "3 hits"}],
        max_output_tokens=5,
    )
    assert follow_up.status in ("completed", "incomplete")
    # Tools are not carried over (as OpenAI's), the conversation is: the question, the call and
    # its output reach the model.
    alone = client.responses.create(model=MODEL, input="Find ray", max_output_tokens=1)
    assert follow_up.usage.input_tokens > alone.usage.input_tokens + 10


def test_responses_unknown_and_unstored_ids_are_404(client: openai.OpenAI, url: str) -> None:
    response = client.responses.create(model=MODEL, input="Hi", max_output_tokens=3, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)
    with pytest.raises(openai.NotFoundError) as raised:
        client.responses.create(
            model=MODEL, input="Hi", previous_response_id="resp_missing", max_output_tokens=3
        )
    assert "previous_response_id" in str(raised.value)
    stored = client.responses.create(model=MODEL, input="Hi", max_output_tokens=3)
    assert httpx.delete(f"{url}/v1/responses/{stored.id}").json()["deleted"] is True
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(stored.id)


def test_responses_errors_name_the_responses_fields(url: str) -> None:
    body = {"model": MODEL, "input": "Hi", "max_output_tokens": 10**6}
    response = httpx.post(f"{url}/v1/responses", json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "max_output_tokens"
    assert "'max_output_tokens' is too large" in error["message"], error


def test_a_conversation_continues_on_any_ingress_and_engine(
    client: openai.OpenAI, url: str
) -> None:
    """The store is its own replica: after every ingress replica is replaced the conversation
    still continues, and follow-ups from one response run on both engine replicas."""
    import ray

    first = client.responses.create(model=MODEL, input="Remember: 42.", max_output_tokens=4)
    for actor in ray.util.list_named_actors(all_namespaces=True):
        if "OpenAIIngress" in actor["name"] and "structured" in actor["name"]:
            ray.kill(ray.get_actor(actor["name"], namespace=actor["namespace"]))
    _wait_healthy(url)
    before = _steps_by_replica(url)

    def follow_up(i: int) -> Any:
        return client.responses.create(
            model=MODEL, previous_response_id=first.id, input=f"Turn {i}", max_output_tokens=3
        )

    # Concurrent, so that power-of-two routing spreads them by load (sent one at a time to idle
    # engines, ties may all go one way).
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        follow_ups = list(pool.map(follow_up, range(16)))
    after = _steps_by_replica(url)
    assert all(f.usage.input_tokens > first.usage.total_tokens for f in follow_ups)
    assert len(after) == 2 and all(after[r] > before.get(r, 0) for r in after)


def _wait_healthy(url: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/v1/models", timeout=10).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise AssertionError("the app did not come back")


def _steps_by_replica(url: str) -> dict[str, int]:
    replicas = httpx.get(f"{url}/stats", timeout=30).json()["replicas"]
    return {r["replica_id"]: r["num_steps"] for r in replicas}
