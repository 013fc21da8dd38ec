"""What every OpenAI route of the ingress shares: body parsing, limits, the tokenizer threads,
and submitting engine requests (with cache-aware routing hashes) as `EngineStreams`.

A plain base class of `OpenAIIngress`, kept apart so the deployment's module holds only routes.
"""

from __future__ import annotations

import asyncio
import functools
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from fastapi import Request
from fastapi.responses import Response
from pydantic import ValidationError
from ray.serve.handle import DeploymentHandle

# NOTE: the module, not its `KV_VIEWS`: the ingress's routes are pickled by value, and a name
# bound by value would carry a copy of the views, not this process's (see ingress_deployment.py).
from pagedray.cluster import kv_views
from pagedray.cluster.engine_control import EngineControl
from pagedray.cluster.kv_views import ROUTING_HASHES_KEY
from pagedray.engine.config import EngineConfig
from pagedray.engine.prompt_validator import PromptValidator, ValidatedPrompt
from pagedray.openai.answers import AnswerContext
from pagedray.openai.engine_streams import EngineStreams
from pagedray.openai.output_subscriber import OutputSubscriber
from pagedray.openai.prompts import RequestT, chat_prompt, decode_body
from pagedray.openai.protocol import ChatCompletionRequest, ModelCard
from pagedray.openai.request_body import BodyError
from pagedray.openai.serving import (
    LogprobFormatter,
    bad_request,
    engine_error_response,
    error_response,
)
from pagedray.openai.tool_calls import ToolCallOutput
from pagedray.scheduler.sampling_params import SamplingParams

# Tokens per engine message of a non-streamed request with stop strings: the ingress finds them,
# so it needs the tokens before the end, but not one message per token.
STOP_CHECK_INTERVAL = 8


class IngressBase:
    """Shared steps of the ingress's routes; `OpenAIIngress.__init__` sets the attributes."""

    engine: DeploymentHandle
    config: EngineConfig
    model_name: str
    tokenizer: Any
    control: EngineControl
    subscriber: OutputSubscriber
    validator: PromptValidator
    logprobs: LogprobFormatter
    executor: ThreadPoolExecutor

    async def _start_chat(
        self, request_id: str, body: ChatCompletionRequest
    ) -> tuple[AnswerContext, EngineStreams] | Response:
        """Template, tokenize and validate a chat request, then submit it; the error response if
        it is refused. Chat completions and the Responses API both come through here."""
        await self._learn_limits()
        try:
            params, prompt = await self._in_thread(chat_prompt, self.validator, body)
        except ValueError as exc:
            return bad_request(exc)
        ctx = AnswerContext(
            request_id=request_id,
            model=self.model_name,
            n=params.n,
            num_prompts=1,
            logprobs=self.logprobs,
            num_logprobs=params.logprobs,
            include_usage=body.include_usage,
            num_prompt_tokens=len(prompt.token_ids),
            tool_calls=ToolCallOutput.of(
                body.tool_dicts(),
                body.tool_choice_value(),
                self.config.tool_call_parser,
                self.tokenizer.chat_template,
            ),
        )
        streams = await self._open(ctx.request_id, [prompt], params, body.priority, body.stream)
        return streams if isinstance(streams, Response) else (ctx, streams)

    async def _learn_limits(self) -> int:
        await self.control.learn_limits()
        self.validator.max_model_len = self.control.max_model_len
        return self.validator.max_model_len

    async def _model_cards(self) -> list[ModelCard] | Response:
        """A card per served name (GET /v1/models and /v1/models/{id}), or the 503 while the
        engines cannot serve."""
        not_ready = await self.control.not_ready(f"models-{uuid.uuid4().hex}")
        if not_ready is not None:
            return not_ready
        max_model_len = await self._learn_limits()
        names = self.config.served_names()
        return [ModelCard(id=n, root=self.config.model, max_model_len=max_model_len) for n in names]

    async def _in_thread(self, fn: Callable[..., Any], *args: Any) -> Any:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.executor, functools.partial(fn, *args))

    async def _parse(self, raw: Request, model: type[RequestT]) -> RequestT | Response:
        """Decode and validate a body (the guard has bounded it); the error response if bad."""
        try:
            body = await self._in_thread(decode_body, await raw.body(), model)
        except BodyError as exc:
            return error_response(400, str(exc), param=exc.param)
        except ValidationError as exc:
            return bad_request(exc)
        requested = getattr(body, "model", None)
        if requested is not None and requested not in self.config.served_names():
            message = f"model: {requested!r} does not exist; this server has {self.model_name!r}"
            return error_response(404, message, "NotFoundError", param="model")
        return body

    def _stream_interval(self, stream: bool, params: SamplingParams) -> int | None:
        """How often the engine sends this request's tokens: every `--stream-interval` tokens to
        a streaming client; once, at the end, to one that does not stream, unless the ingress
        must watch for stop strings (then every `STOP_CHECK_INTERVAL` tokens, so that little is
        generated past one)."""
        if stream:
            return self.config.stream_interval
        return STOP_CHECK_INTERVAL if params.stop else None

    async def _open(
        self,
        request_id: str,
        prompts: list[ValidatedPrompt],
        params: SamplingParams,
        priority: int,
        stream: bool,
    ) -> EngineStreams | Response:
        """Submit one engine request per prompt; an error response if any is refused."""
        requests: list[dict[str, Any]] = [
            {
                "request_id": request_id if len(prompts) == 1 else f"{request_id}-{i}",
                "prompt_token_ids": prompt.token_ids,
                "sampling_params": params,
                "priority": priority,
                "cache_salt": prompt.cache_salt,
                "stream_interval": self._stream_interval(stream, params),
            }
            for i, prompt in enumerate(prompts)
        ]
        views = kv_views.KV_VIEWS
        views.follow_live_replicas()  # also lets the router's news reach this loop
        if views.attached and len(views.live_replica_ids) > 1:  # else nothing to choose
            for request, prompt in zip(requests, prompts):
                hashes = views.routing_hashes(prompt.token_ids, prompt.cache_salt)
                request[ROUTING_HASHES_KEY] = hashes
        streams = EngineStreams(self.engine, requests, self.tokenizer, self.subscriber)
        error = await streams.open()
        return engine_error_response(error) if error is not None else streams
