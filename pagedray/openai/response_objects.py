"""Response objects of the Responses API, whole (`build_response`) or as the stream of events
that builds one (`ResponseEventStream`), shaped as the `openai` SDK parses them.

Both are built from a chat generation's result: text, tool calls in chat format, a finish
reason and chat usage.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from pagedray.openai.protocol import chat_tool_call
from pagedray.openai.serving import LINE_BREAKS_IN_JSON

if TYPE_CHECKING:  # only a type here; responses_api re-exports this module's API
    from pagedray.openai.responses_api import ResponsesRequest


# ---- whole responses ---------------------------------------------------------------------------


def new_response_id() -> str:
    """`resp_` and 48 hex digits, as OpenAI's ids look."""
    return "resp_" + secrets.token_hex(24)


def new_item_id(prefix: Literal["msg", "fc", "rs"]) -> str:
    """An output item id: `msg_…` for a message, `fc_…` for a function call, `rs_…` for the
    model's reasoning."""
    return f"{prefix}_{secrets.token_hex(24)}"


def new_call_id() -> str:
    """A function call's `call_id`, for a call the engine gave no id."""
    return "call_" + secrets.token_hex(12)


def response_status(finish_reason: str | None) -> str:
    """The status a finish reason gives: "incomplete" at the token limit, else "completed"."""
    return "incomplete" if finish_reason == "length" else "completed"


def message_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    """An assistant message output item: one `output_text` part, none when `text` is None."""
    content = [] if text is None else [output_text_part(text)]
    return {
        "type": "message",
        "id": item_id,
        "status": status,
        "role": "assistant",
        "content": content,
    }


def reasoning_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    """The model's thinking (`--reasoning-parser`), as OpenAI's open-weight models and vLLM give
    it: a `reasoning` item with one `reasoning_text` part (none while it is only added)."""
    content = [] if text is None else [reasoning_text_part(text)]
    return {"type": "reasoning", "id": item_id, "summary": [], "content": content, "status": status}


def reasoning_text_part(text: str) -> dict[str, Any]:
    """A reasoning item's text content part."""
    return {"type": "reasoning_text", "text": text}


def output_text_part(text: str) -> dict[str, Any]:
    """A message's text content part."""
    return {"type": "output_text", "text": text, "annotations": []}


def function_call_item(
    item_id: str, call_id: str, name: str, arguments: str, status: str
) -> dict[str, Any]:
    """A function call output item."""
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def response_usage(usage: dict) -> dict[str, Any]:
    """Responses' usage from a chat usage dict."""
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    input_tokens = usage.get("prompt_tokens", 0)
    output_tokens = usage.get("completion_tokens", 0)
    reasoning = (usage.get("completion_tokens_details") or {}).get("reasoning_tokens") or 0
    return {
        "input_tokens": input_tokens,
        "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": reasoning},
        "total_tokens": usage.get("total_tokens", input_tokens + output_tokens),
    }


def build_response(
    *,
    response_id: str,
    request: ResponsesRequest,
    model: str,
    created_at: int,
    text: str | None,
    tool_calls: list[dict],
    finish_reason: str | None,
    usage: dict,
    status: str | None = None,
    reasoning: str | None = None,
) -> dict:
    """The whole Response for a finished generation (`tool_calls` in chat format), its
    reasoning first."""
    status = status or response_status(finish_reason)
    output: list[dict[str, Any]] = []
    if reasoning:
        output.append(reasoning_item(new_item_id("rs"), reasoning, "completed"))
    if text:
        output.append(message_item(new_item_id("msg"), text, "completed"))
    for call in tool_calls:
        function = call["function"]
        call_id = call.get("id") or new_call_id()
        output.append(
            function_call_item(
                new_item_id("fc"), call_id, function["name"], function["arguments"], "completed"
            )
        )
    if status == "incomplete" and output:
        output[-1]["status"] = "incomplete"  # the item the token limit cut short
    return response_object(
        response_id=response_id,
        request=request,
        model=model,
        created_at=created_at,
        status=status,
        output=output,
        usage=response_usage(usage),
    )


def response_reply(response: dict) -> tuple[str | None, list[dict]]:
    """A Response's text and function calls (chat format, with the call ids it shows): what
    `conversation_after` stores, so a follow-up's `function_call_output` finds its call."""
    texts = [
        part["text"]
        for item in response["output"]
        if item["type"] == "message"
        for part in item["content"]
        if part["type"] == "output_text"
    ]
    calls = [
        chat_tool_call(item["call_id"], item["name"], item["arguments"])
        for item in response["output"]
        if item["type"] == "function_call"
    ]
    return ("".join(texts) if texts else None), calls


def response_object(
    *,
    response_id: str,
    request: ResponsesRequest,
    model: str,
    created_at: int,
    status: str,
    output: list[dict[str, Any]],
    usage: dict[str, Any] | None,
) -> dict[str, Any]:
    """A Response in any state, echoing the request's settings as OpenAI does."""
    incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
    text = request.text.model_dump(by_alias=True, exclude_none=True) if request.text else None
    tool_choice = request.tool_choice or "auto"
    return {
        "id": response_id,
        "object": "response",
        "created_at": created_at,
        "status": status,
        "background": False,
        "error": None,
        "incomplete_details": incomplete,
        "instructions": request.instructions,
        "max_output_tokens": request.max_output_tokens,
        "metadata": dict(request.metadata or {}),
        "model": model,
        "output": output,
        "parallel_tool_calls": request.parallel_tool_calls is not False,
        "previous_response_id": request.previous_response_id,
        "reasoning": request.reasoning,
        "store": request.store,
        # The sampler's neutral defaults when neither the request nor the model gives one (the
        # route fills in the model's, engine/sampling_defaults.py).
        "temperature": 1.0 if request.temperature is None else request.temperature,
        "text": text or {"format": {"type": "text"}},
        "tool_choice": tool_choice if isinstance(tool_choice, str) else tool_choice.model_dump(),
        "tools": [tool.model_dump() for tool in request.tools or []],
        "top_p": 1.0 if request.top_p is None else request.top_p,
        "truncation": "disabled",
        "usage": usage,
        "user": request.user,
    }


# ---- streamed responses ------------------------------------------------------------------------


def sse_event(event: dict) -> str:
    """One event framed as OpenAI streams Responses: `event: <type>` then one `data:` line."""
    data = json.dumps(event, ensure_ascii=False).translate(LINE_BREAKS_IN_JSON)
    return f"event: {event['type']}\ndata: {data}\n\n"


def error_event(message: str, code: str | None, sequence_number: int = 0) -> dict:
    """An `error` event, for a failure after the stream has begun."""
    return {
        "type": "error",
        "sequence_number": sequence_number,
        "code": code,
        "message": message,
        "param": None,
    }


@dataclass
class _OutputItem:
    """One output item as it streams: a message's text, a function call's arguments, or the
    model's reasoning."""

    output_index: int
    item_id: str
    call_id: str | None  # None for a message or reasoning
    name: str = ""
    parts: list[str] = field(default_factory=list)  # text or argument fragments
    status: str = "in_progress"
    reasoning: bool = False

    def to_dict(self, with_content: bool = True) -> dict[str, Any]:
        text = "".join(self.parts)
        if self.reasoning:
            return reasoning_item(self.item_id, text if with_content else None, self.status)
        if self.call_id is None:
            return message_item(self.item_id, text if with_content else None, self.status)
        return function_call_item(self.item_id, self.call_id, self.name, text, self.status)


class ResponseEventStream:
    """The events of one streamed response, numbered from 0, fed by a chat generation's deltas.

    Call `start()`, then `reasoning()` / `text()` / `tool_call()` per delta, then `finish()`;
    each returns the events to send. The reasoning is open until the text or a call starts, a
    message until a tool call starts; calls stay open until `finish()`, as chat deltas of
    parallel calls may interleave.
    """

    def __init__(
        self,
        *,
        response_id: str,
        request: ResponsesRequest,
        model: str,
        created_at: int,
        status: str | None = None,
    ) -> None:
        self.response_id = response_id
        self.request = request
        self.model = model
        self.created_at = created_at
        self._status = status
        self._sequence_number = 0
        self._items: list[_OutputItem] = []
        self._message: _OutputItem | None = None  # the open message, if any
        self._reasoning: _OutputItem | None = None  # the open reasoning, if any
        self._calls: dict[int, _OutputItem] = {}  # by the chat delta's tool call index
        self._final: dict[str, Any] | None = None

    def start(self) -> list[dict]:
        """`response.created` and `response.in_progress`."""
        return [
            self._event("response.created", response=self._response("in_progress", None)),
            self._event("response.in_progress", response=self._response("in_progress", None)),
        ]

    def reasoning(self, delta: str) -> list[dict]:
        """A reasoning delta, opening a reasoning item first if none is open."""
        if not delta:
            return []
        events = []
        item = self._reasoning
        if item is None:
            item = self._reasoning = self._add_item(None, "", reasoning=True)
            events.append(self._item_event("response.output_item.added", item))
            events.append(self._part_event("response.content_part.added", item))
        item.parts.append(delta)
        events.append(
            self._event(
                "response.reasoning_text.delta", **self._where(item), content_index=0, delta=delta
            )
        )
        return events

    def text(self, delta: str) -> list[dict]:
        """A text delta, opening a message item first if none is open."""
        if not delta:
            return []
        events = self._end_reasoning()
        message = self._message
        if message is None:
            message = self._message = self._add_item(None, "")
            events.append(self._item_event("response.output_item.added", message))
            events.append(self._part_event("response.content_part.added", message))
        message.parts.append(delta)
        where = self._where(message)
        events.append(
            self._event(
                "response.output_text.delta", **where, content_index=0, delta=delta, logprobs=[]
            )
        )
        return events

    def tool_call(
        self, index: int, call_id: str | None, name: str | None, arguments: str
    ) -> list[dict]:
        """A chat tool-call delta; a new `index` closes an open message and adds a call item."""
        events = self._end_reasoning()
        call = self._calls.get(index)
        if call is None:
            if self._message is not None:
                self._message.status = "completed"
                events += self._close(self._message)
            call = self._calls[index] = self._add_item(call_id or new_call_id(), name or "")
            events.append(self._item_event("response.output_item.added", call))
        elif name and not call.name:
            call.name = name
        if arguments:
            call.parts.append(arguments)
            where = self._where(call)
            events.append(
                self._event("response.function_call_arguments.delta", **where, delta=arguments)
            )
        return events

    def finish(self, finish_reason: str | None, usage: dict) -> list[dict]:
        """Close every open item and end with `response.completed` (or `response.incomplete`)."""
        status = self._status or response_status(finish_reason)
        # In output order; the last item of all is always among them.
        open_items = [item for item in self._items if item.status == "in_progress"]
        for item in open_items:
            item.status = "completed"
        if status == "incomplete" and self._items:
            self._items[-1].status = "incomplete"  # the item the token limit cut short
        events = [event for item in open_items for event in self._close(item)]
        self._final = self._response(status, response_usage(usage))
        kind = "response.incomplete" if status == "incomplete" else "response.completed"
        events.append(self._event(kind, response=self._final))
        return events

    def error(self, message: str, code: str | None) -> list[dict]:
        """An `error` event, numbered in this stream, for an engine failure mid-stream."""
        event = error_event(message, code, self._sequence_number)
        self._sequence_number += 1
        return [event]

    def final_response(self) -> dict:
        """The response `finish()` ended with (to store)."""
        if self._final is None:
            raise RuntimeError("final_response: the stream has not finished")
        return self._final

    def _end_reasoning(self) -> list[dict]:
        """The open reasoning's end, once the answer starts."""
        if self._reasoning is None:
            return []
        self._reasoning.status = "completed"
        return self._close(self._reasoning)

    def _close(self, item: _OutputItem) -> list[dict]:
        """The events that end `item`, whose final status is already set."""
        where = self._where(item)
        text = "".join(item.parts)
        if item.reasoning:
            self._reasoning = None
            done = self._event("response.reasoning_text.done", **where, content_index=0, text=text)
            part_done = self._part_event("response.content_part.done", item)
            return [done, part_done, self._item_event("response.output_item.done", item)]
        if item.call_id is None:
            self._message = None
            done = self._event(
                "response.output_text.done", **where, content_index=0, text=text, logprobs=[]
            )
            part_done = self._part_event("response.content_part.done", item)
            return [done, part_done, self._item_event("response.output_item.done", item)]
        done = self._event(
            "response.function_call_arguments.done", **where, name=item.name, arguments=text
        )
        return [done, self._item_event("response.output_item.done", item)]

    def _add_item(self, call_id: str | None, name: str, reasoning: bool = False) -> _OutputItem:
        prefix: Literal["msg", "fc", "rs"] = "rs" if reasoning else "fc" if call_id else "msg"
        item = _OutputItem(
            len(self._items), new_item_id(prefix), call_id, name, reasoning=reasoning
        )
        self._items.append(item)
        return item

    def _event(self, event_type: str, **fields: Any) -> dict:
        event = {"type": event_type, "sequence_number": self._sequence_number, **fields}
        self._sequence_number += 1
        return event

    def _where(self, item: _OutputItem) -> dict[str, Any]:
        return {"item_id": item.item_id, "output_index": item.output_index}

    def _item_event(self, event_type: str, item: _OutputItem) -> dict:
        # An added message has no content yet: its part is added by its own event.
        item_dict = item.to_dict(with_content=event_type != "response.output_item.added")
        return self._event(event_type, output_index=item.output_index, item=item_dict)

    def _part_event(self, event_type: str, item: _OutputItem) -> dict:
        """A content part's event: a message's text part, or a reasoning item's."""
        text = "".join(item.parts)
        part = reasoning_text_part(text) if item.reasoning else output_text_part(text)
        return self._event(event_type, **self._where(item), content_index=0, part=part)

    def _response(self, status: str, usage: dict[str, Any] | None) -> dict[str, Any]:
        output = [] if status == "in_progress" else [item.to_dict() for item in self._items]
        return response_object(
            response_id=self.response_id,
            request=self.request,
            model=self.model,
            created_at=self.created_at,
            status=status,
            output=output,
            usage=usage,
        )
