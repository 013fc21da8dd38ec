"""Per-step results of the engine core, and the user-facing outputs built from them."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedray.scheduler.messages import RequestError, TokenLogprobs


@dataclass
class EngineCoreOutput:
    """New tokens of one sequence in one step; `req_id` is the client's request (the parent)."""

    req_id: str
    choice_index: int  # which of the request's n outputs
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] | None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    # With prompt_logprobs: per prompt position (None at 0), on a sequence's first output only.
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    # With finish_reason "error": why the request failed; it ends every choice of the request.
    error: RequestError | None = None


@dataclass
class CompletionOutput:
    """One of a request's n generated sequences."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    logprobs: list[dict[int, float]] | None = (
        None  # per token: token id -> logprob (sampled + top-k)
    )
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it


@dataclass
class RequestOutput:
    """A request's prompt and outputs (cumulative), as returned by `LLM.generate`."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0
    metrics: dict[str, float] = field(default_factory=dict)  # arrival, first token, finish (s)
    # With prompt_logprobs: per prompt token, token id -> logprob (the token's own and the
    # top-k); None for the first token, which nothing precedes.
    prompt_logprobs: list[dict[int, float] | None] | None = None
    error: str | None = None  # why the request failed (its outputs' finish_reason is "error")
