"""OpenAI API request models, shaped exactly as the `openai` SDK sends them (the answers' are
answer_models.py's).

Requests are validated here (pydantic) and turned into `SamplingParams` (which validates ranges),
so a bad request is answered with a 400 before anything reaches the engine.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictInt,
    model_validator,
)

from pagedray.engine.chat_tokens import ChatEnding
from pagedray.engine.sampling_defaults import SAMPLING_FIELDS
from pagedray.openai.constraints import (
    ConstraintFields,
    ToolFields,
)
from pagedray.openai.request_ids import MAX_LENGTH as MAX_REQUEST_ID_LENGTH
from pagedray.openai.request_ids import PATTERN as REQUEST_ID_PATTERN
from pagedray.scheduler.request_failure import refusal
from pagedray.scheduler.sampling_params import (
    MAX_INT32,
    MAX_LOGIT_BIAS,
    MAX_N,
    MAX_REPETITION_PENALTY,
    MIN_REPETITION_PENALTY,
    SamplingParams,
)
from pagedray.scheduler.structured_outputs import StructuredOutputsParams

# A request's own sampling fields and the neutral defaults: no model's generation config.
NO_DEFAULTS: Mapping[str, Any] = MappingProxyType({})

# ---- requests ------------------------------------------------------------------------------


def _bounded(default: Any, **schema: Any) -> Any:
    """A field whose JSON schema (/openapi.json) states the range `SamplingParams` enforces;
    the check itself, and its "field: message" error, stay there."""
    return Field(default, json_schema_extra=schema)


_TOKEN_ID = {"type": "integer", "minimum": 0, "maximum": MAX_INT32}
_COUNT = {"minimum": 1, "maximum": MAX_INT32}
_LOGPROBS = {"minimum": 0}  # and at most the server's --max-logprobs
_PENALTY = {"minimum": -2.0, "maximum": 2.0}


def _prompt_schema(schema: dict[str, Any]) -> None:
    """A prompt is non-empty: a string, token ids, strings, or lists of token ids."""
    tokens = {"type": "array", "items": _TOKEN_ID, "minItems": 1}
    strings = {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1}
    batches = {"type": "array", "items": tokens, "minItems": 1}
    schema.clear()
    schema.update(
        {"title": "Prompt", "anyOf": [{"type": "string", "minLength": 1}, tokens, strings, batches]}
    )


class StreamOptions(BaseModel):
    include_usage: bool = False


class _GenerationRequest(ConstraintFields):
    """Fields both generation endpoints share: OpenAI's, plus vLLM's sampling extensions
    (`response_format` and `structured_outputs` come from `ConstraintFields`)."""

    # Unknown fields are ignored, as OpenAI clients send fields that do not change sampling.
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    # vLLM's: names the answer (`chatcmpl-<id>`), unless the X-Request-Id header does.
    request_id: str | None = Field(
        None, max_length=MAX_REQUEST_ID_LENGTH, pattern=REQUEST_ID_PATTERN
    )
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = _bounded(1, minimum=1, maximum=MAX_N)
    temperature: float | None = _bounded(None, minimum=0.0)
    top_p: float | None = _bounded(None, exclusiveMinimum=0.0, maximum=1.0)
    top_k: int | None = _bounded(None, minimum=-1, maximum=MAX_INT32)
    min_p: float | None = _bounded(None, minimum=0.0, maximum=1.0)
    seed: int | None = _bounded(None, minimum=-(2**63), maximum=2**64 - 1)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = _bounded(None, items=_TOKEN_ID)
    presence_penalty: float | None = _bounded(None, **_PENALTY)
    frequency_penalty: float | None = _bounded(None, **_PENALTY)
    repetition_penalty: float | None = _bounded(
        None, minimum=MIN_REPETITION_PENALTY, maximum=MAX_REPETITION_PENALTY
    )
    ignore_eos: bool = False
    min_tokens: int = _bounded(0, minimum=0, maximum=MAX_INT32)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[str, float] | None = _bounded(
        None,
        propertyNames={"pattern": "^[0-9]+$"},
        additionalProperties={
            "type": "number",
            "minimum": -MAX_LOGIT_BIAS,
            "maximum": MAX_LOGIT_BIAS,
        },
    )
    allowed_token_ids: list[int] | None = _bounded(None, items=_TOKEN_ID, minItems=1)
    bad_words: list[str] | None = None
    # vLLM's: keep this many of the prompt's tokens (-1: as many as max_model_len leaves a
    # token of output), its last ("left", the default) or its first ("right").
    truncate_prompt_tokens: int | None = Field(None, ge=-1, le=MAX_INT32)
    truncation_side: Literal["left", "right"] | None = None
    # vLLM's: a reasoning model's thinking, in tokens at most (-1: no limit); then it ends.
    thinking_token_budget: int | None = _bounded(None, minimum=-1, maximum=MAX_INT32)
    # vLLM's: each prompt token's logprob with this many alternatives (not streamed).
    prompt_logprobs: int | None = _bounded(None, **_LOGPROBS)
    cache_salt: str | None = _bounded(None, minLength=1)
    priority: int = 0
    user: str | None = None
    # vLLM's: the prompt's and each choice's token ids in the answer (in a stream, the prompt's
    # in the first chunk and each chunk's own); logprobs' tokens named "token_id:<id>".
    return_token_ids: bool | None = None
    return_tokens_as_token_ids: bool | None = None

    @model_validator(mode="after")
    def _check_common(self) -> _GenerationRequest:
        if self.stream_options is not None and not self.stream:
            raise refusal("stream_options", "only allowed when stream is true")
        if self.prompt_logprobs and self.stream:  # 0 asks nothing: accepted, as vLLM's
            raise refusal("prompt_logprobs", "not available when stream is true")
        if self.cache_salt is not None and not self.cache_salt:
            raise refusal("cache_salt", "must be a non-empty string")
        return self

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def _sampling_params(
        self,
        max_tokens: int | None,
        logprobs: int | None,
        prompt_logprobs: int | None = None,
        constraint: StructuredOutputsParams | None = None,
        defaults: Mapping[str, Any] = NO_DEFAULTS,
    ) -> SamplingParams:
        """Raises `RequestRefused` naming the field on an out-of-range value. A sampling field
        the request leaves unset takes the model's default (`defaults`, from its
        generation_config.json), else SamplingParams' neutral one."""
        given = {name: getattr(self, name) for name in SAMPLING_FIELDS}
        sampling = {name: defaults[name] for name in SAMPLING_FIELDS if name in defaults}
        sampling.update({name: v for name, v in given.items() if v is not None})
        return SamplingParams(
            **sampling,
            structured_outputs=constraint,
            n=self.n,
            seed=self.seed,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            stop=[self.stop] if isinstance(self.stop, str) else list(self.stop or []),
            stop_token_ids=list(self.stop_token_ids or []),
            include_stop_str_in_output=self.include_stop_str_in_output,
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens,
            logit_bias=_token_bias(self.logit_bias),
            allowed_token_ids=self.allowed_token_ids,
            bad_words=list(self.bad_words or []),
            thinking_token_budget=self.thinking_token_budget,
            prompt_logprobs=prompt_logprobs,
        )


def _token_bias(logit_bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI sends token ids as JSON object keys (strings)."""
    if not logit_bias:
        return None
    bias = {}
    for key, value in logit_bias.items():
        try:
            bias[int(key)] = value
        except ValueError:
            raise refusal("logit_bias", f"keys must be token ids, got {key!r}") from None
    return bias


class CompletionRequest(_GenerationRequest):
    # NOTE: StrictInt keeps ["1", "2"] a list of strings rather than coercing it to token ids.
    prompt: str | list[StrictInt] | list[str] | list[list[StrictInt]] = Field(
        json_schema_extra=_prompt_schema
    )
    max_tokens: int | None = _bounded(16, **_COUNT)
    logprobs: int | None = _bounded(None, **_LOGPROBS)
    echo: bool = False
    add_special_tokens: bool = True  # vLLM's: a text prompt gets the tokenizer's BOS
    suffix: str | None = _bounded(None, maxLength=0)
    best_of: int | None = None

    @model_validator(mode="after")
    def _check_completion(self) -> CompletionRequest:
        if self.suffix:
            raise refusal("suffix", "not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise refusal("best_of", "only best_of == n is supported")
        return self

    def prompts(self) -> list[str | list[int]]:
        """The batch of prompts: each a string or a list of token ids."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if prompt and all(isinstance(p, int) for p in prompt):
            return [list(prompt)]  # type: ignore[arg-type]
        if not prompt:
            return [[]]  # refused later as an empty prompt
        return list(prompt)  # type: ignore[arg-type]

    def to_sampling_params(self, defaults: Mapping[str, Any] = NO_DEFAULTS) -> SamplingParams:
        # echo with logprobs: the prompt's tokens get logprobs too, as OpenAI's legacy API does.
        prompt_logprobs = self.prompt_logprobs
        if prompt_logprobs is None and self.echo:
            prompt_logprobs = self.logprobs
        return self._sampling_params(
            self.max_tokens, self.logprobs, prompt_logprobs, self.constraint(), defaults
        )


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    # OpenAI's roles (`developer` and `function` render as the system and tool roles unless the
    # chat template knows them: engine/chat_tokens.py); any other string could forge a turn.
    role: Literal["developer", "system", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: the call it answers

    def as_template_input(self) -> dict[str, Any]:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        extra = {
            key: value
            for key in ("tool_calls", "tool_call_id", "name")
            if (value := getattr(self, key))
        }
        return {"role": self.role, "content": content or "", **extra}


class _ChatEndingFields(BaseModel):
    """vLLM's fields for how a rendered conversation ends: the assistant's turn opened, or the
    final assistant message continued (a prefill; `engine/chat_tokens.ChatEnding`)."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None  # the template's own variables
    # OpenAI's; as vLLM, the template gets it, and `enable_thinking` (false for "none") unless
    # chat_template_kwargs sets that itself.
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = (
        None
    )

    def chat_ending(self) -> ChatEnding:
        """Raises ValueError "continue_final_message: ..." for both set, or
        "chat_template_kwargs: ..." for a variable that is apply_chat_template's argument."""
        kwargs: dict[str, Any] = {}
        if self.reasoning_effort is not None:
            effort = self.reasoning_effort
            kwargs = {"reasoning_effort": effort, "enable_thinking": effort != "none"}
        kwargs |= self.chat_template_kwargs or {}
        return ChatEnding(self.add_generation_prompt, self.continue_final_message, kwargs)


def chat_tool_call(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    """One tool call as a chat assistant message holds it (`arguments`: a JSON object's text):
    what the Responses and Anthropic APIs make of the calls they are sent back."""
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


class ChatCompletionRequest(_GenerationRequest, ToolFields, _ChatEndingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    # vLLM's: a last assistant message's content goes before each answer's (a continued one).
    echo: bool = False

    max_tokens: int | None = _bounded(None, **_COUNT)
    max_completion_tokens: int | None = _bounded(None, **_COUNT)
    logprobs: bool = False
    top_logprobs: int | None = _bounded(None, **_LOGPROBS)
    include_reasoning: bool = True  # vLLM's: False drops the reasoning (--reasoning-parser)

    @model_validator(mode="after")
    def _check_chat(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise refusal("top_logprobs", "requires logprobs to be true")
        # Checked here too, not only by `SamplingParams`, which knows them by other names
        # (`logprobs`, `max_tokens`): the error names the field the client sent.
        if self.top_logprobs is not None and self.top_logprobs < 0:
            raise refusal("top_logprobs", f"must be at least 0, got {self.top_logprobs}")
        if self.max_completion_tokens is not None and self.max_completion_tokens < 1:
            raise refusal(
                "max_completion_tokens", f"must be at least 1, got {self.max_completion_tokens}"
            )
        return self

    def to_sampling_params(self, defaults: Mapping[str, Any] = NO_DEFAULTS) -> SamplingParams:
        max_tokens = self.max_completion_tokens or self.max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        constraint, forced = self.constraint(), self.tool_constraint()
        if constraint is not None and forced is not None:
            raise refusal("tool_choice", "a forced tool call cannot take a response_format too")
        return self._sampling_params(
            max_tokens, logprobs, self.prompt_logprobs, forced or constraint, defaults
        )

    def echoed(self) -> str | None:
        """With `echo`, the content an answer starts with, as vLLM's: the last message's where
        it has the answer's role (the assistant's, or without a generation prompt its own), its
        parts joined by line breaks."""
        if not self.echo:
            return None
        last = self.messages[-1]
        if self.add_generation_prompt and last.role != "assistant":
            return None
        content = last.content
        if isinstance(content, list):
            content = "\n".join(part.text for part in content)
        return content or None


class TokenizeRequest(_ChatEndingFields):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise refusal("prompt", "give exactly one of prompt or messages")
        return self


class DetokenizeRequest(BaseModel):
    model: str | None = None
    tokens: list[StrictInt]
