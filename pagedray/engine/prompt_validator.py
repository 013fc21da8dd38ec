"""Prompt validation and tokenization at the edge: bad input is refused before it is queued.

Shared by the offline `LLM` and the HTTP ingress, so both refuse the same prompts with the same
`RequestRefused` naming the field.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import Any

from pagedray.engine.chat_tokens import ChatEnding, ChatTokenizer
from pagedray.engine.prompt_bound import chars_per_token
from pagedray.engine.unicode_text import has_lone_surrogate
from pagedray.scheduler.limits import check_max_tokens, check_n, check_prompt_length
from pagedray.scheduler.request_failure import refusal
from pagedray.scheduler.sampling_params import MAX_BAD_WORDS, MAX_LOGPROBS, SamplingParams


@dataclass(frozen=True)
class ValidatedPrompt:
    text: str | None
    token_ids: list[int]
    cache_salt: str | None = None  # per-tenant prefix-cache isolation


def as_prompt_list(prompts: Any) -> list[Any]:
    """One prompt or a sequence of them, as a list; raises ValueError naming `prompt`."""
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if isinstance(prompts, (list, tuple)):
        return list(prompts)
    raise refusal(
        "prompt",
        "must be a string, a {'prompt_token_ids': [...]} dict or a list of them, "
        f"got {type(prompts).__name__}",
    )


def check_text(field: str, text: Any) -> str:
    """A string that every tokenizer and hash can take (no lone surrogates)."""
    if not isinstance(text, str):
        raise refusal(field, f"must be a string, got {type(text).__name__}")
    if has_lone_surrogate(text):
        raise refusal(field, "contains a lone surrogate (invalid Unicode)")
    return text


def check_cache_salt(cache_salt: Any) -> str | None:
    if cache_salt is None:
        return None
    check_text("cache_salt", cache_salt)
    if not cache_salt:
        raise refusal("cache_salt", "must be a non-empty string")
    return cache_salt


class PromptValidator:
    """Turns a user prompt into token ids and checks it against the model's limits.

    `max_model_len` may be lowered after construction (the ingress learns the engine's real
    limit from the engine replicas).
    """

    def __init__(
        self,
        tokenizer: Any,
        max_model_len: int,
        vocab_size: int,
        max_num_seqs: int,
        sampling_defaults: dict[str, Any] | None = None,
        max_tokens_cap: int | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        max_logprobs: int = MAX_LOGPROBS,
    ) -> None:
        self.tokenizer = tokenizer
        # The model's defaults of the fields a request leaves unset, and the most tokens a
        # served request may generate (sampling_defaults.py).
        self.sampling_defaults = sampling_defaults or {}
        self.max_tokens_cap = max_tokens_cap
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.max_num_seqs = max_num_seqs
        self.chat = ChatTokenizer(tokenizer, chat_template_kwargs)
        self.max_logprobs = max_logprobs  # per token; -1: the whole vocabulary (vLLM's)
        self.chars_per_token = chars_per_token(tokenizer)
        # A request's own way to tokenize its prompts (`for_request`): cut to this many tokens,
        # ("left": its last; "right": its first); text prompts with the tokenizer's BOS or not.
        self.truncation: tuple[int, str] | None = None
        self.add_special_tokens = True

    def for_request(
        self,
        truncate_prompt_tokens: int | None = None,
        truncation_side: str | None = None,
        add_special_tokens: bool = True,
    ) -> PromptValidator:
        """This validator, tokenizing as a request asks, with vLLM's fields: a prompt cut to
        its last `truncate_prompt_tokens` tokens (`truncation_side` "right": its first) before
        it is checked, -1 keeping as many as `max_model_len` leaves room for one token of
        output; a text prompt's special tokens added or not."""
        if truncate_prompt_tokens is None and add_special_tokens:
            return self
        custom = copy.copy(self)
        if truncate_prompt_tokens is not None:
            if truncate_prompt_tokens > self.max_model_len:
                raise refusal(
                    "truncate_prompt_tokens",
                    f"{truncate_prompt_tokens} is over max_model_len={self.max_model_len}",
                )
            keep = (
                self.max_model_len - 1 if truncate_prompt_tokens == -1 else truncate_prompt_tokens
            )
            custom.truncation = (keep, truncation_side or "left")
        custom.add_special_tokens = add_special_tokens
        return custom

    def validate(self, prompt: Any, params: SamplingParams) -> ValidatedPrompt:
        """Tokenize and check a prompt; raises ValueError naming the bad field.

        `prompt` is a string, `{"prompt": str}` or `{"prompt_token_ids": [...]}` (vLLM's text and
        tokens prompts), each dict optionally with "cache_salt".
        """
        self.check_params(params)
        if isinstance(prompt, str):
            return self._validated(prompt, self.encode(prompt, self.add_special_tokens))
        if not isinstance(prompt, dict) or not ("prompt_token_ids" in prompt or "prompt" in prompt):
            raise refusal(
                "prompt",
                "must be a string, {'prompt': str} or {'prompt_token_ids': [...]}, "
                f"got {type(prompt).__name__}",
            )
        cache_salt = check_cache_salt(prompt.get("cache_salt"))
        text = prompt.get("prompt")
        if text is not None:
            check_text("prompt", text)
        if "prompt_token_ids" not in prompt:
            assert text is not None  # the dict holds "prompt" or "prompt_token_ids", checked above
            return self._validated(text, self.encode(text, self.add_special_tokens), cache_salt)
        token_ids = prompt["prompt_token_ids"]
        if not isinstance(token_ids, (list, tuple)):
            raise refusal(
                "prompt_token_ids", f"must be a list of token ids, got {type(token_ids).__name__}"
            )
        return self._validated(text, list(token_ids), cache_salt)

    def _validated(
        self, text: str | None, token_ids: list[int], cache_salt: str | None = None
    ) -> ValidatedPrompt:
        """The prompt, cut as the request asked (then without its text) and checked."""
        kept = self.truncated(token_ids)
        self.check_token_ids(kept)
        return ValidatedPrompt(text if kept is token_ids else None, kept, cache_salt)

    def truncated(self, token_ids: list[int]) -> list[int]:
        """`token_ids` cut as the request asked (the same list if nothing is cut)."""
        if self.truncation is None or self.truncation[0] >= len(token_ids):
            return token_ids
        keep, side = self.truncation
        return token_ids[len(token_ids) - keep :] if side == "left" else token_ids[:keep]

    def check_params(self, params: SamplingParams) -> None:
        if not isinstance(params, SamplingParams):
            raise refusal(
                "sampling_params", f"expected SamplingParams, got {type(params).__name__}"
            )
        for name, token_ids in (
            ("logit_bias", params.logit_bias or ()),
            ("allowed_token_ids", params.allowed_token_ids or ()),
        ):
            outside = [t for t in token_ids if not 0 <= t < self.vocab_size]
            if outside:
                raise refusal(
                    name, f"token id {outside[0]} is outside the vocabulary [0, {self.vocab_size})"
                )
        if params.bad_words and params.bad_words_token_ids is None:
            words = bad_words_token_ids(self.tokenizer, params.bad_words)
            if any(not 0 <= t < self.vocab_size for word in words for t in word):
                raise refusal(
                    "bad_words", f"tokenizes outside the vocabulary [0, {self.vocab_size})"
                )
            params.bad_words_token_ids = words
        check_n(self.max_num_seqs, params.n)
        for name in ("logprobs", "prompt_logprobs"):
            self.check_logprobs(name, getattr(params, name))

    def check_logprobs(self, field: str, value: int | None) -> None:
        """Refuse more logprobs a token than `max_logprobs` (`--max-logprobs`) allows."""
        if value is not None and 0 <= self.max_logprobs < value:
            raise refusal(
                field, f"{value} exceeds this server's max_logprobs of {self.max_logprobs}"
            )

    def encode(
        self, text: str, add_special_tokens: bool = True, field: str = "prompt"
    ) -> list[int]:
        """A text prompt's token ids, refused unread if it is too long to fit in any case."""
        check_text(field, text)
        if self.truncation is not None and self.chars_per_token is not None:
            # What is cut off is not tokenized: the kept side's longest spelling of
            # `max_model_len` tokens covers every token kept.
            limit = self.max_model_len * self.chars_per_token
            text = text[-limit:] if self.truncation[1] == "left" else text[:limit]
        self.check_length(field, text)
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def check_length(self, field: str, text: str) -> None:
        """Refuse a text longer than `max_model_len` tokens of the longest kind could spell
        (unless the request cuts it: that is done once it is tokenized)."""
        if self.chars_per_token is None or self.truncation is not None:
            return
        limit = self.max_model_len * self.chars_per_token
        if len(text) > limit:
            raise refusal(
                field,
                f"{len(text)} characters cannot fit in max_model_len="
                f"{self.max_model_len} tokens (at most {limit} characters)",
            )

    def check_token_ids(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise refusal("prompt", "must contain at least one token")
        check_prompt_length(self.max_model_len, len(token_ids))
        bad = [t for t in token_ids if not _is_token_id(t) or not 0 <= t < self.vocab_size]
        if bad:
            raise refusal(
                "prompt_token_ids", f"{bad[0]!r} is outside the vocabulary [0, {self.vocab_size})"
            )

    def limit_output(
        self, params: SamplingParams, num_prompt_tokens: int, field: str = "max_tokens"
    ) -> SamplingParams:
        """The parameters a served prompt runs with, as vLLM's server limits its output.

        A `max_tokens` the client set must fit beside the prompt, or is refused (vLLM's 400,
        scheduler/limits.py); one it left unset (None) takes the model's default
        (generation_config's `max_new_tokens`); either is held to `max_tokens_cap`. A default
        or a cap past the room left in the context is that room (None: up to max_model_len),
        as vLLM clamps them. Only the HTTP ingress calls this: the offline `LLM` stops a
        request at max_model_len.
        """
        check_max_tokens(self.max_model_len, num_prompt_tokens, params.max_tokens, field)
        wanted = params.max_tokens
        if wanted is None:
            wanted = self.sampling_defaults.get("max_tokens")
        limit = min((n for n in (wanted, self.max_tokens_cap) if n is not None), default=None)
        if limit is not None and num_prompt_tokens + limit > self.max_model_len:
            limit = None  # only a default or a cap gets here: the client's fits
        if limit == params.max_tokens:
            return params
        return dataclasses.replace(params, max_tokens=limit)

    def chat_prompt_token_ids(
        self,
        messages: list[dict[str, Any]],
        tools: list[Any] | None = None,
        ending: ChatEnding | None = None,
    ) -> list[int]:
        """Render a conversation (and its `tools`) with the chat template and tokenize it,
        content as text.

        Roles are OpenAI's (engine/chat_tokens.py) and contents strings; a special-token string
        in a content is tokenized as text, never as the control token it spells.
        """
        text = self.chat.render(messages, tools, ending)
        self.check_length("messages", text)
        return self.truncated(self.chat.token_ids(messages, text, tools, ending))


def _is_token_id(value: Any) -> bool:
    # NOTE: bool is a subclass of int, but True is not token 1.
    return isinstance(value, int) and not isinstance(value, bool)


def bad_words_token_ids(tokenizer: Any, bad_words: list[str]) -> list[list[int]]:
    """Each bad word's tokens as vLLM bans them: as written (its leading spaces stripped), and
    with one leading space where that makes other tokens of the same count (a word mid-text);
    raises ValueError for a word of no tokens, or past `MAX_BAD_WORDS` tokenizations."""
    words: list[list[int]] = []
    for word in dict.fromkeys(bad_words):  # a word given twice is banned once, as vLLM's
        alone = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        if not alone:
            raise refusal("bad_words", f"{word!r} is no token of this vocabulary")
        words.append(alone)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        if spaced and spaced[0] != alone[0] and len(spaced) == len(alone):
            words.append(spaced)
    if len(words) > MAX_BAD_WORDS:
        raise refusal("bad_words", f"at most {MAX_BAD_WORDS} once tokenized, got {len(words)}")
    return words
