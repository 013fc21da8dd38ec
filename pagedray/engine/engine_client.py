"""The one interface the OpenAI server is written against (vLLM V1's `EngineClient`): submit a
`GenerateRequest` and read its outputs, and ask whether the engines serve, how they are and
what they allow. Two implementations: `LocalEngineClient` over an in-process `AsyncEngine`
(engine/local_engine_client.py), and the Serve one over the engine deployment's handle
(cluster/serve_engine_client.py), which adds routing, output channels and broadcasts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, AsyncGenerator, Literal, Protocol

from pagedray.engine.wire import GenerateRequest, RequestStepOutput
from pagedray.scheduler.request_failure import RequestFailure

# What /health answers while the engines serve: "degraded" when one is saturated.
Health = Literal["ok", "degraded"]


@dataclass(frozen=True)
class EngineLimits:
    """What a request may ask of the engines: the longest context (the KV pool may cap it below
    the model's) and the most requests one queues (None: unbounded)."""

    max_model_len: int
    max_num_waiting: int | None = None


class EngineClient(Protocol):
    """The engines as the OpenAI server sees them."""

    def generate(self, request: GenerateRequest) -> AsyncGenerator[RequestStepOutput, None]:
        """The request's outputs. The first says the engine took it: an empty output (its
        acceptance), the first with tokens, or, for a request that wants one message
        (`stream_interval` None), its whole answer; or it carries the refusal (`error`). The last
        is finished or carries the failure that ended it. A failure is an output, never an
        exception: a broken call is a `DEAD` failure. Closing the iterator before the end aborts
        the request."""
        ...

    async def not_ready(self, request_id: str) -> RequestFailure | None:
        """None once every engine can serve; until then, why not."""
        ...

    async def health(self, request_id: str) -> Health | RequestFailure: ...

    async def stats(self, request_id: str) -> list[dict[str, Any]] | RequestFailure:
        """Each engine's scheduler statistics (KV blocks, queue lengths, steps)."""
        ...

    async def limits(self) -> EngineLimits: ...
