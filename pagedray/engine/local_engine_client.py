"""`EngineClient` over an `AsyncEngine` in this process: the OpenAI server without Ray (HTTP
tests, `pagedray serve --no-ray`).
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, AsyncGenerator

from pagedray.engine.async_engine import AsyncEngine
from pagedray.engine.engine_client import EngineLimits, Health
from pagedray.engine.request_errors import RETRY_AFTER_S, failure_of
from pagedray.engine.wire import GenerateRequest, RequestStepOutput
from pagedray.scheduler.request_failure import FailureKind, RequestFailure

logger = logging.getLogger(__name__)


class LocalEngineClient:
    """One engine, stepped on this process's event loop and compute thread."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine

    async def generate(self, request: GenerateRequest) -> AsyncGenerator[RequestStepOutput, None]:
        request_id = request.request_id
        try:
            stream = self.engine.submit(request)
        except Exception as exc:  # noqa: BLE001 - refused: reported to the caller, not raised
            yield RequestStepOutput(request_id, error=failure_of(exc, request_id))
            return
        yield RequestStepOutput(request_id)  # accepted
        # NOTE: closing the stream (this generator closed, or cancelled) aborts the request.
        async with contextlib.aclosing(stream):
            try:
                async for output in stream:
                    yield output
            except Exception as exc:  # noqa: BLE001 - its failure, as an output
                yield RequestStepOutput(request_id, error=failure_of(exc, request_id))

    async def not_ready(self, request_id: str) -> RequestFailure | None:
        self.engine.start()
        health = self.engine.health()
        return None if health["healthy"] else self._unavailable(request_id, health["error"])

    async def health(self, request_id: str) -> Health | RequestFailure:
        self.engine.start()
        health = self.engine.health()
        if not health["healthy"]:
            return self._unavailable(request_id, health["error"])
        return "degraded" if health["degraded"] else "ok"

    async def stats(self, request_id: str) -> list[dict[str, Any]] | RequestFailure:
        return [self.engine.stats()]

    async def limits(self) -> EngineLimits:
        stats = self.engine.stats()
        return EngineLimits(stats["max_model_len"], stats["max_num_waiting"])

    def _unavailable(self, request_id: str, cause: str | None) -> RequestFailure:
        logger.warning("%s: engine unhealthy: %s", request_id, cause)
        message = f"engine unavailable (request {request_id})"
        return RequestFailure(FailureKind.DEAD, message, retry_after_s=RETRY_AFTER_S)
