"""tools and tool_choice: their checks, the schema forced calls follow, and that output read back.

Outputs crafted to follow (or break) the schema are validated with jsonschema; constrained output
must come back as the same calls whole or streamed in chunks of any size.
"""

from __future__ import annotations

import copy
import json
import re
from typing import Any

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedray.openai.tool_choice import (
    ConstrainedToolCallStreamer,
    check_tools,
    constrained_tool_calls,
    tool_choice_schema,
    tools_for_template,
)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
NOW = {"type": "function", "function": {"name": "now"}}
TOOLS = [WEATHER, NOW]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
CALL_ID = re.compile(r"call_[0-9a-f]{24}")


def function(**fields: Any) -> dict[str, Any]:
    return {"type": "function", "function": fields}


@pytest.mark.parametrize(
    ("tools", "tool_choice", "parallel", "message"),
    [
        ({"a": 1}, None, None, "tools: must be a list"),
        (["x"], None, None, "tools: tool 0 must be"),
        ([{"type": "retrieval"}], None, None, "tools: tool 0 must be"),
        ([{"type": "function"}], None, None, "tools: tool 0 has no function"),
        ([WEATHER, function(description="x")], None, None, "tools: tool 1 has no function name"),
        ([function(name="")], None, None, "tools: tool 0 has no function name"),
        ([function(name="a b")], None, None, "tools: function name 'a b' must be 1 to 64"),
        ([function(name="f" * 65)], None, None, "must be 1 to 64 letters"),
        ([function(name="f\n")], None, None, "must be 1 to 64 letters"),
        ([NOW, NOW], None, None, "tools: duplicate function name 'now'"),
        ([function(name="f", parameters=[])], None, None, "tools: function 'f' parameters must"),
        ([function(name="f", description=3)], None, None, "tools: function 'f' description"),
        ([function(name="f", strict="yes")], None, None, "tools: function 'f' strict must"),
        (None, "required", None, "tool_choice: requires tools"),
        ([], NAMED, None, "tool_choice: requires tools"),
        (TOOLS, "sometimes", None, "tool_choice: must be 'none', 'auto', 'required' or"),
        (TOOLS, {"type": "function"}, None, "tool_choice: must be"),
        (TOOLS, function(name="x"), None, "tool_choice: function 'x' is not among the tools"),
        (TOOLS, "auto", "yes", "parallel_tool_calls: must be a boolean"),
    ],
)
def test_check_tools_errors(tools: Any, tool_choice: Any, parallel: Any, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        check_tools(tools, tool_choice, parallel)


@pytest.mark.parametrize(
    ("tools", "tool_choice", "parallel"),
    [
        (None, None, None),
        (None, "auto", None),
        (None, "none", True),
        ([], "auto", None),
        (TOOLS, "required", None),
        (TOOLS, NAMED, False),
        ([{"function": {"name": "no_type-1", "strict": True}}], None, True),
    ],
)
def test_check_tools_accepts(tools: Any, tool_choice: Any, parallel: Any) -> None:
    check_tools(tools, tool_choice, parallel)


def test_free_generation_has_no_schema() -> None:
    for tools, choice in [(TOOLS, "auto"), (TOOLS, None), (TOOLS, "none"), (None, "auto")]:
        assert tool_choice_schema(tools, choice, True) is None


def test_named_schema_is_the_parameters() -> None:
    schema = tool_choice_schema(TOOLS, NAMED, True)
    assert schema == WEATHER["function"]["parameters"]  # type: ignore[index]
    assert schema is not WEATHER["function"]["parameters"]  # type: ignore[index]
    jsonschema.validate({"city": "Paris", "days": 2}, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"days": 2}, schema)
    empty = tool_choice_schema(TOOLS, {"type": "function", "function": {"name": "now"}}, True)
    assert empty == {"type": "object", "properties": {}}


def test_required_schema() -> None:
    schema = tool_choice_schema(TOOLS, "required", None)
    assert schema is not None and "maxItems" not in schema
    assert schema["minItems"] == 1
    [weather, now] = schema["items"]["anyOf"]
    assert weather["properties"]["name"] == {"type": "string", "enum": ["get_weather"]}
    assert now["properties"]["parameters"] == {"type": "object", "properties": {}}
    assert weather["required"] == ["name", "parameters"] and not weather["additionalProperties"]
    good = [
        {"name": "get_weather", "parameters": {"city": "Paris"}},
        {"name": "now", "parameters": {}},
    ]
    jsonschema.validate(good, schema)
    bad: list[Any] = [
        [],
        [{"name": "get_weather", "parameters": {"days": 1}}],  # city missing
        [{"name": "later", "parameters": {}}],
        [{"name": "now", "parameters": {}, "extra": 1}],
        [{"name": "now"}],
        {"name": "now", "parameters": {}},
    ]
    for output in bad:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(output, schema)
    single = tool_choice_schema(TOOLS, "required", False)
    assert single is not None and single["maxItems"] == 1
    jsonschema.validate(good[:1], single)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(good, single)


def test_required_schema_lifts_defs() -> None:
    place = {"type": "object", "properties": {"lat": {"type": "number"}}, "required": ["lat"]}
    go = function(
        name="go",
        parameters={
            "type": "object",
            "properties": {"to": {"$ref": "#/$defs/Place"}},
            "$defs": {"Place": place},
        },
    )
    before = copy.deepcopy(go)
    schema = tool_choice_schema([go, NOW], "required", True)
    assert go == before and schema is not None and schema["$defs"] == {"Place": place}
    jsonschema.validate([{"name": "go", "parameters": {"to": {"lat": 1.5}}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "go", "parameters": {"to": {"lat": "x"}}}], schema)
    other = function(name="back", parameters={"$defs": {"Place": {"type": "string"}}})
    with pytest.raises(ValueError, match=re.escape("tools: functions define $defs 'Place'")):
        tool_choice_schema([go, other], "required", True)


def test_constrained_tool_calls() -> None:
    [call] = constrained_tool_calls('{"city": "Zürich"}', TOOLS, NAMED)
    assert CALL_ID.fullmatch(call.id)
    assert (call.name, call.arguments) == ("get_weather", '{"city": "Zürich"}')
    text = (
        '[{"name": "now", "parameters": {}}, {"name": "get_weather", "parameters": {"city": "P"}}]'
    )
    calls = constrained_tool_calls(text, TOOLS, "required")
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("now", {}),
        ("get_weather", {"city": "P"}),
    ]
    assert len({c.id for c in calls}) == 2
    for bad, choice in [
        ('{"city": "Pa', NAMED),  # cut short by max_tokens
        ("[1]", NAMED),
        ('[{"name": "now", "parameters": {}}', "required"),
        ('[{"name": "later", "parameters": {}}]', "required"),
        ("[]", "required"),
        ("{}", "auto"),
    ]:
        with pytest.raises(ValueError, match="tool_choice: "):
            constrained_tool_calls(bad, TOOLS, choice)


def test_tools_for_template() -> None:
    before = copy.deepcopy(TOOLS)
    rendered = tools_for_template(TOOLS)
    assert before == TOOLS
    assert rendered[0] == WEATHER and rendered[0] is not WEATHER
    assert rendered[1] == function(name="now", parameters={"type": "object", "properties": {}})
    assert tools_for_template(None) == []
    assert tools_for_template([{"function": {"name": "f"}}])[0]["type"] == "function"


def test_constrained_streamer_refuses_free_generation() -> None:
    with pytest.raises(ValueError, match="tool_choice: 'auto' does not constrain"):
        ConstrainedToolCallStreamer("auto")


def run_stream(streamer: ConstrainedToolCallStreamer, chunks: list[str]) -> list[list[Any]]:
    """[(id, name, joined arguments)] from the deltas, checking that no content is sent."""
    deltas = [streamer.feed(chunk) for chunk in chunks] + [streamer.finish()]
    calls: list[list[Any]] = []
    for delta in deltas:
        assert delta.content == ""
        for entry in delta.tool_calls:
            if entry.index == len(calls):
                assert entry.id is not None and CALL_ID.fullmatch(entry.id) and entry.name
                calls.append([entry.id, entry.name, entry.arguments])
            else:
                assert entry.index == len(calls) - 1 and entry.id is None and entry.name is None
                calls[-1][2] += entry.arguments
    return calls


_TEXT = st.text(st.sampled_from(list('ab é雪"\\{}[],:\n')), max_size=6)
_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | _TEXT,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_TEXT, inner, max_size=3),
    max_leaves=8,
)
_ARGS = st.dictionaries(_TEXT, _VALUES, max_size=4)
_DUMPS = st.fixed_dictionaries(
    {
        "ensure_ascii": st.booleans(),
        "indent": st.sampled_from([None, 2]),
        "sort_keys": st.booleans(),
    }
)


def split(data: st.DataObject, text: str) -> list[str]:
    cuts = sorted(data.draw(st.sets(st.integers(0, len(text)), max_size=12)))
    return [text[start:end] for start, end in zip([0, *cuts], [*cuts, len(text)])]


@settings(max_examples=100, deadline=None)
@given(args=_ARGS, dumps=_DUMPS, data=st.data())
def test_constrained_streamer_named(
    args: dict[str, Any], dumps: dict[str, Any], data: st.DataObject
) -> None:
    text = json.dumps(args, **dumps)
    [(_, name, arguments)] = run_stream(ConstrainedToolCallStreamer(NAMED), split(data, text))
    [whole] = constrained_tool_calls(text, TOOLS, NAMED)
    assert name == whole.name == "get_weather"
    assert json.loads(arguments) == json.loads(whole.arguments) == args


@settings(max_examples=150, deadline=None)
@given(
    calls=st.lists(st.tuples(st.sampled_from(["get_weather", "now"]), _ARGS), min_size=1),
    dumps=_DUMPS,
    data=st.data(),
)
def test_constrained_streamer_required(
    calls: list[tuple[str, Any]], dumps: dict[str, Any], data: st.DataObject
) -> None:
    text = json.dumps([{"name": name, "parameters": args} for name, args in calls], **dumps)
    streamed = run_stream(ConstrainedToolCallStreamer("required"), split(data, text))
    whole = constrained_tool_calls(text, TOOLS, "required")
    assert [(name, json.loads(args)) for _, name, args in streamed] == calls
    assert [(call.name, json.loads(call.arguments)) for call in whole] == calls


@settings(max_examples=150, deadline=None)
@given(
    calls=st.lists(st.tuples(st.sampled_from(["get_weather", "now"]), _ARGS), min_size=1),
    named=st.booleans(),
    data=st.data(),
)
def test_forced_output_cut_short_is_one_shape_whole_and_streamed(
    calls: list[tuple[str, Any]], named: bool, data: st.DataObject
) -> None:
    """max_tokens cuts a forced output anywhere: whole or streamed, the partial calls come back
    as tool calls (never as content) with the arguments written so far."""
    from pagedray.openai.tool_calls import ToolCallOutput

    choice = NAMED if named else "required"
    items = [{"name": name, "parameters": args} for name, args in calls]
    text = json.dumps(calls[0][1] if named else items)
    cut = text[: data.draw(st.integers(0, len(text) - 1))]
    output = ToolCallOutput.of(TOOLS, choice, "auto", None)
    assert output is not None
    content, whole, finish_reason = output.extract(cut, "length")
    stream = output.streamer()
    streamed_content, deltas = stream.feed(cut, finished=True)
    assert content is None and streamed_content is None and finish_reason == "length"
    joined: dict[int, list[str]] = {}
    for delta in deltas or []:
        entry = joined.setdefault(delta.index, ["", ""])
        entry[0] += (delta.function.name or "") if delta.function else ""
        entry[1] += (delta.function.arguments or "") if delta.function else ""
    assert [[c.function.name, c.function.arguments] for c in whole or []] == list(joined.values())
    assert stream.finish_reason("length") == "length"
    if named:  # the call is known from the first token: its arguments are the text so far
        assert [(c.function.name, c.function.arguments) for c in whole or []] == [
            ("get_weather", cut)
        ]


def test_a_required_call_cut_before_its_name_is_named_when_one_tool_fits() -> None:
    from pagedray.openai.tool_calls import ToolCallOutput

    one = ToolCallOutput.of([WEATHER], "required", "auto", None)
    two = ToolCallOutput.of(TOOLS, "required", "auto", None)
    assert one is not None and two is not None
    for cut in ("", "[", '[{"na', '[{"name": "ge'):
        _, calls, _ = one.extract(cut, "length")
        assert [(c.function.name, c.function.arguments) for c in calls or []] == [
            ("get_weather", "")
        ]
    _, calls, _ = two.extract('[{"name": "n', "length")  # only "now" starts so
    assert [c.function.name for c in calls or []] == ["now"]
    assert two.extract('[{"name": "', "length")[1] is None  # either tool: nothing to tell
