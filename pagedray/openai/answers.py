"""The four generation answers: completions and chat, each whole or streamed as SSE chunks.

Each reads the merged engine streams of one client request (see `EngineStreams`); an engine error
becomes an error dict (whole) or an error event followed by `[DONE]` (streamed).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Iterable, Mapping, Sequence

from pagedray.engine.output_processor import ChoiceDelta
from pagedray.engine.step_outputs import merge_step_outputs
from pagedray.engine.wire import RequestStepOutput
from pagedray.openai.answer_models import (
    ChatChoiceLogprobs,
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatCompletionStreamChoice,
    ChatResponseMessage,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    DeltaMessage,
    UsageInfo,
)
from pagedray.openai.constraints import DeltaToolCall
from pagedray.openai.engine_streams import EngineStreams
from pagedray.openai.reasoning import ReasoningParser, ReasoningStream, ThoughtCounter
from pagedray.openai.serving import (
    SSE_DONE,
    LogprobFormatter,
    UsageCounter,
    failure_error,
    sse,
)
from pagedray.openai.text_chunks import TextChunkTemplate
from pagedray.openai.tool_calls import ChoiceToolStream, ToolCallOutput
from pagedray.scheduler.request_failure import RequestFailure


@dataclass
class AnswerContext:
    """What shapes one client request's answer."""

    request_id: str
    model: str
    n: int  # choices per prompt
    num_prompts: int
    logprobs: LogprobFormatter
    num_logprobs: int | None  # top logprobs per token; None = logprobs not requested
    include_usage: bool = False
    echo: list[str] | None = None  # per prompt: text put before the answer's (`echo`)
    echo_token_ids: list[list[int]] | None = None  # per prompt, with echo: its token ids
    tool_calls: ToolCallOutput | None = None  # chat with tools: how text becomes calls
    reasoning: ReasoningParser | None = None  # chat: how the thinking splits from the answer
    # With a --reasoning-parser whose tags are single tokens: their ids, to count the thinking
    # in tokens for the usage (vLLM's `reasoning_tokens`); None: not counted.
    reasoning_tags: Mapping[str, int] | None = None
    num_prompt_tokens: int = 0  # summed over the prompts, known before any output
    # vLLM's return_token_ids: each prompt's token ids, shown with each choice's own.
    prompt_token_ids: list[list[int]] | None = None
    # One timestamp for every chunk of the answer, as OpenAI and vLLM stamp them.
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def num_choices(self) -> int:
        return self.n * self.num_prompts

    def index(self, prompt_index: int, delta: ChoiceDelta) -> int:
        return prompt_index * self.n + delta.index

    def thought_counter(self) -> ThoughtCounter | None:
        """A counter of one choice's thinking in tokens; None where it is not counted."""
        if self.reasoning_tags is None:
            return None
        if self.reasoning is None:  # no thinking (Qwen3's turned off, JSON from the first token)
            return ThoughtCounter(False, None, frozenset())
        return self.reasoning.counter(self.reasoning_tags)

    def prompt_ids(self, index: int) -> list[int] | None:
        """Choice `index`'s prompt token ids, if the answer shows token ids."""
        return None if self.prompt_token_ids is None else self.prompt_token_ids[index // self.n]

    def token_ids(self, delta: ChoiceDelta) -> list[int] | None:
        """A delta's token ids, if the answer shows them."""
        return None if self.prompt_token_ids is None else delta.token_ids

    def echo_text(self, index: int) -> str:
        return self.echo[index // self.n] if self.echo else ""

    def echo_logprobs(self, index: int, delta: ChoiceDelta) -> CompletionLogprobs | None:
        """The echoed prompt's logprobs, once the delta carrying them arrives (echo + logprobs)."""
        if not self.echo_token_ids or self.num_logprobs is None or not delta.prompt_logprobs:
            return None
        token_ids = self.echo_token_ids[index // self.n]
        return self.logprobs.prompt(token_ids, delta.prompt_logprobs)


@dataclass
class ChoiceParts:
    """One streamed choice's text as an answer shows it: the thinking (`--reasoning-parser`),
    the content, and the tool calls read from the content only. What every streamed chat-based
    answer (chat completions, Responses, Messages) reads its deltas through."""

    reasoning: ReasoningStream | None
    tools: ChoiceToolStream | None
    thought: ThoughtCounter | None = None  # the thinking in tokens, for the usage
    # With tools, leading content of whitespace alone (the "\n\n" a model writes after
    # `</think>`, before its calls) is held until text follows it, and dropped if none does, as
    # the whole answer's parser drops content of whitespace alone: no stream opens an empty
    # message or text block for it.
    held_space: str = ""
    said: bool = False

    @classmethod
    def of(cls, ctx: AnswerContext) -> ChoiceParts:
        reasoning = ctx.reasoning.stream() if ctx.reasoning is not None else None
        tools = ctx.tool_calls.streamer() if ctx.tool_calls is not None else None
        return cls(reasoning, tools, ctx.thought_counter())

    def feed(
        self, text: str, finished: bool, token_ids: Sequence[int] = ()
    ) -> tuple[str | None, str | None, list[DeltaToolCall] | None]:
        """(reasoning, content, tool-call deltas) of a piece of text (of these tokens);
        `finished`: its last."""
        if self.thought is not None:
            self.thought.add(token_ids)
        reasoning: str | None = None
        content: str | None = text
        if self.reasoning is not None:
            reasoning, content = self.reasoning.feed(text, finished)
        calls = None
        if self.tools is not None:
            content, calls = self.tools.feed(content or "", finished)
        return reasoning, self._leading_space_held(content, finished), calls

    def _leading_space_held(self, content: str | None, finished: bool) -> str | None:
        if self.tools is None or self.said:
            return content
        if content and content.strip():
            self.said = True
            content, self.held_space = self.held_space + content, ""
            return content
        self.held_space += content or ""
        if finished:
            self.held_space = ""  # whitespace alone is no content where tools are read
        return None

    def finish_reason(self, finish_reason: str | None) -> str | None:
        return self.tools.finish_reason(finish_reason) if self.tools is not None else finish_reason

    @property
    def made_calls(self) -> bool:
        return self.tools is not None and self.tools.made_calls


def count_thinking(
    usage: UsageCounter | None, thoughts: Iterable[ThoughtCounter | None]
) -> UsageCounter:
    """`usage` with the choices' thinking counted in (where it is counted at all)."""
    usage = usage or UsageCounter()
    counted = [thought.count for thought in thoughts if thought is not None]
    if counted:
        usage.reasoning_tokens = sum(counted)
    return usage


async def _collect(
    ctx: AnswerContext, streams: EngineStreams
) -> tuple[list[ChoiceDelta], UsageCounter] | RequestFailure:
    """Run every engine request to the end; returns each choice's deltas joined into one (by
    `merge_step_outputs`, the one place outputs merge: a request that wants one output sends one
    already) and the usage, or the failure."""
    by_prompt: dict[int, list[RequestStepOutput]] = {}
    usage = UsageCounter()
    async with contextlib.aclosing(streams.merged()) as merged:
        async for prompt_index, output in merged:
            if output.error is not None:
                return output.error
            usage.add(output)
            by_prompt.setdefault(prompt_index, []).append(output)
    choices = [ChoiceDelta("", i % ctx.n, "", [], None, None, None) for i in range(ctx.num_choices)]
    for prompt_index, outputs in by_prompt.items():
        for delta in merge_step_outputs(outputs).deltas:
            choices[ctx.index(prompt_index, delta)] = delta
    return choices, usage


async def completion_response(
    ctx: AnswerContext, streams: EngineStreams
) -> CompletionResponse | RequestFailure:
    collected = await _collect(ctx, streams)
    if isinstance(collected, RequestFailure):
        return collected
    choices, usage = collected
    return CompletionResponse(
        id=ctx.request_id,
        created=ctx.created,
        model=ctx.model,
        choices=[
            CompletionChoice(
                index=i,
                text=ctx.echo_text(i) + c.text,
                logprobs=_completion_logprobs(ctx, i, c) if ctx.num_logprobs is not None else None,
                finish_reason=c.finish_reason,
                stop_reason=c.stop_reason,
                prompt_token_ids=ctx.prompt_ids(i),
                token_ids=ctx.token_ids(c),
                prompt_logprobs=ctx.logprobs.prompt_entries(c) if c.prompt_logprobs else None,
            )
            for i, c in enumerate(choices)
        ],
        usage=usage.info(),
    )


def _completion_logprobs(ctx: AnswerContext, index: int, choice: ChoiceDelta) -> CompletionLogprobs:
    """A whole choice's logprobs: the echoed prompt's, if asked, then the generated tokens'."""
    generated = ctx.logprobs.completion(choice, len(ctx.echo_text(index)))
    echoed = ctx.echo_logprobs(index, choice)
    return generated if echoed is None else _joined(echoed, generated)


async def chat_response(
    ctx: AnswerContext, streams: EngineStreams
) -> ChatCompletionResponse | RequestFailure:
    collected = await _collect(ctx, streams)
    if isinstance(collected, RequestFailure):
        return collected
    choices, usage = collected
    messages = [ChatResponseMessage(content=c.text) for c in choices]
    if ctx.reasoning is not None:
        for c, message in zip(choices, messages):
            message.reasoning, message.content = ctx.reasoning.split(c.text)
    thoughts = [ctx.thought_counter() for _ in choices]
    for c, thought in zip(choices, thoughts):
        if thought is not None:
            thought.add(c.token_ids)
    usage = count_thinking(usage, thoughts)
    finish_reasons = [c.finish_reason for c in choices]
    if ctx.tool_calls is not None:
        for i, message in enumerate(messages):
            extracted = ctx.tool_calls.extract(message.content or "", choices[i].finish_reason)
            message.content, message.tool_calls, finish_reasons[i] = extracted
    if ctx.echo:  # after the parsers, as vLLM's: they read what the model wrote
        for i, message in enumerate(messages):
            message.content = ctx.echo_text(i) + (message.content or "")
    num_logprobs = ctx.num_logprobs
    return ChatCompletionResponse(
        id=ctx.request_id,
        created=ctx.created,
        model=ctx.model,
        choices=[
            ChatCompletionChoice(
                index=i,
                message=messages[i],
                logprobs=(
                    ChatChoiceLogprobs(content=ctx.logprobs.chat(c, num_logprobs))
                    if num_logprobs is not None
                    else None
                ),
                finish_reason=finish_reasons[i],
                stop_reason=c.stop_reason,
                token_ids=ctx.token_ids(c),
            )
            for i, c in enumerate(choices)
        ],
        usage=usage.info(),
        prompt_token_ids=ctx.prompt_ids(0),
        prompt_logprobs=(
            ctx.logprobs.prompt_entries(choices[0]) if choices[0].prompt_logprobs else None
        ),
    )


async def completion_chunks(ctx: AnswerContext, streams: EngineStreams) -> AsyncIterator[str]:
    """`text_completion` chunks, then a usage chunk if asked, then `[DONE]`."""
    offsets = [len(ctx.echo_text(i)) for i in range(ctx.num_choices)]

    def chunk(choices: list[CompletionChoice], usage: UsageInfo | None = None) -> str:
        return sse(response(choices, usage))

    def response(choices: list[CompletionChoice], usage: UsageInfo | None) -> CompletionResponse:
        return CompletionResponse(
            id=ctx.request_id, created=ctx.created, model=ctx.model, choices=choices, usage=usage
        )

    text_only = TextChunkTemplate(
        lambda i, text: response([CompletionChoice(index=i, text=text)], None)
    )
    # With logprobs, a choice's echo waits for its first delta, which brings the prompt's.
    if ctx.echo and ctx.num_logprobs is None:
        for i in range(ctx.num_choices):
            yield chunk([CompletionChoice(index=i, text=ctx.echo_text(i))])
    # return_token_ids: a choice's first chunk carries its prompt's token ids.
    unshown_prompts = set(range(ctx.num_choices)) if ctx.prompt_token_ids is not None else set()
    async for prompt_index, delta, usage in choice_deltas(streams):
        if delta is None:
            if ctx.include_usage:
                yield chunk([], _info(usage))
            break
        index = ctx.index(prompt_index, delta)
        echoed = ctx.echo_logprobs(index, delta)
        if echoed is not None:
            yield chunk([CompletionChoice(index=index, text=ctx.echo_text(index), logprobs=echoed)])
        logprobs = None
        if ctx.num_logprobs is not None:
            logprobs = ctx.logprobs.completion(delta, offsets[index])
        offsets[index] += len(delta.text)
        plain = delta.finish_reason is None and delta.stop_reason is None and logprobs is None
        if plain and ctx.prompt_token_ids is None:
            if delta.text:  # text alone: most chunks
                yield text_only.event(index, delta.text)
            continue
        prompt_ids = ctx.prompt_ids(index) if index in unshown_prompts else None
        unshown_prompts.discard(index)
        choice = CompletionChoice(
            index=index,
            text=delta.text,
            logprobs=logprobs,
            finish_reason=delta.finish_reason,
            stop_reason=delta.stop_reason,
            prompt_token_ids=prompt_ids,
            token_ids=ctx.token_ids(delta),
        )
        yield chunk([choice])
    yield SSE_DONE


async def chat_chunks(ctx: AnswerContext, streams: EngineStreams) -> AsyncIterator[str]:
    """A role chunk per choice, content chunks, a usage chunk if asked, then `[DONE]`."""

    def model(
        choices: list[ChatCompletionStreamChoice],
        usage: UsageInfo | None = None,
        prompt_token_ids: list[int] | None = None,
    ) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            id=ctx.request_id,
            created=ctx.created,
            model=ctx.model,
            choices=choices,
            usage=usage,
            prompt_token_ids=prompt_token_ids,
        )

    def chunk(choices: list[ChatCompletionStreamChoice]) -> str:
        return sse(model(choices))

    text_only = TextChunkTemplate(
        lambda i, text: model(
            [ChatCompletionStreamChoice(index=i, delta=DeltaMessage(content=text))]
        )
    )

    for i in range(ctx.num_choices):
        role = DeltaMessage(role="assistant", content="")
        # return_token_ids: the first chunk carries the prompt's token ids.
        yield sse(
            model(
                [ChatCompletionStreamChoice(index=i, delta=role)],
                None,
                ctx.prompt_ids(i) if i == 0 else None,
            )
        )
    if ctx.echo:  # the echoed content, a chunk per choice, before what the model writes
        for i in range(ctx.num_choices):
            yield text_only.event(i, ctx.echo_text(i))
    parts = [ChoiceParts.of(ctx) for _ in range(ctx.num_choices)]
    async for prompt_index, delta, usage in choice_deltas(streams):
        if delta is None:
            if ctx.include_usage:
                last = model([], count_thinking(usage, (p.thought for p in parts)).info())
                yield sse(last)
            break
        logprobs = None
        if ctx.num_logprobs is not None:
            logprobs = ChatChoiceLogprobs(content=ctx.logprobs.chat(delta, ctx.num_logprobs))
        index = ctx.index(prompt_index, delta)
        finished = delta.finish_reason is not None
        reasoning, content, calls = parts[index].feed(delta.text, finished, delta.token_ids)
        message = DeltaMessage(content=content, tool_calls=calls, reasoning=reasoning)
        finish_reason = parts[index].finish_reason(delta.finish_reason)
        said = message.content or message.tool_calls or message.reasoning
        # A delta whose text is held (a tag not whole yet) still shows its tokens' logprobs or
        # ids, whichever the request asked for.
        shown = logprobs is not None or ctx.prompt_token_ids is not None
        if not said and finish_reason is None and not shown:
            continue
        plain = finish_reason is None and delta.stop_reason is None and not shown
        if plain and not message.tool_calls and not message.reasoning:
            yield text_only.event(index, message.content or "")  # text alone: most chunks
            continue
        choice = ChatCompletionStreamChoice(
            index=index,
            delta=message,
            logprobs=logprobs,
            finish_reason=finish_reason,
            stop_reason=delta.stop_reason,
            token_ids=ctx.token_ids(delta),
        )
        yield chunk([choice])
    yield SSE_DONE


async def choice_deltas(
    streams: EngineStreams,
) -> AsyncIterator[tuple[int, ChoiceDelta | None, UsageCounter | None]]:
    """Each delta with its prompt index, then (-1, None, usage); raises `StreamError`."""
    usage = UsageCounter()
    async with contextlib.aclosing(streams.merged()) as merged:
        async for prompt_index, output in merged:
            if output.error is not None:
                # The client already has a 200 and some chunks: the error goes in-band.
                raise StreamError(output.error)
            usage.add(output)
            for delta in output.deltas:
                yield prompt_index, delta, None
    yield -1, None, usage


class StreamError(Exception):
    """A failure met after the client has its 200: it goes in-band, as an error event."""

    def __init__(self, failure: RequestFailure) -> None:
        super().__init__(failure.message)
        self.failure = failure


async def with_error_event(chunks: AsyncIterator[str]) -> AsyncIterator[str]:
    """Turn an engine failure raised mid-stream into an OpenAI error event and `[DONE]`."""
    try:
        async for text in chunks:
            yield text
    except StreamError as exc:
        yield sse({"error": failure_error(exc.failure)})
        yield SSE_DONE


def _info(usage: UsageCounter | None) -> UsageInfo:
    return (usage or UsageCounter()).info()


def _joined(first: CompletionLogprobs, then: CompletionLogprobs) -> CompletionLogprobs:
    joined = CompletionLogprobs()
    _extend(joined, first)
    _extend(joined, then)
    return joined


def _extend(target: CompletionLogprobs, part: CompletionLogprobs) -> None:
    target.tokens.extend(part.tokens)
    target.token_logprobs.extend(part.token_logprobs)
    target.top_logprobs.extend(part.top_logprobs)
    target.text_offset.extend(part.text_offset)
