"""The answers' shapes: OpenAI's response, chunk, usage, logprob, model-list and error models,
exactly as the `openai` SDK parses them, with vLLM's extensions (left out of the JSON while
absent). Requests are protocol.py's.
"""

from __future__ import annotations

import time
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, Field, SerializerFunctionWrapHandler, model_serializer

from pagedray.openai.constraints import DeltaToolCall, ToolCall


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class CompletionTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None
    # With a --reasoning-parser (as vLLM's): the completion's thinking, in tokens.
    completion_tokens_details: CompletionTokensDetails | None = None


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class _VLLMExtensions(BaseModel):
    """A model whose vLLM extensions (`_OPTIONAL`) are left out of its JSON while absent, so an
    answer that asks for none has exactly OpenAI's shape."""

    _OPTIONAL: ClassVar[tuple[str, ...]] = ()

    @model_serializer(mode="wrap")
    def _without_absent_extensions(self, handler: SerializerFunctionWrapHandler) -> Any:
        data = handler(self)
        if isinstance(data, dict):
            for name in self._OPTIONAL:
                if data.get(name) is None:
                    data.pop(name, None)
        return data


class PromptLogprob(BaseModel):
    """vLLM's entry of a prompt token's logprobs, keyed by token id."""

    logprob: float
    rank: int | None = None  # among the vocabulary, 1: the most likely
    decoded_token: str | None = None


PromptLogprobs = list[dict[str, PromptLogprob] | None]


class CompletionChoice(_VLLMExtensions):
    _OPTIONAL = ("prompt_token_ids", "token_ids", "prompt_logprobs")

    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # vLLM's extension: the stop string or token id
    prompt_token_ids: list[int] | None = None  # return_token_ids (a stream's first chunk)
    token_ids: list[int] | None = None
    prompt_logprobs: PromptLogprobs | None = None  # vLLM's, per prompt token (None first)


class CompletionResponse(BaseModel):
    """Both the whole response and each streamed chunk (OpenAI uses one shape for both)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] | None = None
    reasoning: str | None = None  # vLLM's field: the thinking (`--reasoning-parser`)


class ChatCompletionChoice(_VLLMExtensions):
    _OPTIONAL = ("token_ids",)

    index: int
    message: ChatResponseMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    token_ids: list[int] | None = None  # return_token_ids


class ChatCompletionResponse(_VLLMExtensions):
    _OPTIONAL = ("prompt_token_ids", "prompt_logprobs")

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None
    prompt_token_ids: list[int] | None = None  # return_token_ids
    prompt_logprobs: PromptLogprobs | None = None  # vLLM's, per prompt token (None first)


class DeltaMessage(_VLLMExtensions):
    _OPTIONAL = ("reasoning",)  # every chunk stays as it was without a parser

    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None
    reasoning: str | None = None  # vLLM's field; only in a chunk that has some


class ChatCompletionStreamChoice(_VLLMExtensions):
    _OPTIONAL = ("token_ids",)

    index: int
    delta: DeltaMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    token_ids: list[int] | None = None  # return_token_ids: this chunk's


class ChatCompletionChunk(_VLLMExtensions):
    _OPTIONAL = ("prompt_token_ids",)

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None
    prompt_token_ids: list[int] | None = None  # return_token_ids: in the first chunk


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "pagedray"
    root: str | None = None
    parent: str | None = None  # a LoRA adapter's base model (vLLM's)
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeResponse(BaseModel):
    prompt: str


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
