"""`--reasoning-parser` (vLLM's): a thinking model's `<think>...</think>` becomes the chat
message's `reasoning`, apart from its `content`, whole or streamed, and a stream's pieces join
into exactly the whole answer's parts, however the text is cut; `chat_template_kwargs` (and the
server's `--default-chat-template-kwargs`) reach the chat template, and Qwen3's
`enable_thinking: false` makes the answer all content. Served over HTTP through the SDK, with
output a regex holds to a thinking model's shape."""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest
from fastapi.testclient import TestClient
from hypothesis import given
from hypothesis import strategies as st
from transformers import AutoTokenizer

from pagedray.engine.config import EngineConfig
from pagedray.engine.thinking_tokens import ThinkingTokens
from pagedray.openai.answers import AnswerContext, ChoiceParts
from pagedray.openai.local_app import local_openai_app
from pagedray.openai.reasoning import ReasoningParser
from pagedray.openai.serving import LogprobFormatter
from pagedray.openai.tool_calls import ToolCallOutput

R1 = ReasoningParser.of("deepseek_r1", {})
QWEN3 = ReasoningParser.of("qwen3", {})
# Output that starts in the content: after a prompt whose thinking is closed, or held by a regex.
AFTER_CLOSED = ReasoningParser.of("deepseek_r1", {}, prompt_tail="<think>\nhmm</think>\n\nSo")
HELD = ReasoningParser.of("qwen3", {}, constrained=True)
HIDDEN = ReasoningParser.of("deepseek_r1", {}, shown=False)  # include_reasoning: false


@pytest.mark.parametrize(
    ("parser", "text", "parts"),
    [
        (R1, "plan it</think>the answer", ("plan it", "the answer")),
        (R1, "<think>plan it</think>the answer", ("plan it", "the answer")),
        (R1, "still thinking when cut", ("still thinking when cut", None)),
        (R1, "</think>", (None, None)),
        (R1, "a</think>b</think>c", ("a", "b</think>c")),  # the first closes it
        (QWEN3, "<think>x</think>y", ("x", "y")),
        (QWEN3, 'x<tool_call>{"name": "f"}', ("x", '<tool_call>{"name": "f"}')),
        (AFTER_CLOSED, "the answer", (None, "the answer")),
        (AFTER_CLOSED, "<think>again</think>then", ("again", "then")),
        (HELD, "yes", (None, "yes")),
        (HELD, "<think>x</think>y", ("x", "y")),
        (HIDDEN, "plan it</think>the answer", (None, "the answer")),
    ],
)
def test_whole_split(parser: ReasoningParser, text: str, parts: tuple[Any, Any]) -> None:
    assert parser.split(text) == parts


def test_where_the_output_starts() -> None:
    assert ReasoningParser.of(None, {}) is None
    assert ReasoningParser.of("qwen3", {"enable_thinking": False}) is None  # all content
    assert R1 is not None and R1.thinking  # the template opened it: "<think>\n" ends the prompt
    opened = ReasoningParser.of("deepseek_r1", {}, prompt_tail="<｜Assistant｜><think>\n")
    assert opened is not None and opened.thinking
    assert AFTER_CLOSED is not None and not AFTER_CLOSED.thinking
    # A prefill continues inside the thinking only if it opened one (Anthropic's `{`).
    for tail, inside in (("<｜Assistant｜>{", False), ("<｜Assistant｜><think>\nplan", True)):
        continued = ReasoningParser.of("deepseek_r1", {}, prompt_tail=tail, continues=True)
        assert continued is not None and continued.thinking == inside


PIECES = st.lists(
    st.sampled_from(
        ["<", "<th", "ink>", "</", "think>", "</think>", "<think>", "a", "b c", "\n"]
        + ["<tool", "_call>", "<tool_call>", "{}"]
    ),
    min_size=1,
    max_size=12,
)


@given(pieces=PIECES, last_empty=st.booleans())
def test_a_stream_joins_into_the_whole_split(pieces: list[str], last_empty: bool) -> None:
    """However the text is cut, and whether the last piece has text or not."""
    pieces = [*pieces, ""] if last_empty else pieces
    for parser in (R1, QWEN3, AFTER_CLOSED, HELD):
        assert parser is not None
        stream = parser.stream()
        reasoning, content = "", ""
        for i, piece in enumerate(pieces):
            got = stream.feed(piece, finished=i == len(pieces) - 1)
            reasoning += got[0] or ""
            content += got[1] or ""
        assert (reasoning or None, content or None) == parser.split("".join(pieces))


# What the regex holds the tiny model's output to: a thinking, then an answer.
SHAPE = r"<think>[a-z]{3,8}</think>[a-z]{2,6}"
MESSAGES: Any = [{"role": "user", "content": "Think, then answer."}]


def _served(tiny_llama: str, **settings: Any) -> tuple[TestClient, openai.OpenAI]:
    config = EngineConfig(
        model=tiny_llama, num_kv_blocks=64, max_num_seqs=4, served_model_name=["x"], **settings
    )
    http = TestClient(local_openai_app(config))
    return http, openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=http)


def _ask(sdk: openai.OpenAI, stream: bool, **extra: Any) -> Any:
    return sdk.chat.completions.create(
        model="x",
        messages=MESSAGES,
        max_tokens=40,
        temperature=0.0,
        stream=stream,
        extra_body={"structured_outputs": {"regex": SHAPE}, **extra},
    )


def test_served_reasoning_whole_and_streamed(tiny_llama: str) -> None:
    http, sdk = _served(tiny_llama, reasoning_parser="deepseek_r1")
    with http:
        whole = _ask(sdk, stream=False).choices[0].message
        reasoning, content = "", ""
        for chunk in _ask(sdk, stream=True):
            if chunk.choices:
                delta: Any = chunk.choices[0].delta
                reasoning += getattr(delta, "reasoning", None) or ""
                content += delta.content or ""
    said: Any = whole
    assert said.reasoning and said.content
    assert "<" not in said.reasoning + said.content  # the tags are gone
    assert (reasoning, content) == (said.reasoning, said.content)
    # Output held to a choice from its first token starts in the content; include_reasoning
    # false drops the reasoning.
    http, sdk = _served(tiny_llama, reasoning_parser="deepseek_r1")
    with http:
        chose: Any = sdk.chat.completions.create(
            model="x",
            messages=MESSAGES,
            max_tokens=5,
            extra_body={"structured_outputs": {"choice": ["yes", "no"]}},
        )
        hidden: Any = _ask(sdk, stream=False, include_reasoning=False).choices[0].message
    assert chose.choices[0].message.content in ("yes", "no")
    assert chose.choices[0].message.reasoning is None
    assert (hidden.reasoning, hidden.content) == (None, said.content)
    # Without a parser, the tags are the content's, and no reasoning is sent.
    http, sdk = _served(tiny_llama)
    with http:
        plain: Any = _ask(sdk, stream=False).choices[0].message
    assert plain.content == f"<think>{said.reasoning}</think>{said.content}"
    assert plain.reasoning is None


def test_template_kwargs_reach_the_template_and_qwen3_thinking_off(
    tiny_llama: str, tmp_path: Any
) -> None:
    template = (
        "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
        "{% if enable_thinking is defined and not enable_thinking %}/no_think{% endif %}"
    )
    http, sdk = _served(
        tiny_llama,
        chat_template=template,
        reasoning_parser="qwen3",
        default_chat_template_kwargs='{"enable_thinking": false}',
    )
    with http:

        def prompt_length(kwargs: dict[str, Any] | None) -> int:
            body: dict[str, Any] = {"model": "x", "messages": MESSAGES}
            if kwargs is not None:
                body["chat_template_kwargs"] = kwargs
            return len(http.post("/tokenize", json=body).json()["tokens"])

        # The server's default renders "/no_think"; the request's own value replaces it.
        assert prompt_length(None) > prompt_length({"enable_thinking": True})
        off: Any = _ask(sdk, stream=False).choices[0].message
        assert off.reasoning is None and off.content.startswith("<think>")
        on: Any = _ask(sdk, stream=False, chat_template_kwargs={"enable_thinking": True})
        assert on.choices[0].message.reasoning
        # OpenAI's reasoning_effort, as vLLM reads it: "none" turns the thinking off, any other
        # value on, unless chat_template_kwargs says otherwise.
        for effort, thinks in (("low", True), ("none", False)):
            answer: Any = _ask(sdk, stream=False, reasoning_effort=effort)
            assert bool(answer.choices[0].message.reasoning) == thinks, effort
        kept_off = {"reasoning_effort": "high", "chat_template_kwargs": {"enable_thinking": False}}
        assert _ask(sdk, stream=False, **kept_off).choices[0].message.reasoning is None
        # A variable that is one of apply_chat_template's arguments or a special token's name,
        # or a value holding a special token string (it would render as a control token).
        eos = AutoTokenizer.from_pretrained(tiny_llama).eos_token
        for kwargs in ({"tokenize": True}, {"bos_token": "x"}, {"enable_thinking": eos}):
            refused = http.post(
                "/v1/chat/completions",
                json={"model": "x", "messages": MESSAGES, "chat_template_kwargs": kwargs},
            )
            assert refused.status_code == 400, kwargs
            assert refused.json()["error"]["param"] == "chat_template_kwargs"
    with pytest.raises(ValueError, match="not a variable a request may set"):
        EngineConfig(model="m", default_chat_template_kwargs={"messages": []})


def test_deepseek_v3_thinks_only_when_asked(tiny_llama: str) -> None:
    """`deepseek_v3` (vLLM's): the answer is all content unless the request turns thinking on
    (`thinking` or `enable_thinking`, or a reasoning_effort other than "none"); then R1's
    rules split it."""
    assert ReasoningParser.of("deepseek_v3", {}) is None
    assert ReasoningParser.of("deepseek_v3", {"thinking": True}) == R1
    http, sdk = _served(tiny_llama, reasoning_parser="deepseek_v3")
    with http:
        plain: Any = _ask(sdk, stream=False).choices[0].message
        thinking: Any = _ask(sdk, stream=False, chat_template_kwargs={"thinking": True})
        effort: Any = _ask(sdk, stream=False, reasoning_effort="high")
    assert plain.reasoning is None and plain.content.startswith("<think>")
    said = thinking.choices[0].message
    assert f"<think>{said.reasoning}</think>{said.content}" == plain.content
    assert effort.choices[0].message.reasoning == said.reasoning


def test_a_prefill_continues_in_the_thinking_only_if_it_opened_one(tiny_llama: str) -> None:
    """However long the prefill: its own text says whether it opened a thinking."""
    http, sdk = _served(tiny_llama, reasoning_parser="deepseek_r1")

    def continued(prefill: str) -> Any:
        messages = [*MESSAGES, {"role": "assistant", "content": prefill}]
        flags = {"add_generation_prompt": False, "continue_final_message": True}
        body = {"model": "x", "messages": messages, "max_tokens": 4, **flags}
        return http.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]

    with http:
        json_prefill = continued("{")
        thinking_prefill = continued("<think>\n" + "let me see " * 40)
    assert json_prefill["reasoning"] is None and json_prefill["content"]
    assert thinking_prefill["reasoning"] and thinking_prefill["content"] is None


def test_responses_give_a_reasoning_item_and_messages_a_thinking_block(tiny_llama: str) -> None:
    """Their text is the content's, whole and streamed alike: the random model never closes
    its thinking, so with deepseek_r1 all it writes is thinking, which chat shows as reasoning,
    the Responses API as a reasoning item and Anthropic's Messages API as a thinking block
    (each accepted back as input)."""
    http, sdk = _served(tiny_llama, reasoning_parser="deepseek_r1")
    with http:
        chat: Any = sdk.chat.completions.create(
            model="x", messages=MESSAGES, max_tokens=6, temperature=0.0
        )
        response = sdk.responses.create(
            model="x", input="Think, then answer.", max_output_tokens=6, temperature=0.0
        )
        events = list(
            sdk.responses.create(
                model="x",
                input="Think, then answer.",
                max_output_tokens=6,
                temperature=0.0,
                stream=True,
            )
        )
        echoed = [item.model_dump(exclude_none=True) for item in response.output]
        again = http.post(
            "/v1/responses",
            json={"model": "x", "input": [*echoed, {"role": "user", "content": "And?"}]},
        )
        body = {"model": "x", "max_tokens": 6, "messages": MESSAGES, "temperature": 0.0}
        message = http.post("/v1/messages", json=body).json()
        message_events = http.post("/v1/messages", json={**body, "stream": True}).text
        turns = [*MESSAGES, {"role": "assistant", "content": message["content"]}]
        follow = http.post(
            "/v1/messages", json={**body, "messages": [*turns, {"role": "user", "content": "And?"}]}
        )
    thinking = chat.choices[0].message.reasoning
    assert thinking and chat.choices[0].message.content is None
    assert response.output_text == ""
    (item,) = response.output
    assert item.type == "reasoning" and item.content is not None
    assert [part.text for part in item.content] == [thinking]
    assert item.status == "incomplete"  # cut short by max_output_tokens while thinking
    assert not [e for e in events if e.type == "response.output_text.delta" and e.delta]
    streamed = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert streamed == thinking
    # The reasoning item's events in order, its text part added before its deltas (what
    # openai-node's accumulator needs).
    kinds = [
        e.type for e in events if "reasoning" in e.type or "part" in e.type or "item" in e.type
    ]
    assert kinds[:3] == [
        "response.output_item.added",
        "response.content_part.added",
        "response.reasoning_text.delta",
    ]
    assert kinds[-3:] == [
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ]
    assert again.status_code == 200, again.text
    (block,) = message["content"]
    assert block["type"] == "thinking" and block["thinking"] == thinking and block["signature"]
    data = [
        json.loads(line[6:]) for line in message_events.splitlines() if line.startswith("data: ")
    ]
    deltas = [d["delta"] for d in data if d["type"] == "content_block_delta"]
    assert "".join(d["thinking"] for d in deltas if d["type"] == "thinking_delta") == thinking
    assert [d["type"] for d in deltas][-1] == "signature_delta"  # the block's last delta
    assert not [d for d in deltas if d["type"] == "text_delta"]
    assert follow.status_code == 200, follow.text


TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
CALL = '<tool_call>{"name": "f", "arguments": {}}</tool_call>'


@pytest.mark.parametrize(
    ("name", "text", "thinking"),
    [
        # deepseek_r1: a call written while thinking is thinking; the one after it is a call.
        ("deepseek_r1", f"<think>I could {CALL}?</think>{CALL}", f"I could {CALL}?"),
        # qwen3: the thinking ends at </think>, or at a <tool_call> (vLLM's qwen3 rule).
        ("qwen3", f"<think>I could call f</think>\n{CALL}", "I could call f"),
        ("qwen3", f"<think>I will call f{CALL}", "I will call f"),
    ],
)
def test_tool_calls_are_read_from_the_content_only(name: str, text: str, thinking: str) -> None:
    """Whole and streamed alike (ChoiceParts, which every streamed chat-based answer reads its
    text through)."""
    tools = ToolCallOutput.of(TOOLS, "auto", "hermes", None)
    assert tools is not None
    ctx = AnswerContext("r", "x", 1, 1, LogprobFormatter(None), None, tool_calls=tools)
    ctx.reasoning = ReasoningParser.of(name, {})
    assert ctx.reasoning is not None
    reasoning, content = ctx.reasoning.split(text)
    assert reasoning == thinking
    _, whole_calls, whole_reason = tools.extract(content or "", "stop")
    assert whole_calls is not None and [call.function.name for call in whole_calls] == ["f"]
    assert whole_reason == "tool_calls"
    parts = ChoiceParts.of(ctx)
    streamed, names = "", []
    for i in range(0, len(text), 5):
        piece, _, calls = parts.feed(text[i : i + 5], i + 5 >= len(text))
        streamed += piece or ""
        names += [c.function.name for c in calls or [] if c.function and c.function.name]
    assert (streamed, names) == (thinking, ["f"])
    assert parts.finish_reason("stop") == "tool_calls"


def test_qwen3_reads_the_prompt_back_to_its_turn_only() -> None:
    """Qwen3's template keeps an earlier assistant turn's thinking (a tool-call loop): a closed
    thinking before the last turn boundary does not make the new turn start in the content, in
    the text rule (served) or the token rule (offline and the engine's grammar), as vLLM's
    Qwen3 parser reads it; DeepSeek-R1's reads the whole prompt."""
    loop = "<think>plan</think><tool_call>{}</tool_call><|im_end|>\n<|im_start|>assistant\n"
    assert ReasoningParser.of("qwen3", {}, prompt_tail=loop).thinking
    closed = loop + "<think>\n\n</think>\n\n"  # the template's thinking off
    assert not ReasoningParser.of("qwen3", {}, prompt_tail=closed).thinking
    assert not ReasoningParser.of("deepseek_r1", {}, prompt_tail=loop).thinking
    tags = ThinkingTokens(start=510, end=511, boundaries=frozenset({3, 4}))
    assert tags.thinking_end([510, 9, 511, 12, 4, 3, 9]) == 511  # thinks anew: after `</think>`
    assert tags.thinking_end([4, 3, 9, 510, 511, 9]) is None  # this turn closed it
    assert ThinkingTokens(510, 511).thinking_end([510, 9, 511, 12, 4, 3, 9]) is None


@pytest.mark.parametrize(
    ("parser", "tokens", "count"),
    [
        (R1, [5, 6, 7, 511, 8, 9], 3),  # the template opened it: up to `</think>`
        (R1, [510, 5, 6, 511, 8], 2),  # a leading `<think>` is no thinking token
        (R1, [5, 6, 7], 3),  # cut short: all of it
        (AFTER_CLOSED, [5, 6], 0),
        (AFTER_CLOSED, [510, 5, 511, 6], 1),
        (AFTER_CLOSED, [5, 510, 6, 511], 0),  # a `<think>` past the start is text
        (QWEN3, [5, 512, 6], 1),  # a `<tool_call>` ends it too
    ],
)
def test_the_thinking_is_counted_in_tokens(
    parser: ReasoningParser, tokens: list[int], count: int
) -> None:
    tags = {"<think>": 510, "</think>": 511, "<tool_call>": 512}
    whole, pieces = parser.counter(tags), parser.counter(tags)
    whole.add(tokens)
    for token in tokens:
        pieces.add([token])
    assert whole.count == pieces.count == count


def test_whitespace_before_a_call_opens_no_content() -> None:
    """Qwen3's "</think>\n\n<tool_call>": streamed, the blank line is no content (the whole
    answer's parser drops it too), so no stream opens an empty message or text block; an answer
    of whitespace alone is still sent."""
    tools = ToolCallOutput.of(TOOLS, "auto", "hermes", None)
    ctx = AnswerContext("r", "x", 1, 1, LogprobFormatter(None), None, tool_calls=tools)
    ctx.reasoning = QWEN3
    text = f"<think>plan</think>\n\n{CALL}"
    parts = ChoiceParts.of(ctx)
    contents = [parts.feed(text[i : i + 4], i + 4 >= len(text))[1] for i in range(0, len(text), 4)]
    assert [c for c in contents if c] == []
    # Text after the calls keeps the whitespace before it, as the whole answer does.
    after = f"\n\n{CALL}\n\nDone"
    ctx.reasoning = None
    parts = ChoiceParts.of(ctx)
    ctx_whole = tools.extract(after, "stop")[0] if tools is not None else None
    streamed = [
        parts.feed(after[i : i + 3], i + 3 >= len(after))[1] for i in range(0, len(after), 3)
    ]
    assert "".join(c for c in streamed if c) == ctx_whole == "\n\n\n\nDone"
    # Without tools nothing is held: a stream's first whitespace goes out at once.
    ctx.tool_calls, ctx.reasoning = None, QWEN3
    parts = ChoiceParts.of(ctx)
    pieces = [parts.feed(piece, last) for piece, last in (("x</think>\n", False), ("y", True))]
    assert [p[1] for p in pieces] == ["\n", "y"]


def test_each_api_turns_qwen3_thinking_off_by_its_own_field(tiny_llama: str) -> None:
    """OpenAI's reasoning.effort "none" (Responses) and Anthropic's thinking disabled reach
    Qwen3's enable_thinking, as vLLM maps them: the answer is all text; left alone, the random
    model's output is all thinking (it never closes it)."""
    http, sdk = _served(tiny_llama, reasoning_parser="qwen3")
    with http:
        effort: Any = {"effort": "none"}
        off = sdk.responses.create(model="x", input="Hi", max_output_tokens=4, reasoning=effort)
        on = sdk.responses.create(model="x", input="Hi", max_output_tokens=4)
        body = {"model": "x", "max_tokens": 4, "messages": MESSAGES}
        disabled = {**body, "thinking": {"type": "disabled"}}
        unthinking = http.post("/v1/messages", json=disabled).json()
        bad = http.post("/v1/responses", json={"input": "Hi", "reasoning": {"effort": "extreme"}})
        thinking = http.post("/v1/messages", json=body).json()
    assert [item.type for item in off.output] == ["message"]
    assert [item.type for item in on.output] == ["reasoning"]
    assert [block["type"] for block in unthinking["content"]] == ["text"]
    assert [block["type"] for block in thinking["content"]] == ["thinking"]
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "reasoning.effort"


def test_a_structured_answer_is_held_to_its_grammar_after_the_thinking(
    thinking_llama: str,
) -> None:
    """As vLLM's, a reasoning model thinks freely and its JSON format, forced tool call or
    completion's structured output holds only after `</think>` (one token of this vocabulary):
    the thinking is free text, the content validates. (A bias makes the random model close its
    thinking after a few tokens.)"""
    http, sdk = _served(thinking_llama, reasoning_parser="deepseek_r1")
    end = AutoTokenizer.from_pretrained(thinking_llama).convert_tokens_to_ids("</think>")
    schema = {
        "type": "object",
        "properties": {"a": {"type": "integer"}},
        "required": ["a"],
        "additionalProperties": False,
    }
    sampling: Any = {"temperature": 1.0, "seed": 0, "logit_bias": {str(end): 12}}
    answer_format: Any = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
    tools: Any = [{"type": "function", "function": {"name": "f", "parameters": schema}}]

    def ask(stream: bool, **extra: Any) -> Any:
        return sdk.chat.completions.create(
            model="x", messages=MESSAGES, max_tokens=40, stream=stream, **sampling, **extra
        )

    with http:
        answer: Any = ask(False, response_format=answer_format, logprobs=True)
        reasoning, content, usage = "", "", None
        streamed = ask(True, response_format=answer_format, stream_options={"include_usage": True})
        for chunk in streamed:
            usage = chunk.usage or usage
            if chunk.choices:
                delta: Any = chunk.choices[0].delta
                reasoning += getattr(delta, "reasoning", None) or ""
                content += delta.content or ""
        called: Any = ask(False, tools=tools, tool_choice="required").choices[0].message
        # Completions too, as vLLM's engine gates them: by the prompt's tokens (none closed).
        completed: Any = sdk.completions.create(
            model="x",
            prompt="Think, then answer.",
            max_tokens=40,
            **{**sampling, "seed": 1},  # a seed whose number ends within the 40 tokens
            extra_body={"structured_outputs": {"json": schema}},
        ).choices[0]
        responses_usage: Any = sdk.responses.create(
            model="x", input="Think, then answer.", max_output_tokens=40, temperature=0.0
        ).usage
    whole = answer.choices[0]
    said = whole.message
    assert whole.finish_reason == "stop" and said.reasoning
    assert json.loads(said.content) == {"a": json.loads(said.content)["a"]}
    assert (reasoning, content) == (said.reasoning, said.content)
    assert called.reasoning and called.content is None
    assert [call.function.name for call in called.tool_calls] == ["f"]
    thinking, _, answered = completed.text.partition("</think>")
    assert thinking and json.loads(answered) == {"a": json.loads(answered)["a"]}
    # The thinking in tokens (those before `</think>`; vLLM's count starts only at a `<think>`
    # the model writes, so it says 0 where the template opened the thinking), whole and
    # streamed; the Responses API's output_tokens_details too (greedy, the model never closes
    # it there).
    tokens = [entry.token for entry in whole.logprobs.content]
    thought = tokens.index("</think>")
    assert answer.usage.completion_tokens_details.reasoning_tokens == thought
    assert usage is not None and usage.completion_tokens_details.reasoning_tokens == thought
    assert responses_usage.output_tokens_details.reasoning_tokens == responses_usage.output_tokens


def test_a_thinking_token_budget_ends_the_thinking(thinking_llama: str, tiny_llama: str) -> None:
    """vLLM's `thinking_token_budget`: after that many thinking tokens the engine forces
    `</think>` (the random model never writes it itself), per choice, whole and streamed, and
    a structured output then holds after it; refused where it cannot be kept."""
    http, sdk = _served(thinking_llama, reasoning_parser="deepseek_r1")
    digit = {"type": "integer", "minimum": 0, "maximum": 9}
    schema = {
        "type": "object",
        "properties": {"a": digit},
        "required": ["a"],
        "additionalProperties": False,
    }
    asks: Any = {"model": "x", "messages": MESSAGES, "max_tokens": 30, "temperature": 1.0}
    budget: Any = {"seed": 3, "n": 2, "extra_body": {"thinking_token_budget": 4}}
    with http:
        whole: Any = sdk.chat.completions.create(**asks, **budget)
        text: Any = sdk.completions.create(
            model="x",
            prompt="Think.",
            max_tokens=30,
            seed=3,
            extra_body={"thinking_token_budget": 2},
        )
        streamed = ["", ""]
        for chunk in sdk.chat.completions.create(**asks, **budget, stream=True):
            for choice in chunk.choices:
                streamed[choice.index] += getattr(choice.delta, "reasoning", None) or ""
        thinking = {"type": "enabled", "budget_tokens": 3}
        message = {"model": "x", "max_tokens": 20, "messages": MESSAGES, "thinking": thinking}
        anthropic = http.post("/v1/messages", json=message).json()
        held: Any = sdk.chat.completions.create(
            **asks,
            seed=3,
            response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}},
            extra_body={"thinking_token_budget": 4},
        )
    assert whole.usage.completion_tokens_details.reasoning_tokens == 2 * 4
    assert all(choice.message.reasoning and choice.message.content for choice in whole.choices)
    assert streamed == [choice.message.reasoning for choice in whole.choices]
    assert text.choices[0].text.count("</think>") == 1
    assert held.usage.completion_tokens_details.reasoning_tokens == 4
    assert json.loads(held.choices[0].message.content).keys() == {"a"}
    # Anthropic's budget, as vLLM maps it: the thinking block ends, the text follows.
    assert [block["type"] for block in anthropic["content"]] == ["thinking", "text"]
    http, sdk = _served(tiny_llama)
    with http:
        with pytest.raises(openai.BadRequestError) as refused:
            sdk.chat.completions.create(**asks, extra_body={"thinking_token_budget": 4})
        # A Messages client's budget is no error where none can be kept: it is not held.
        plain = http.post("/v1/messages", json=message)
    assert refused.value.body["param"] == "thinking_token_budget"  # type: ignore[index]
    assert plain.status_code == 200
