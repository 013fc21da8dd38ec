"""How a generation route writes its answer: a whole one as JSON (or the failure met before any
output, as its error), a stream as server-sent events ending in an error event if it fails."""

from __future__ import annotations

from typing import Any

from fastapi.responses import Response, StreamingResponse

from pagedray.openai.answers import with_error_event
from pagedray.openai.serving import engine_error_response
from pagedray.scheduler.request_failure import RequestFailure


def json_answer(payload: Any) -> Response:
    if isinstance(payload, RequestFailure):  # met before any output
        return engine_error_response(payload)
    return Response(payload.model_dump_json(), media_type="application/json")


def event_stream(chunks: Any) -> StreamingResponse:
    return StreamingResponse(with_error_event(chunks), media_type="text/event-stream")
