"""Prompt validation and tokenization at the edge: bad input is refused before it is queued."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagedray.scheduler.sampling_params import SamplingParams


@dataclass(frozen=True)
class ValidatedPrompt:
    text: str | None
    token_ids: list[int]
    cache_salt: str | None = None  # per-tenant prefix-cache isolation


class PromptValidator:
    """Turns a user prompt into token ids and checks it against the model's limits."""

    def __init__(
        self, tokenizer: Any, max_model_len: int, vocab_size: int, max_num_seqs: int
    ) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.max_num_seqs = max_num_seqs

    def validate(self, prompt: Any, params: SamplingParams) -> ValidatedPrompt:
        """Tokenize and check a prompt; raises ValueError naming the bad field."""
        if not isinstance(params, SamplingParams):
            raise ValueError(
                f"sampling_params: expected SamplingParams, got {type(params).__name__}"
            )
        if params.logit_bias:
            outside = [t for t in params.logit_bias if t >= self.vocab_size]
            if outside:
                raise ValueError(
                    f"logit_bias: token id {outside[0]} is outside the vocabulary "
                    f"[0, {self.vocab_size})"
                )
        if params.n > self.max_num_seqs:
            # Its n sequences could never run together.
            raise ValueError(f"n: must be at most max_num_seqs={self.max_num_seqs}, got {params.n}")
        text: str | None = None
        cache_salt = None
        if isinstance(prompt, str):
            text = prompt
            token_ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            token_ids = list(prompt["prompt_token_ids"])
            text = prompt.get("prompt")
            cache_salt = prompt.get("cache_salt")
            if cache_salt is not None and not isinstance(cache_salt, str):
                raise ValueError("cache_salt: must be a string")
        else:
            raise ValueError(
                "prompt: must be a string or {'prompt_token_ids': [...]}, "
                f"got {type(prompt).__name__}"
            )
        self.check_token_ids(token_ids)
        return ValidatedPrompt(text, token_ids, cache_salt)

    def check_token_ids(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise ValueError("prompt: must contain at least one token")
        if len(token_ids) > self.max_model_len:
            raise ValueError(
                f"prompt: {len(token_ids)} tokens exceed max_model_len={self.max_model_len}"
            )
        bad = [t for t in token_ids if not isinstance(t, int) or not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(
                f"prompt_token_ids: {bad[0]!r} is outside the vocabulary [0, {self.vocab_size})"
            )

    def chat_prompt_token_ids(self, messages: list[dict[str, Any]]) -> list[int]:
        """Render a conversation with the tokenizer's chat template and tokenize it."""
        if not isinstance(messages, list) or not all(
            isinstance(m, dict) and "role" in m and "content" in m for m in messages
        ):
            raise ValueError("messages: must be a list of {'role': ..., 'content': ...} objects")
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise ValueError("messages: this model's tokenizer has no chat template")
        text = self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
        return self.tokenizer.encode(text, add_special_tokens=False)
