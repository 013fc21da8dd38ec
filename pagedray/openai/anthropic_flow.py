"""Anthropic's Messages API answers, built on a chat generation: the whole Message, or the
stream of events that builds one (`message_start`, content blocks of text and `tool_use`,
`message_delta` with the stop reason and usage, `message_stop`), as the `anthropic` SDK reads
them.

Text and tool calls come out of the chat path exactly as in chat completions (the same tool
parsers and forced-call streamers), so a forced `tool_use` block's input follows its schema.
"""

from __future__ import annotations

import json
import secrets
from typing import Any, AsyncIterator

from pagedray.openai.answer_models import ChatCompletionResponse
from pagedray.openai.answers import (
    AnswerContext,
    ChoiceParts,
    StreamError,
    chat_response,
    choice_deltas,
)
from pagedray.openai.anthropic_errors import anthropic_error
from pagedray.openai.engine_streams import EngineStreams
from pagedray.openai.serving import LINE_BREAKS_IN_JSON, UsageCounter, failure_status
from pagedray.scheduler.request_failure import RequestFailure


def new_message_id() -> str:
    """`msg_` and 24 hex digits, as Anthropic's message ids look."""
    return "msg_" + secrets.token_hex(12)


def tool_use_id(call_id: str) -> str:
    """A chat tool call's id as a `tool_use` block's (`toolu_…`, Anthropic's form)."""
    return "toolu_" + call_id.removeprefix("call_")


def stop_reason(finish_reason: str | None, stop: str | int | None, made_calls: bool) -> str:
    """Anthropic's stop reason for a chat finish reason and what stopped it (a stop string, or a
    stop token's id)."""
    if finish_reason == "length":
        return "max_tokens"
    if made_calls:
        return "tool_use"
    return "stop_sequence" if isinstance(stop, str) else "end_turn"


def message_usage(usage: UsageCounter, final: bool = True) -> dict[str, int]:
    """Anthropic's usage: `input_tokens` are the prompt tokens the prefix cache did not serve,
    `cache_read_input_tokens` those it did (their sum is the prompt's length)."""
    cached = usage.cached_tokens if final else 0
    return {
        "input_tokens": usage.prompt_tokens - cached,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
        "output_tokens": usage.completion_tokens,
    }


def tool_input(arguments: str) -> dict[str, Any]:
    """A call's arguments as a `tool_use` input object. Arguments cut short (max_tokens) give
    what they hold so far: the JSON closed at its last complete value, as the SDK's stream
    accumulator reads partial JSON; {} if nothing complete."""
    for text in _closed_prefixes(arguments):
        try:
            value = json.loads(text)
        except ValueError:
            continue
        return value if isinstance(value, dict) else {}
    return {}


def _closed_prefixes(text: str, tries: int = 8) -> list[str]:
    """`text` closed as it stands, then cut back to each of its last `tries` structural points
    (a comma or an opening bracket) and closed there."""
    cuts = [len(text)]
    cuts += [i for i in range(len(text) - 1, -1, -1) if text[i] in ",{["][:tries]
    closed = []
    for cut in cuts:
        prefix = text[:cut] if cut == len(text) or text[cut] == "," else text[: cut + 1]
        closers = _closers(prefix)
        if closers is not None:
            closed.append(prefix + closers)
    return closed


def _closers(text: str) -> str | None:
    """What closes every string, object and array left open in `text`; None if a string is
    cut inside an escape."""
    stack: list[str] = []
    in_string = escape = False
    for char in text:
        if in_string:
            if escape:
                escape = False
            elif char == "\\":
                escape = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "{[":
            stack.append("}" if char == "{" else "]")
        elif char in "}]" and stack:
            stack.pop()
    if escape:
        return None
    return ('"' if in_string else "") + "".join(reversed(stack))


# ---- the whole message ---------------------------------------------------------------------------


async def whole_message(
    message_id: str, ctx: AnswerContext, streams: EngineStreams
) -> dict[str, Any] | RequestFailure:
    """The finished Message, or the request's failure."""
    result = await chat_response(ctx, streams)
    if isinstance(result, RequestFailure):
        return result
    return message_of(message_id, result)


def message_of(message_id: str, result: ChatCompletionResponse) -> dict[str, Any]:
    """A chat completion (one choice) as a Message."""
    choice = result.choices[0]
    content: list[dict[str, Any]] = []
    if choice.message.reasoning:  # --reasoning-parser: the thinking first, as Claude's
        content.append(thinking_block(choice.message.reasoning))
    if choice.message.content:
        content.append({"type": "text", "text": choice.message.content})
    calls = choice.message.tool_calls or []
    for call in calls:
        content.append(
            {
                "type": "tool_use",
                "id": tool_use_id(call.id),
                "name": call.function.name,
                "input": tool_input(call.function.arguments),
            }
        )
    details = result.usage.prompt_tokens_details
    usage = UsageCounter(
        prompt_tokens=result.usage.prompt_tokens,
        completion_tokens=result.usage.completion_tokens,
        cached_tokens=details.cached_tokens if details is not None else 0,
    )
    reason = stop_reason(choice.finish_reason, choice.stop_reason, bool(calls))
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": result.model,
        "content": content,
        "stop_reason": reason,
        "stop_sequence": choice.stop_reason if reason == "stop_sequence" else None,
        "usage": message_usage(usage),
    }


def thinking_block(thinking: str) -> dict[str, Any]:
    """The model's thinking as Anthropic's extended thinking gives it."""
    return {"type": "thinking", "thinking": thinking, "signature": thinking_signature()}


def thinking_signature() -> str:
    """A thinking block's `signature`, which Anthropic's API checks when the block is sent back:
    a random token here, as vLLM's (a block sent back is accepted and left out)."""
    return secrets.token_hex(16)


# ---- the stream of events ------------------------------------------------------------------------


def event(name: str, data: dict[str, Any]) -> str:
    """One server-sent event as Anthropic frames them: its type named on the `event:` line."""
    text = json.dumps(data, ensure_ascii=False).translate(LINE_BREAKS_IN_JSON)
    return f"event: {name}\ndata: {text}\n\n"


class _Blocks:
    """The content blocks of a streamed message: which one is open, and its index."""

    def __init__(self) -> None:
        self.count = 0
        self.open: str | None = None  # "thinking", "text" or "tool_use"

    def start(self, block: dict[str, Any]) -> list[str]:
        events = self.stop()
        self.open = block["type"]
        data = {"type": "content_block_start", "index": self.count, "content_block": block}
        return [*events, event("content_block_start", data)]

    def delta(self, delta: dict[str, Any]) -> str:
        data = {"type": "content_block_delta", "index": self.count, "delta": delta}
        return event("content_block_delta", data)

    def stop(self) -> list[str]:
        if self.open is None:
            return []
        events = []
        if self.open == "thinking":  # its signature last, as Anthropic's stream sends it
            signature = {"type": "signature_delta", "signature": thinking_signature()}
            events.append(self.delta(signature))
        self.open = None
        self.count += 1
        data = {"type": "content_block_stop", "index": self.count - 1}
        return [*events, event("content_block_stop", data)]


async def message_events(
    message_id: str, ctx: AnswerContext, streams: EngineStreams
) -> AsyncIterator[str]:
    """The Message as Anthropic's events; an engine failure mid-stream is an `error` event."""
    start: dict[str, Any] = {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": ctx.model,
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": message_usage(UsageCounter(prompt_tokens=ctx.num_prompt_tokens), final=False),
    }
    yield event("message_start", {"type": "message_start", "message": start})
    yield event("ping", {"type": "ping"})
    blocks = _Blocks()
    parts = ChoiceParts.of(ctx)  # the thinking (--reasoning-parser) becomes a thinking block
    finish: tuple[str | None, str | int | None] = (None, None)
    try:
        async for _, delta, usage in choice_deltas(streams):
            if delta is None:
                for text in blocks.stop():
                    yield text
                reason = stop_reason(finish[0], finish[1], parts.made_calls)
                sequence = finish[1] if reason == "stop_sequence" else None
                data = {
                    "type": "message_delta",
                    "delta": {"stop_reason": reason, "stop_sequence": sequence},
                    "usage": message_usage(usage or UsageCounter()),
                }
                yield event("message_delta", data)
                yield event("message_stop", {"type": "message_stop"})
                return
            finished = delta.finish_reason is not None
            reasoning, content, calls = parts.feed(delta.text, finished, delta.token_ids)
            if finished:
                finish = (delta.finish_reason, delta.stop_reason)
            for text in _content_events(blocks, reasoning, content, calls):
                yield text
    except StreamError as exc:
        yield event("error", anthropic_error(failure_status(exc.failure), exc.failure.message))


def _content_events(
    blocks: _Blocks, reasoning: str | None, content: str | None, calls: list[Any] | None
) -> list[str]:
    events: list[str] = []
    if reasoning:
        if blocks.open != "thinking":
            events += blocks.start({"type": "thinking", "thinking": "", "signature": ""})
        events.append(blocks.delta({"type": "thinking_delta", "thinking": reasoning}))
    if content:
        if blocks.open != "text":
            events += blocks.start({"type": "text", "text": ""})
        events.append(blocks.delta({"type": "text_delta", "text": content}))
    for call in calls or []:
        function = call.function
        if call.id is not None:  # a new call: its block opens with its id and name
            name = function.name if function is not None else ""
            block: dict[str, Any] = {
                "type": "tool_use",
                "id": tool_use_id(call.id),
                "name": name,
                "input": {},
            }
            events += blocks.start(block)
        arguments = function.arguments if function is not None else None
        if arguments:
            events.append(blocks.delta({"type": "input_json_delta", "partial_json": arguments}))
    return events
