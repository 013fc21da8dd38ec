"""The OpenAI server's state and the steps its routes share, written against one
`EngineClient` (engine/engine_client.py), so the same routes serve over Ray Serve
(cluster/ingress_deployment.py) and in-process (`openai_app.local_openai_app`).

A route (openai/routes/) parses its body, builds its prompts in the tokenizer threads, opens its
engine requests here (`open`), and writes what the merged streams bring (answers.py).
"""

from __future__ import annotations

import asyncio
import functools
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

from fastapi import Request
from fastapi.responses import Response
from pydantic import ValidationError

from pagedray.engine.config import EngineConfig
from pagedray.engine.engine_client import EngineClient
from pagedray.engine.prompt_validator import PromptValidator, ValidatedPrompt
from pagedray.engine.thinking_tokens import ThinkingTokens, check_budget
from pagedray.engine.wire import GenerateRequest
from pagedray.openai.answer_models import ModelCard
from pagedray.openai.answers import AnswerContext
from pagedray.openai.cors import CORSSettings
from pagedray.openai.engine_streams import EngineStreams
from pagedray.openai.ingress_guard import GuardSettings
from pagedray.openai.prompts import RequestT, chat_prompt, decode_body
from pagedray.openai.protocol import ChatCompletionRequest, CompletionRequest
from pagedray.openai.reasoning import ReasoningParser, reasoning_tag_ids
from pagedray.openai.request_body import BodyError
from pagedray.openai.request_log import RequestLog, warn_if_unseen
from pagedray.openai.response_store import ResponseStoreClient
from pagedray.openai.serving import (
    LogprobFormatter,
    bad_request,
    engine_error_response,
    error_response,
    logger,
)
from pagedray.openai.tool_calls import ToolCallOutput
from pagedray.scheduler.sampling_params import SamplingParams
from pagedray.workers.lora_checkpoint import adapter_key

# Threads per server that parse bodies and (de)tokenize, off the event loop: a huge prompt then
# delays only the requests queued behind it here, never /health or a stream.
TOKENIZER_THREADS = 4
# The prompt's last tokens, read for whether its thinking is open (`_reasoning`).
PROMPT_TAIL_TOKENS = 32
# Tokens per engine message of a non-streamed request with stop strings: the server finds them,
# so it needs the tokens before the end, but not one message per token.
STOP_CHECK_INTERVAL = 8


class OpenAIServer:
    """One server's engine client, tokenizer, validator and settings; the routes' shared steps.

    `guard` and `cors` are what its middleware applies (an API key's digest, the body limit,
    the allowed origins); `prometheus_text`, when given, is what /metrics answers.
    """

    def __init__(
        self,
        client: EngineClient,
        config: EngineConfig,
        tokenizer: Any,
        validator: PromptValidator,
        response_store: ResponseStoreClient | None = None,
        guard: GuardSettings | None = None,
        cors: CORSSettings | None = None,
        prometheus_text: Callable[[], Any] | None = None,
    ) -> None:
        self.client = client
        self.config = config
        self.model_name = config.served_name()
        self.tokenizer = tokenizer
        self.validator = validator
        self.response_store = response_store
        self.guard = guard or GuardSettings()
        self.cors = cors or CORSSettings()
        self.prometheus_text = prometheus_text
        self.logprobs = LogprobFormatter(tokenizer)
        self.executor = ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="pagedray-tok")
        warn_if_unseen(config)

    async def not_ready(self, request_id: str) -> Response | None:
        """None once the engines serve; until then the 503 to answer."""
        failure = await self.client.not_ready(request_id)
        return None if failure is None else engine_error_response(failure)

    async def generation_body(
        self, raw: Request, model: type[RequestT], request_id: str
    ) -> RequestT | Response:
        """A generation route's first steps: the 503 while the engines cannot serve, else its
        body parsed (or the error response)."""
        not_ready = await self.not_ready(request_id)
        if not_ready is not None:
            return not_ready
        return await self.parse(raw, model)

    async def learn_limits(self) -> int:
        """The engines' `max_model_len`, which the validator then holds requests to."""
        limits = await self.client.limits()
        self.validator.max_model_len = limits.max_model_len
        return limits.max_model_len

    async def max_num_waiting(self) -> int | None:
        return (await self.client.limits()).max_num_waiting

    async def in_thread(self, fn: Callable[..., Any], *args: Any) -> Any:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.executor, functools.partial(fn, *args))

    async def parse(self, raw: Request, model: type[RequestT]) -> RequestT | Response:
        """Decode and validate a body (the guard has bounded it); the error response if bad."""
        try:
            body = await self.in_thread(decode_body, await raw.body(), model)
        except BodyError as exc:
            return error_response(400, str(exc), param=exc.param)
        except ValidationError as exc:
            return bad_request(exc)
        requested = getattr(body, "model", None)
        if requested is not None and not self.serves(requested):
            message = f"model: {requested!r} does not exist; this server has {self.model_name!r}"
            return error_response(404, message, "NotFoundError", param="model")
        return body

    def serves(self, model: str) -> bool:
        """Whether a request may send `model`: a served name or a LoRA adapter's."""
        return model in self.config.served_names() or self.lora_name(model) is not None

    def lora_name(self, model: str | None) -> str | None:
        """The LoRA adapter a request's `model` names (`--lora-modules`, or a folder of
        `--lora-resolver-dir`); None: the base model."""
        if model is None or model in self.config.served_names():
            return None
        known = model in self.config.lora_adapters()
        return model if known or self.config.resolvable_lora(model) is not None else None

    def _lora_key(self, name: str) -> str:
        """The adapter's key in block hashes, as the engines compute it from its folder."""
        path = self.config.lora_adapters().get(name) or self.config.resolvable_lora(name)
        try:
            return adapter_key(name, str(Path(path or "").expanduser().resolve()))
        except OSError:  # not readable here: the engines' hashes will not match the router's
            return name

    def answer_model(self, model: str | None) -> str:
        """The `model` an answer reports: the adapter's name for an adapter's (vLLM's)."""
        return self.lora_name(model) or self.model_name

    async def model_cards(self, request_id: str) -> list[ModelCard] | Response:
        """A card per served name and LoRA adapter (GET /v1/models and /v1/models/{id}), or the
        503 while the engines cannot serve."""
        not_ready = await self.not_ready(request_id)
        if not_ready is not None:
            return not_ready
        max_model_len = await self.learn_limits()
        root, names = self.config.model, self.config.served_names()
        cards = [ModelCard(id=n, root=root, max_model_len=max_model_len) for n in names]
        adapters = await self.in_thread(self._lora_adapters)
        return cards + [
            ModelCard(id=name, root=path, parent=self.model_name, max_model_len=max_model_len)
            for name, path in adapters.items()
        ]

    def _lora_adapters(self) -> dict[str, str]:
        """name -> folder of every adapter requests may name: `--lora-modules`', then the
        resolver's folder's (those loaded at run time among them), as vLLM lists its loaded
        ones."""
        adapters = dict(self.config.lora_adapters())
        root = self.config.lora_resolver_dir
        names = sorted(os.listdir(root)) if root and os.path.isdir(root) else []
        served = set(self.config.served_names())
        for name in names:
            path = self.config.resolvable_lora(name)
            if path is not None and name not in adapters and name not in served:
                adapters[name] = str(Path(path).resolve())
        return adapters

    async def start_chat(
        self,
        request_id: str,
        body: ChatCompletionRequest,
        split_reasoning: bool = False,
        engine_suffix: str = "",
    ) -> tuple[AnswerContext, EngineStreams] | Response:
        """Template, tokenize and validate a chat request, then submit it; the error response if
        it is refused. Chat completions, the Responses API and Anthropic's Messages API all
        come through here; `split_reasoning`: the answer's thinking is split off as the
        `--reasoning-parser` says; `engine_suffix`: what the engine's id adds to the answer's
        `request_id` (a client chose that: request_ids.py)."""
        await self.learn_limits()
        try:
            params, prompt = await self.in_thread(chat_prompt, self.validator, body)
        except ValueError as exc:
            return bad_request(exc)
        ctx = AnswerContext(
            request_id=request_id,
            model=self.answer_model(body.model),
            n=params.n,
            num_prompts=1,
            logprobs=self.logprob_formatter(body),
            num_logprobs=params.logprobs,
            include_usage=body.include_usage or self.config.enable_force_include_usage,
            num_prompt_tokens=len(prompt.token_ids),
            prompt_token_ids=[prompt.token_ids] if body.return_token_ids else None,
            echo=[echoed] if (echoed := body.echoed()) is not None else None,
            tool_calls=ToolCallOutput.of(
                body.tool_dicts(),
                body.tool_choice_value(),
                self.config.tool_call_parser,
                self.tokenizer.chat_template,
            ),
        )
        try:
            reasoning, thinking_end = self._reasoning(body, params, prompt.token_ids)
        except ValueError as exc:
            return bad_request(exc)
        if split_reasoning:
            ctx.reasoning = reasoning
            ctx.reasoning_tags = self._reasoning_tags
        streams = await self.open(
            request_id,
            [prompt],
            [params],
            body.priority,
            body.stream,
            [thinking_end],
            engine_suffix,
            self.lora_name(body.model),
        )
        return streams if isinstance(streams, Response) else (ctx, streams)

    def logprob_formatter(
        self, body: ChatCompletionRequest | CompletionRequest
    ) -> LogprobFormatter:
        """How the request's logprobs name tokens: by text, or by id (vLLM's
        `return_tokens_as_token_ids`)."""
        return self.logprobs.named_by_id() if body.return_tokens_as_token_ids else self.logprobs

    def _reasoning(
        self, body: ChatCompletionRequest, params: SamplingParams, prompt_token_ids: list[int]
    ) -> tuple[ReasoningParser | None, int | None]:
        """How a chat answer's thinking splits from its content (None: it has none), and the
        token that ends the thinking the output starts in, for the engine (None: it does not
        start thinking, or the vocabulary has no such token): its structured output's grammar
        holds after it, and its `thinking_token_budget` counts before it.

        As vLLM's, a reasoning model thinks freely and its grammar holds after `</think>`,
        where the vocabulary has that as one token (as reasoning models' do). Else the grammar
        holds from the first token: output held to JSON then has no thinking, and a regex,
        choice or grammar's starts in the content. Where the output starts is read from the
        prompt's end. Raises ValueError for a budget that cannot be kept."""
        check_budget(self._thinking_tokens, params.thinking_token_budget)
        if self.config.reasoning_parser is None:
            return None, None
        constraint = params.structured_outputs
        continues = body.continue_final_message
        # A prefill's own text says whether it opened a thinking, however long it is; else the
        # rendered prompt's end does (a template that opened or closed it).
        tail = (
            body.messages[-1].as_template_input()["content"]
            if continues
            else self.tokenizer.decode(prompt_token_ids[-PROMPT_TAIL_TOKENS:])
        )
        parser = functools.partial(
            ReasoningParser.of,
            self.config.reasoning_parser,
            self.validator.chat.template_kwargs(body.chat_ending()),
            tail,
            shown=body.include_reasoning,
            continues=continues,
        )
        free = parser()
        thinking_end = None
        if free is not None and free.thinking and self._thinking_tokens is not None:
            thinking_end = self._thinking_tokens.end
        if constraint is None or thinking_end is not None:
            return free, thinking_end
        if constraint.key[0] == "json":
            return None, None
        return parser(constrained=True), None

    def thinking_ends(
        self, prompts: list[ValidatedPrompt], params: SamplingParams
    ) -> list[int | None] | None:
        """Per completions prompt, the token that ends the thinking its output starts in, as
        vLLM's engine decides it from the prompt's tokens (engine/thinking_tokens.py): its
        structured output holds after it, its thinking budget counts before it; None without
        a reasoning parser. Raises ValueError for a budget that cannot be kept."""
        thinking = self._thinking_tokens
        check_budget(thinking, params.thinking_token_budget)
        if thinking is None:
            return None
        if params.structured_outputs is None and params.thinking_token_budget is None:
            return None  # nothing in the engine reads where the thinking ends
        return [thinking.thinking_end(prompt.token_ids) for prompt in prompts]

    @property
    def keeps_thinking_budgets(self) -> bool:
        """A reasoning parser and a vocabulary where `</think>` is one token: the engine can
        end a thinking after a budget."""
        return self._thinking_tokens is not None

    @property
    def _thinking_start(self) -> int | None:
        """`<think>`'s id for the engine (a leading one is no thinking token), if it has one."""
        thinking = self._thinking_tokens
        return thinking.start if thinking is not None else None

    @functools.cached_property
    def _thinking_tokens(self) -> ThinkingTokens | None:
        """The thinking tokens the engine watches, for the `--reasoning-parser` (if any)."""
        return ThinkingTokens.of(self.tokenizer, self.config.reasoning_parser)

    @functools.cached_property
    def _reasoning_tags(self) -> dict[str, int] | None:
        """With a `--reasoning-parser`, the ids of its tags that are single tokens, to count
        the thinking in tokens (vLLM's usage `reasoning_tokens`); None: not counted."""
        if self.config.reasoning_parser is None:
            return None
        return reasoning_tag_ids(self.tokenizer)

    async def open(
        self,
        request_id: str,
        prompts: list[ValidatedPrompt],
        params: list[SamplingParams],
        priority: int,
        stream: bool,
        thinking_ends: list[int | None] | None = None,
        engine_suffix: str = "",
        lora_name: str | None = None,
    ) -> EngineStreams | Response:
        """Submit one engine request per prompt, each with its parameters (`params`, in the
        prompts' order); an error response if any is refused. `thinking_ends`: per prompt, the
        token that ends the thinking its output starts in (a reasoning model's `</think>`;
        None: it does not start thinking); `engine_suffix`: what the engine's ids add to those
        the log shows (request_ids.py); `lora_name`: the LoRA adapter they run with."""
        shown = [
            request_id if len(prompts) == 1 else f"{request_id}-{i}" for i in range(len(prompts))
        ]
        lora_key = None if lora_name is None else self._lora_key(lora_name)
        requests = [
            GenerateRequest(
                shown[i] + engine_suffix,
                prompt.token_ids,
                prompt_params,
                priority,
                prompt.cache_salt,
                self._stream_interval(stream, prompt_params),
                thinking_end_token_id=thinking_ends[i] if thinking_ends else None,
                thinking_start_token_id=self._thinking_start,
                lora_name=lora_name,
                lora_key=lora_key,
            )
            for i, (prompt, prompt_params) in enumerate(zip(prompts, params, strict=True))
        ]
        log = RequestLog(self.config, stream) if self.config.enable_log_requests else None
        if log is not None:
            for name, prompt, request in zip(shown, prompts, requests, strict=True):
                log.received(request.request_id, prompt, request.sampling_params, name, lora_name)
        streams = EngineStreams(self.client, requests, self.tokenizer, log)
        failure = await streams.open()
        return engine_error_response(failure) if failure is not None else streams

    def _stream_interval(self, stream: bool, params: SamplingParams) -> int | None:
        """How often the engine sends this request's tokens: every `--stream-interval` tokens to
        a streaming client; once, at the end, to one that does not stream, unless the server
        must watch for stop strings (then every `STOP_CHECK_INTERVAL` tokens, so that little is
        generated past one)."""
        if stream:
            return self.config.stream_interval
        return STOP_CHECK_INTERVAL if params.stop else None

    async def stored(self, response_id: str) -> dict[str, Any] | None:
        """A stored response's record (the Responses API's), if any."""
        if self.response_store is None:
            return None
        return await self.response_store.get(response_id)

    async def save(self, response: dict[str, Any], record: dict[str, Any]) -> None:
        if self.response_store is None:
            return
        if not await self.response_store.put(response["id"], record):
            logger.warning("response %s not stored: larger than the store", response["id"])

    async def delete_stored(self, response_id: str) -> bool:
        return self.response_store is not None and await self.response_store.delete(response_id)


def openai_server(request: Request) -> OpenAIServer:
    """The server behind the app that answers `request`: each app names its own, as a FastAPI
    dependency override (`openai_app.openai_fastapi_app`)."""
    raise RuntimeError("this app names no OpenAIServer (see openai_app.openai_fastapi_app)")
