"""The Responses API's answers, built on a chat generation: the whole Response, or its stream of
events, and the record a follow-up (`previous_response_id`) continues from.

The ingress turns a Responses request into a chat request (`responses_api.to_chat_body`) and
submits it like any chat; what comes back is shaped here, so tool calls, structured outputs and
usage behave exactly as in chat completions.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable

from starlette.responses import Response

from pagedray.openai.answers import (
    AnswerContext,
    ChoiceParts,
    StreamError,
    chat_response,
    choice_deltas,
    count_thinking,
)
from pagedray.openai.engine_streams import EngineStreams
from pagedray.openai.response_objects import (
    ResponseEventStream,
    build_response,
    response_reply,
    sse_event,
)
from pagedray.openai.responses_api import ResponsesRequest, conversation_after
from pagedray.openai.serving import UsageCounter, failure_status, renamed_fields
from pagedray.scheduler.request_failure import RequestFailure

# Called with (response, record) once a response is complete and `store` is set.
Save = Callable[[dict[str, Any], dict[str, Any]], Awaitable[None]]


@dataclass
class ResponseJob:
    """One Responses request on its way through the chat path."""

    response_id: str
    request: ResponsesRequest
    chat_body: dict[str, Any]  # what `to_chat_body` made of the request
    model: str
    created_at: int = field(default_factory=lambda: int(time.time()))

    def record(self, response: dict[str, Any]) -> dict[str, Any]:
        """What the store keeps: the response, and the conversation to continue from."""
        text, tool_calls = response_reply(response)
        return {
            "response": response,
            "conversation": conversation_after(self.chat_body, text, tool_calls),
        }


async def whole_response(
    job: ResponseJob, ctx: AnswerContext, streams: EngineStreams, save: Save | None
) -> dict[str, Any] | RequestFailure:
    """The finished Response, or the request's failure."""
    result = await chat_response(ctx, streams)
    if isinstance(result, RequestFailure):
        return result
    choice = result.choices[0]
    calls = [call.model_dump() for call in choice.message.tool_calls or []]
    response = build_response(
        response_id=job.response_id,
        request=job.request,
        model=job.model,
        created_at=job.created_at,
        text=choice.message.content,
        tool_calls=calls,
        finish_reason=choice.finish_reason,
        usage=result.usage.model_dump(),
        reasoning=choice.message.reasoning,
    )
    if save is not None:
        await save(response, job.record(response))
    return response


async def response_events(
    job: ResponseJob, ctx: AnswerContext, streams: EngineStreams, save: Save | None
) -> AsyncIterator[str]:
    """The Response's events as SSE, from `response.created` to `response.completed`; an engine
    failure mid-stream becomes an `error` event."""
    events = ResponseEventStream(
        response_id=job.response_id, request=job.request, model=job.model, created_at=job.created_at
    )
    for event in events.start():
        yield sse_event(event)
    parts = ChoiceParts.of(ctx)  # the thinking (--reasoning-parser) becomes a reasoning item
    finish_reason: str | None = None
    try:
        async for _, delta, usage in choice_deltas(streams):
            if delta is None:
                final_events = events.finish(finish_reason, _usage(usage, parts))
                if save is not None:  # before the client hears it is complete, and may follow up
                    response = events.final_response()
                    await save(response, job.record(response))
                for event in final_events:
                    yield sse_event(event)
                return
            finished = delta.finish_reason is not None
            reasoning, content, calls = parts.feed(delta.text, finished, delta.token_ids)
            if finished:
                finish_reason = parts.finish_reason(delta.finish_reason)
            for event in events.reasoning(reasoning or ""):
                yield sse_event(event)
            for event in events.text(content or ""):
                yield sse_event(event)
            for call in calls or []:
                function = call.function
                name = function.name if function else None
                arguments = (function.arguments if function else None) or ""
                for event in events.tool_call(call.index, call.id, name, arguments):
                    yield sse_event(event)
    except StreamError as exc:
        for event in events.error(exc.failure.message, str(failure_status(exc.failure))):
            yield sse_event(event)


# A Responses request is checked as the chat request it becomes: its errors are told back in
# the names the client sent.
CHAT_TO_RESPONSES_FIELDS = {
    "max_tokens": "max_output_tokens",
    "max_completion_tokens": "max_output_tokens",
    "messages": "input",
    "response_format": "text",
    "reasoning_effort": "reasoning.effort",
}


def in_responses_terms(response: Response) -> Response:
    """A chat route's error response, naming the Responses API's fields instead."""
    return renamed_fields(response, CHAT_TO_RESPONSES_FIELDS)


def _usage(usage: UsageCounter | None, parts: ChoiceParts) -> dict[str, Any]:
    return count_thinking(usage, [parts.thought]).info().model_dump()
