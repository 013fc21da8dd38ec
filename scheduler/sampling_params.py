"""Per-request sampling parameters, validated once at the edge so the engine never sees bad values.

Mirrors vLLM's `SamplingParams` field names so users can switch without edits.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

# Temperatures below this are treated as greedy (argmax), as vLLM does.
GREEDY_TEMPERATURE = 1e-5
MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 100.0  # OpenAI's limit on |bias|


@dataclass
class SamplingParams:
    """How to pick each next token and when to stop.

    Validation happens in `__post_init__`; a bad field raises `ValueError` naming the field and
    its limit, before anything is queued or allocated.
    """

    n: int = 1  # parallel samples of one prompt; they share the prompt's KV blocks (copy-on-write)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: all tokens
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs to return besides the sampled token's
    # Logprob of each prompt token given the ones before it, with this many top alternatives
    # (vLLM's prompt_logprobs; OpenAI's echo with logprobs). Such a request computes its whole
    # prompt: a prefix-cache hit has no logits.
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    skip_special_tokens: bool = True
    # token id -> added to its logit before any other processing (OpenAI's logit_bias); -100
    # bans a token, +100 all but forces it.
    logit_bias: dict[int, float] | None = None

    def __post_init__(self) -> None:
        self.stop = _normalize_stop(self.stop)
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        if self.top_k == -1:
            self.top_k = 0
        self._validate()

    def _validate(self) -> None:
        _check(isinstance(self.n, int) and self.n >= 1, "n", f"must be at least 1, got {self.n}")
        _check(self.temperature >= 0.0, "temperature", f"must be >= 0, got {self.temperature}")
        _check(0.0 < self.top_p <= 1.0, "top_p", f"must be in (0, 1], got {self.top_p}")
        _check(self.top_k >= 0, "top_k", f"must be -1 (disabled) or >= 0, got {self.top_k}")
        _check(0.0 <= self.min_p <= 1.0, "min_p", f"must be in [0, 1], got {self.min_p}")
        if self.max_tokens is not None:
            _check(self.max_tokens >= 1, "max_tokens", f"must be at least 1, got {self.max_tokens}")
        _check(self.min_tokens >= 0, "min_tokens", f"must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None:
            _check(
                self.min_tokens <= self.max_tokens,
                "min_tokens",
                f"must be <= max_tokens={self.max_tokens}, got {self.min_tokens}",
            )
        _check(
            -2.0 <= self.presence_penalty <= 2.0,
            "presence_penalty",
            f"must be in [-2, 2], got {self.presence_penalty}",
        )
        _check(
            -2.0 <= self.frequency_penalty <= 2.0,
            "frequency_penalty",
            f"must be in [-2, 2], got {self.frequency_penalty}",
        )
        _check(
            self.repetition_penalty > 0.0,
            "repetition_penalty",
            f"must be > 0, got {self.repetition_penalty}",
        )
        if self.logprobs is not None:
            _check(
                0 <= self.logprobs <= MAX_LOGPROBS,
                "logprobs",
                f"must be in [0, {MAX_LOGPROBS}], got {self.logprobs}",
            )
        if self.prompt_logprobs is not None:
            _check(
                isinstance(self.prompt_logprobs, int) and 0 <= self.prompt_logprobs <= MAX_LOGPROBS,
                "prompt_logprobs",
                f"must be in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs}",
            )
        _check(
            all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
            "stop_token_ids",
            "must be a list of non-negative integers",
        )
        if self.seed is not None:
            _check(isinstance(self.seed, int), "seed", f"must be an integer, got {self.seed!r}")
        if self.logit_bias is not None:
            _check(
                isinstance(self.logit_bias, dict)
                and all(isinstance(t, int) and t >= 0 for t in self.logit_bias),
                "logit_bias",
                "must map non-negative integer token ids to biases",
            )
            _check(
                all(
                    isinstance(b, (int, float)) and -MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS
                    for b in self.logit_bias.values()
                ),
                "logit_bias",
                f"biases must be numbers in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]",
            )

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    def clone(self, **changes: Any) -> SamplingParams:
        return dataclasses.replace(self, **changes)


def _normalize_stop(stop: Any) -> list[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop] if stop else []
    if isinstance(stop, (list, tuple)) and all(isinstance(s, str) for s in stop):
        return [s for s in stop if s]
    raise ValueError(f"stop: must be a string or a list of strings, got {type(stop).__name__}")


def _check(ok: bool, field_name: str, message: str) -> None:
    if not ok:
        raise ValueError(f"{field_name}: {message}")
