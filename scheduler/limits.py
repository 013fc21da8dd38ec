"""What a request may ask of an engine, in one place: the ingress checks a request with these
before it is sent (a fast 400), and the scheduler again before it accepts it (the authority,
which knows the engine's real limits). A request that could never be scheduled is refused at
once rather than failing once queued; the wording of the `max_tokens` refusal is vLLM's, which
clients (lm-eval, guidellm) match.
"""

from __future__ import annotations

from pagedray.scheduler.request_failure import FailureKind, RequestRefused


def check_n(max_num_seqs: int, n: int) -> None:
    """Its n sequences must be able to run together."""
    if n > max_num_seqs:
        raise RequestRefused(f"n: must be at most max_num_seqs={max_num_seqs}, got {n}", "n")


def check_prompt_length(max_model_len: int, num_prompt_tokens: int) -> None:
    if num_prompt_tokens > max_model_len:
        raise RequestRefused(
            f"prompt: {num_prompt_tokens} tokens exceed max_model_len={max_model_len}",
            "prompt",
            FailureKind.TOO_LONG,
        )


def check_max_tokens(
    max_model_len: int, num_prompt_tokens: int, max_tokens: int | None, field: str = "max_tokens"
) -> None:
    """A `max_tokens` that cannot fit beside the prompt, as vLLM refuses it; None means "up to
    max_model_len". `field` is the name the client sent it under."""
    if max_tokens is None or num_prompt_tokens + max_tokens <= max_model_len:
        return
    raise RequestRefused(
        f"'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. This model's "
        f"maximum context length is {max_model_len} tokens and your request has "
        f"{num_prompt_tokens} input tokens ({max_tokens} > {max_model_len} - "
        f"{num_prompt_tokens}).",
        field,
        FailureKind.TOO_LONG,
    )


def check_request_limits(
    max_num_seqs: int,
    max_model_len: int,
    num_prompt_tokens: int,
    n: int,
    max_tokens: int | None = None,
) -> None:
    """Raises `RequestRefused` if a request of this size could never be scheduled.

    `max_tokens` is checked only when given: the serving path refuses one that does not fit
    beside the prompt (as vLLM does), while offline such a request stops at max_model_len.
    """
    check_n(max_num_seqs, n)
    check_prompt_length(max_model_len, num_prompt_tokens)
    check_max_tokens(max_model_len, num_prompt_tokens, max_tokens)
