"""OpenAI request bodies to validated engine prompts: the tokenizer-side work of each route.

Plain functions of the `PromptValidator`, Ray-free; the ingress runs them in its tokenizer
threads, since decoding a body and tokenizing its prompts can take long for a large body.
"""

from __future__ import annotations

from typing import TypeVar

from pydantic import BaseModel

from pagedray.engine.prompt_validator import PromptValidator, ValidatedPrompt
from pagedray.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from pagedray.openai.request_body import parse_json_body
from pagedray.openai.tool_choice import check_tools, tools_for_template
from pagedray.scheduler.request_failure import refusal
from pagedray.scheduler.sampling_params import SamplingParams

RequestT = TypeVar("RequestT", bound=BaseModel)


def decode_body(raw: bytes, model: type[RequestT]) -> RequestT:
    """Raises BodyError (not JSON, too deep, lone surrogates) or pydantic's ValidationError."""
    return model.model_validate(parse_json_body(raw))


def completion_prompts(
    validator: PromptValidator, body: CompletionRequest
) -> tuple[list[SamplingParams], list[ValidatedPrompt], list[str] | None]:
    """Each validated prompt with its sampling parameters, and with `echo` each prompt's text;
    a `max_tokens` that does not fit beside a prompt is refused (vLLM's 400), never clamped
    (`PromptValidator.limit_output`)."""
    params = body.to_sampling_params(validator.sampling_defaults)
    validator = _for_request(validator, body)
    prompts, prompt_params = [], []
    for prompt in body.prompts():
        key = "prompt_token_ids" if isinstance(prompt, list) else "prompt"
        validated = validator.validate({key: prompt, "cache_salt": body.cache_salt}, params)
        prompt_params.append(validator.limit_output(params, len(validated.token_ids)))
        prompts.append(validated)
    echo = None
    if body.echo:
        decode = validator.tokenizer.decode
        echo = [p.text if p.text is not None else decode(p.token_ids) for p in prompts]
    return prompt_params, prompts, echo


def chat_prompt(
    validator: PromptValidator, body: ChatCompletionRequest
) -> tuple[SamplingParams, ValidatedPrompt]:
    """Sampling parameters and the conversation's validated prompt (content read as text)."""
    params = body.to_sampling_params(validator.sampling_defaults)
    validator.check_logprobs("top_logprobs", body.top_logprobs)  # named as the client sent it
    validator = _for_request(validator, body)
    token_ids = chat_token_ids(validator, body)
    prompt = validator.validate(
        {"prompt_token_ids": token_ids, "cache_salt": body.cache_salt}, params
    )
    # The field the client set is the one to blame (max_completion_tokens wins when both are).
    field = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    return validator.limit_output(params, len(prompt.token_ids), field), prompt


def _for_request(
    validator: PromptValidator, body: ChatCompletionRequest | CompletionRequest
) -> PromptValidator:
    """The validator that tokenizes the request's prompts as it asks (vLLM's
    `truncate_prompt_tokens`, and a completion's `add_special_tokens`)."""
    special = body.add_special_tokens if isinstance(body, CompletionRequest) else True
    return validator.for_request(body.truncate_prompt_tokens, body.truncation_side, special)


def chat_token_ids(validator: PromptValidator, body: ChatCompletionRequest) -> list[int]:
    """The conversation's token ids, its tools rendered by the chat template (what Anthropic's
    `count_tokens` counts too)."""
    messages = [message.as_template_input() for message in body.messages]
    tools = tools_for_template(body.tool_dicts()) or None
    return validator.chat_prompt_token_ids(messages, tools, body.chat_ending())


def count_chat_tokens(validator: PromptValidator, body: ChatCompletionRequest) -> int:
    """How many tokens the conversation and its tools take, checked as a chat request's are."""
    check_tools(body.tool_dicts(), body.tool_choice_value(), body.parallel_tool_calls)
    return len(chat_token_ids(validator, body))


def tokenize(validator: PromptValidator, body: TokenizeRequest) -> list[int]:
    """Token ids of a prompt or a conversation. A text too long to fit `max_model_len` whatever
    it tokenizes to is refused unread, as the generation routes refuse it; one that fits that
    bound is tokenized even past `max_model_len`, so a client can learn how long it is."""
    if body.messages is not None:
        messages = [m.as_template_input() for m in body.messages]
        return validator.chat_prompt_token_ids(messages, None, body.chat_ending())
    assert body.prompt is not None
    return validator.encode(body.prompt, add_special_tokens=body.add_special_tokens)


def detokenize(validator: PromptValidator, body: DetokenizeRequest) -> str:
    """The text of token ids, each checked against the vocabulary; no more of them than a
    sequence can hold (`max_model_len`), as the other routes bound what they tokenize."""
    if len(body.tokens) > validator.max_model_len:
        raise refusal(
            "tokens", f"{len(body.tokens)} tokens exceed max_model_len={validator.max_model_len}"
        )
    vocab_size = validator.vocab_size
    bad = [t for t in body.tokens if not 0 <= t < vocab_size]
    if bad:
        raise refusal("tokens", f"{bad[0]} is outside the vocabulary [0, {vocab_size})")
    return validator.tokenizer.decode(body.tokens)
