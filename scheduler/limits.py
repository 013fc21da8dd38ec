"""What a request may ask of an engine: checked before it is accepted, so a request that could
never be scheduled is a 400 at once rather than a failure once queued."""

from __future__ import annotations


def check_request_limits(
    max_num_seqs: int,
    max_model_len: int,
    num_prompt_tokens: int,
    n: int,
    max_tokens: int | None = None,
) -> None:
    """Raises ValueError if a request of this size could never be scheduled.

    `max_tokens` is checked only when given: the serving path refuses one that does not fit
    beside the prompt (as vLLM does), while offline such a request stops at max_model_len.
    """
    if n > max_num_seqs:
        raise ValueError(f"n: must be at most max_num_seqs={max_num_seqs}, got {n}")
    if num_prompt_tokens > max_model_len:
        raise ValueError(f"prompt: {num_prompt_tokens} tokens exceed max_model_len={max_model_len}")
    if max_tokens is not None and num_prompt_tokens + max_tokens > max_model_len:
        raise ValueError(
            f"max_tokens: {max_tokens} does not fit beside {num_prompt_tokens} prompt tokens "
            f"in max_model_len={max_model_len} ({max_tokens} > {max_model_len} - "
            f"{num_prompt_tokens})"
        )
