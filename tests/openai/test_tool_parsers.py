"""The hermes and llama3_json tool-call parsers on crafted model outputs, and streamed vs whole.

Whatever the chunking, the streamed content and per-call argument fragments must add up to what
the whole-text parse returns, and a call's id and name must come first, once.
"""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedray.openai.tool_parsers import (
    TOOL_CALL_PARSERS,
    ExtractedToolCalls,
    StreamedDelta,
    ToolCallParser,
    ToolCallStreamer,
    tool_parser_for,
)

HERMES = TOOL_CALL_PARSERS["hermes"]
LLAMA = TOOL_CALL_PARSERS["llama3_json"]
CALL_ID = re.compile(r"call_[0-9a-f]{24}")


def hermes_call(name: str, args: Any, **dumps: Any) -> str:
    body = json.dumps({"name": name, "arguments": args}, **dumps)
    return f"<tool_call>\n{body}\n</tool_call>"


def calls_of(result: ExtractedToolCalls) -> list[tuple[str, Any]]:
    for call in result.tool_calls:
        assert CALL_ID.fullmatch(call.id)
    return [(call.name, json.loads(call.arguments)) for call in result.tool_calls]


def run_stream(streamer: ToolCallStreamer, chunks: list[str]) -> tuple[str, list[Any]]:
    """Streamed content and [(id, name, joined arguments)], checking the deltas' order."""
    deltas: list[StreamedDelta] = [streamer.feed(chunk) for chunk in chunks]
    deltas.append(streamer.finish())
    calls: list[list[Any]] = []
    for delta in deltas:
        for entry in delta.tool_calls:
            if entry.index == len(calls):  # a new call: its first delta names it
                assert entry.id is not None and entry.name, entry
                calls.append([entry.id, entry.name, entry.arguments])
            else:  # calls arrive one after the other, named once
                assert entry.index == len(calls) - 1 and entry.id is None and entry.name is None
                calls[-1][2] += entry.arguments
    return "".join(delta.content for delta in deltas), calls


def assert_stream_matches(parser: ToolCallParser, chunks: list[str]) -> ExtractedToolCalls:
    whole = parser.extract("".join(chunks))
    content, calls = run_stream(parser.streamer(), chunks)
    assert (content if content.strip() else None) == whole.content
    assert [(name, json.loads(args)) for _, name, args in calls] == calls_of(whole)
    assert len({call_id for call_id, _, _ in calls}) == len(calls)
    return whole


def chars(text: str) -> list[str]:
    return list(text)


# --- hermes -------------------------------------------------------------------------------------


def test_hermes_single_call() -> None:
    text = hermes_call("get_weather", {"city": "Paris"})
    result = HERMES.extract(text)
    assert result.content is None
    assert calls_of(result) == [("get_weather", {"city": "Paris"})]
    assert result.tool_calls[0].arguments == '{"city": "Paris"}'
    assert_stream_matches(HERMES, chars(text))


def test_hermes_text_before_several_calls() -> None:
    text = "Let me check.\n" + hermes_call("a", {"x": 1}) + "\n" + hermes_call("b", {})
    result = assert_stream_matches(HERMES, chars(text))
    assert result.content == "Let me check.\n\n"
    assert calls_of(result) == [("a", {"x": 1}), ("b", {})]


def test_hermes_arguments_before_name_and_missing_arguments() -> None:
    text = '<tool_call>{"arguments": {"q": "x"}, "name": "search"}</tool_call>'
    text += '<tool_call>{"name": "now"}</tool_call>'
    result = assert_stream_matches(HERMES, chars(text))
    assert calls_of(result) == [("search", {"q": "x"}), ("now", {})]


def test_hermes_arguments_as_json_string() -> None:
    text = hermes_call("f", json.dumps({"a": [1, 2]}))
    assert calls_of(assert_stream_matches(HERMES, chars(text))) == [("f", {"a": [1, 2]})]


# NOTE: once a call's name has been streamed it cannot be taken back, so the stream agrees with
# the whole-text parse only on calls that fail before their name is complete.
@pytest.mark.parametrize(
    ("text", "stream_agrees"),
    [
        ("<tool_call>\nnot json\n</tool_call>", True),
        ('<tool_call>{"name": "", "arguments": {}}</tool_call>', True),
        ('<tool_call>{"arguments": {}}</tool_call>', True),
        ('<tool_call>{"name": 7}</tool_call>', True),
        ('<tool_call>\n{"name": "f", "arguments": {"a": 1}\n</tool_call>', False),  # unbalanced
        ('<tool_call>{"name": "f", "arguments": [1]}</tool_call>', False),  # not an object
        ('<tool_call>{"name": "f", "arguments": {"a": NaN}}</tool_call>', False),
    ],
)
def test_hermes_malformed_call_is_content(text: str, stream_agrees: bool) -> None:
    assert HERMES.extract(text) == ExtractedToolCalls(text, [])
    if stream_agrees:
        assert_stream_matches(HERMES, chars(text))


def test_hermes_malformed_call_after_a_good_one_makes_all_content() -> None:
    text = hermes_call("f", {}) + "\n<tool_call>{oops}</tool_call>"
    assert HERMES.extract(text) == ExtractedToolCalls(text, [])


def test_hermes_unterminated_call() -> None:
    cut = 'Sure.<tool_call>\n{"name": "f'  # cut by max_tokens before the name was sent
    assert_stream_matches(HERMES, chars(cut))
    assert HERMES.extract(cut) == ExtractedToolCalls(cut, [])
    before = hermes_call("g", {"b": 2})
    result = assert_stream_matches(HERMES, [before, cut])
    assert calls_of(result) == [("g", {"b": 2})] and result.content == cut
    # Complete JSON without its closing marker (a model stopping early) still counts.
    complete = '<tool_call>\n{"name": "f", "arguments": {}}\n</tool'
    assert calls_of(assert_stream_matches(HERMES, chars(complete))) == [("f", {})]


def test_hermes_unicode_and_nested_arguments() -> None:
    args = {"city": "Zürich", "note": '雪 ☃ "quoted" \\ </tool_call> {', "deep": [{"a": [[]]}]}
    for ensure_ascii in (True, False):
        text = hermes_call("f", args, ensure_ascii=ensure_ascii)
        result = assert_stream_matches(HERMES, chars(text))
        assert calls_of(result) == [("f", args)]
        assert "Zürich" in result.tool_calls[0].arguments  # not \u-escaped


def test_hermes_plain_text_mentioning_tool_call() -> None:
    text = "Write tool_call, <tool_calls> or </tool_call> and end with <tool_ca"
    assert HERMES.extract(text) == ExtractedToolCalls(text, [])
    assert_stream_matches(HERMES, chars(text))


def test_hermes_holds_back_a_possible_marker() -> None:
    streamer = HERMES.streamer()
    assert streamer.feed("Hello <tool").content == "Hello "
    assert streamer.feed("_ca").content == ""
    assert streamer.feed("ll>\n{").content == ""
    assert streamer.feed('"name": "get_w').tool_calls == []  # the name is not complete yet
    [first] = streamer.feed('eather", "arguments": {"ci').tool_calls
    assert (first.index, first.name, first.arguments) == (0, "get_weather", '{"ci')
    assert CALL_ID.fullmatch(first.id or "")
    assert [d.arguments for d in streamer.feed('ty": "Paris"}}').tool_calls] == ['ty": "Paris"}']
    assert streamer.feed("\n</tool_call> Done").content == " Done"
    assert streamer.finish() == StreamedDelta()
    other = HERMES.streamer()
    assert other.feed("a <tool").content == "a "
    assert other.feed("box>").content == "<toolbox>"
    assert other.feed("<tool_c").content == ""
    assert other.finish().content == "<tool_c"


# --- llama3_json --------------------------------------------------------------------------------


@pytest.mark.parametrize("prefix", ["", "<|python_tag|>", "  \n<|python_tag|> "])
def test_llama_single_call(prefix: str) -> None:
    text = prefix + '{"name": "get_weather", "parameters": {"city": "Paris"}}'
    result = assert_stream_matches(LLAMA, chars(text))
    assert result.content is None
    assert calls_of(result) == [("get_weather", {"city": "Paris"})]


def test_llama_semicolon_separated_calls_and_arguments_key() -> None:
    text = '{"name": "a", "parameters": {"x": [1, {"y": null}]}}; '
    text += '{"name": "b", "arguments": {"s": "é;}"}};{"name": "c", "parameters": {}}'
    result = assert_stream_matches(LLAMA, chars(text))
    assert calls_of(result) == [("a", {"x": [1, {"y": None}]}), ("b", {"s": "é;}"}), ("c", {})]


@pytest.mark.parametrize(
    ("text", "stream_agrees"),
    [
        ("The weather is fine.", True),
        ("<|python_tag|>print(1)", True),
        ('{"city": "Paris"}', True),  # JSON, but not a call
        ("{not json", True),
        ("  ", True),
        ('{"name": "f", "parameters": {"a": }', False),
        ('{"name": "f", "parameters": {}} and then text', False),
        ('{"name": "f", "parameters": {}}; {"name": 3}', False),
    ],
)
def test_llama_plain_or_malformed_is_content(text: str, stream_agrees: bool) -> None:
    assert LLAMA.extract(text) == ExtractedToolCalls(text if text.strip() else None, [])
    if stream_agrees:
        assert_stream_matches(LLAMA, chars(text))


def test_llama_holds_back_a_possible_tag() -> None:
    streamer = LLAMA.streamer()
    assert streamer.feed(" <|py").content == ""
    assert streamer.feed("thon_tag|>").content == ""
    [first] = streamer.feed('{"name": "f", "parameters": {"a"').tool_calls
    assert (first.name, first.arguments) == ("f", '{"a"')
    other = LLAMA.streamer()
    assert other.feed(" <|py").content == ""
    assert other.feed("x").content == " <|pyx"


# --- registry -----------------------------------------------------------------------------------


def test_tool_parser_for() -> None:
    assert tool_parser_for("hermes", None) is HERMES
    assert tool_parser_for("llama3_json", "<tool_call>") is LLAMA
    assert tool_parser_for("auto", "{{ '<tool_call>' }} ipython") is HERMES
    assert tool_parser_for("auto", "{{ '<|python_tag|>' }}") is LLAMA
    assert tool_parser_for("auto", "{% if role == 'ipython' %}") is LLAMA
    assert tool_parser_for("auto", "plain") is HERMES
    assert tool_parser_for("auto", None) is HERMES
    assert HERMES.name == "hermes" and LLAMA.name == "llama3_json"
    message = "tool_call_parser: unknown parser 'x'; choose one of auto, hermes, llama3_json"
    with pytest.raises(ValueError, match=re.escape(message)):
        tool_parser_for("x", None)


# --- streamed == whole, on random calls and chunkings -------------------------------------------

_PIECES = ["a", "é", "雪", " ", "\n", '"', "\\", "{", "}", "[", "]", ";", "<tool_call>", "</tool"]
_TEXT = st.lists(st.sampled_from(_PIECES), max_size=6).map("".join)
_SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(-(10**12), 10**12)
    | st.floats(allow_nan=False, allow_infinity=False)
    | _TEXT
)
_VALUES = st.recursive(
    _SCALARS,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_TEXT, inner, max_size=3),
    max_leaves=8,
)
_CALLS = st.lists(
    st.tuples(
        st.sampled_from(["get_weather", "search", "f", "lookup-2"]),
        st.dictionaries(_TEXT, _VALUES, max_size=4),
    ),
    max_size=3,
)
_DUMPS = st.fixed_dictionaries(
    {
        "ensure_ascii": st.booleans(),
        "indent": st.sampled_from([None, 1]),
        "sort_keys": st.booleans(),
    }
)


def split(data: st.DataObject, text: str) -> list[str]:
    cuts = sorted(data.draw(st.sets(st.integers(0, len(text)), max_size=12)))
    return [text[start:end] for start, end in zip([0, *cuts], [*cuts, len(text)])]


@settings(max_examples=150, deadline=None)
@given(calls=_CALLS, lead=_TEXT, tail=_TEXT, dumps=_DUMPS, data=st.data())
def test_hermes_streamed_equals_whole(
    calls: list[tuple[str, Any]], lead: str, tail: str, dumps: dict[str, Any], data: st.DataObject
) -> None:
    # Text around the calls mentions markers but opens none (a broken call is tested above).
    lead, tail = lead.replace("<tool_call>", "<tool>"), tail.replace("<tool_call>", "<tool>")
    text = lead + "\n".join(hermes_call(name, args, **dumps) for name, args in calls) + tail
    result = assert_stream_matches(HERMES, split(data, text))
    assert calls_of(result) == calls


@settings(max_examples=150, deadline=None)
@given(
    calls=_CALLS,
    prefix=st.sampled_from(["", "<|python_tag|>", " \n"]),
    lead=_TEXT,
    separator=st.sampled_from(["; ", ";", "\n", " ; "]),
    key=st.sampled_from(["parameters", "arguments"]),
    dumps=_DUMPS,
    data=st.data(),
)
def test_llama_streamed_equals_whole(
    calls: list[tuple[str, Any]],
    prefix: str,
    lead: str,
    separator: str,
    key: str,
    dumps: dict[str, Any],
    data: st.DataObject,
) -> None:
    if lead.strip().startswith("{"):  # a broken first call: tested above
        lead = "x" + lead
    rendered = [json.dumps({"name": name, key: args}, **dumps) for name, args in calls]
    text = prefix + lead + separator.join(rendered)
    result = assert_stream_matches(LLAMA, split(data, text))
    if not lead.strip() and calls:
        assert calls_of(result) == calls and result.content is None
