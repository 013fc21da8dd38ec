"""Per-request sampling parameters, validated once at the edge so the engine never sees bad values.

Mirrors vLLM's `SamplingParams` field names so users can switch without edits.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from pagedray.scheduler.request_failure import refusal
from pagedray.scheduler.structured_outputs import StructuredOutputsParams

# Temperatures below this are treated as greedy (argmax), as vLLM does.
GREEDY_TEMPERATURE = 1e-5
MAX_LOGPROBS = 20  # vLLM's default max_logprobs: the server's cap unless --max-logprobs sets one
MAX_LOGIT_BIAS = 100.0  # OpenAI's limit on |bias|
# Bounds that keep every value representable where the sampler puts it (int32/int64 tensors,
# float32 logits): a value past them could only fail inside a step, so it is refused here.
MAX_INT32 = 2**31 - 1
MAX_N = 1024
MAX_BAD_WORDS = (
    128  # vLLM's VLLM_MAX_NUM_BAD_WORDS (it counts them tokenized; so does the validator)
)
# A client's vocabulary allowlist, bounded as a body is: the largest vocabularies (about 256k).
MAX_ALLOWED_TOKEN_IDS = 2**18
# Dividing a logit by a tiny penalty overflows float32 to inf (then NaN probabilities); HF and
# vLLM only ask for > 0, these bounds are far past any useful setting.
MIN_REPETITION_PENALTY = 0.01
MAX_REPETITION_PENALTY = 100.0
_FLOAT_FIELDS = (
    "temperature",
    "top_p",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
)


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
    # Only these tokens may be sampled (vLLM's allowed_token_ids).
    allowed_token_ids: list[int] | None = None
    # Words the output must not contain (vLLM's bad_words): a word's last token is banned where
    # the output so far ends with the rest of it, the word's tokens both as a word's start and
    # mid-text. `bad_words_token_ids` is that tokenization, made by the PromptValidator (it
    # holds the tokenizer); the sampler reads it.
    bad_words: list[str] = field(default_factory=list)
    bad_words_token_ids: list[list[int]] | None = None
    # A reasoning model's thinking tokens at most (vLLM's thinking_token_budget): then the
    # token that ends the thinking is forced. None (or -1): no limit.
    thinking_token_budget: int | None = None
    # The output must match a JSON schema, regex, choice or grammar (vLLM's structured outputs);
    # a dict of its fields is accepted too.
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams.from_fields(self.structured_outputs)
        self.stop = _normalize_stop(self.stop)
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        elif isinstance(self.stop_token_ids, tuple):
            self.stop_token_ids = list(self.stop_token_ids)
        if self.top_k == -1:
            self.top_k = 0
        if self.bad_words is None:
            self.bad_words = []
        if self.thinking_token_budget == -1:
            self.thinking_token_budget = None
        self._validate()

    def _validate(self) -> None:
        # Types first: everything after compares numbers, and a bool is not a count.
        for name in ("n", "top_k", "min_tokens"):
            _check_int(name, getattr(self, name))
        for name in ("max_tokens", "logprobs", "prompt_logprobs", "seed", "thinking_token_budget"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name))
        for name in _FLOAT_FIELDS:
            _check_float(name, getattr(self, name))
        for name in ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens"):
            _check(isinstance(getattr(self, name), bool), name, "must be true or false")
        _check(1 <= self.n <= MAX_N, "n", f"must be in [1, {MAX_N}], got {self.n}")
        _check(self.temperature >= 0.0, "temperature", f"must be >= 0, got {self.temperature}")
        _check(0.0 < self.top_p <= 1.0, "top_p", f"must be in (0, 1], got {self.top_p}")
        _check(
            0 <= self.top_k <= MAX_INT32,
            "top_k",
            f"must be -1 (disabled) or in [0, {MAX_INT32}], got {self.top_k}",
        )
        _check(0.0 <= self.min_p <= 1.0, "min_p", f"must be in [0, 1], got {self.min_p}")
        if self.max_tokens is not None:
            _check(
                1 <= self.max_tokens <= MAX_INT32,
                "max_tokens",
                f"must be in [1, {MAX_INT32}], got {self.max_tokens}",
            )
        _check(
            0 <= self.min_tokens <= MAX_INT32,
            "min_tokens",
            f"must be in [0, {MAX_INT32}], got {self.min_tokens}",
        )
        if self.max_tokens is not None:
            _check(
                self.min_tokens <= self.max_tokens,
                "min_tokens",
                f"must be <= max_tokens={self.max_tokens}, got {self.min_tokens}",
            )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(-2.0 <= value <= 2.0, name, f"must be in [-2, 2], got {value}")
        _check(
            MIN_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY,
            "repetition_penalty",
            f"must be in [{MIN_REPETITION_PENALTY:g}, {MAX_REPETITION_PENALTY:g}], "
            f"got {self.repetition_penalty}",
        )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                # NOTE: the cap is the server's (`max_logprobs`, PromptValidator.check_logprobs).
                _check(value >= 0, name, f"must be at least 0, got {value}")
        if self.seed is not None:
            _check(
                -(2**63) <= self.seed < 2**64,
                "seed",
                f"must fit in 64 bits, got {self.seed}",
            )
        _check(
            isinstance(self.stop_token_ids, list)
            and all(_is_int(t) and 0 <= t <= MAX_INT32 for t in self.stop_token_ids),
            "stop_token_ids",
            f"must be a list of integers in [0, {MAX_INT32}]",
        )
        for stop in self.stop:
            _check(is_encodable(stop), "stop", "must be valid Unicode (no lone surrogates)")
        if self.thinking_token_budget is not None:
            _check(
                0 <= self.thinking_token_budget <= MAX_INT32,
                "thinking_token_budget",
                f"must be -1 (no limit) or in [0, {MAX_INT32}], got {self.thinking_token_budget}",
            )
        if self.allowed_token_ids is not None:
            _check(
                isinstance(self.allowed_token_ids, list)
                and 0 < len(self.allowed_token_ids) <= MAX_ALLOWED_TOKEN_IDS
                and all(_is_int(t) and 0 <= t <= MAX_INT32 for t in self.allowed_token_ids),
                "allowed_token_ids",
                f"must be 1 to {MAX_ALLOWED_TOKEN_IDS} integer token ids",
            )
        _check(
            isinstance(self.bad_words, list)
            and len(self.bad_words) <= MAX_BAD_WORDS
            and all(isinstance(w, str) and w and is_encodable(w) for w in self.bad_words),
            "bad_words",
            f"must be at most {MAX_BAD_WORDS} non-empty strings",
        )
        if self.bad_words_token_ids is not None:
            _check(
                isinstance(self.bad_words_token_ids, list)
                and all(
                    isinstance(word, list) and word and all(_is_int(t) and t >= 0 for t in word)
                    for word in self.bad_words_token_ids
                ),
                "bad_words",
                "token ids must be lists of token ids",
            )
        _check(
            self.structured_outputs is None
            or isinstance(self.structured_outputs, StructuredOutputsParams),
            "structured_outputs",
            "must be StructuredOutputsParams or a dict of its fields",
        )
        if self.logit_bias is not None:
            _check(
                isinstance(self.logit_bias, dict)
                and all(_is_int(t) and 0 <= t <= MAX_INT32 for t in self.logit_bias),
                "logit_bias",
                "must map non-negative integer token ids to biases",
            )
            _check(
                all(
                    _is_number(b) and -MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS
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


def is_encodable(text: str) -> bool:
    """True when `text` is valid Unicode (UTF-8 encodable): JSON's "\\ud800" decodes to a lone
    surrogate that tokenizers and hashes cannot take."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _normalize_stop(stop: Any) -> list[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop] if stop else []
    if isinstance(stop, (list, tuple)) and all(isinstance(s, str) for s in stop):
        return [s for s in stop if s]
    raise refusal("stop", f"must be a string or a list of strings, got {type(stop).__name__}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return (_is_int(value) or isinstance(value, float)) and math.isfinite(value)


def _check_int(field_name: str, value: Any) -> None:
    _check(_is_int(value), field_name, f"must be an integer, got {value!r}")


def _check_float(field_name: str, value: Any) -> None:
    # Ints are accepted (JSON's 1 for 1.0) but huge ones would overflow float arithmetic.
    ok = _is_number(value) and abs(value) <= 1e300
    _check(ok, field_name, f"must be a finite number, got {value!r}")


def _check(ok: bool, field_name: str, message: str) -> None:
    if not ok:
        raise refusal(field_name, f"{message}")
