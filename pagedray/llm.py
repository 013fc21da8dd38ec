"""The offline Python API, shaped like vLLM's `LLM` so users can switch by changing an import.

An entry point, as the CLI is: above the cluster layer, whose Ray executor it uses when the ranks
run as worker actors (tensor_parallel_size > 1).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import threading
import time
from concurrent import futures
from typing import Any, Sequence

from tqdm import tqdm

from pagedray.engine.config import EngineConfig, validated
from pagedray.engine.lora_adapters import LoRARequest, add_adapter
from pagedray.engine.output_processor import OutputProcessor
from pagedray.engine.prompt_validator import as_prompt_list
from pagedray.engine.thinking_tokens import ThinkingTokens, check_budget
from pagedray.scheduler.outputs import RequestOutput
from pagedray.scheduler.request import EngineRequest
from pagedray.scheduler.request_failure import refusal
from pagedray.scheduler.sampling_params import SamplingParams
from pagedray.workers.compute_thread import compute_thread

logger = logging.getLogger(__name__)
PromptType = str | dict[str, Any]  # text, or {"prompt_token_ids": [...]}
INTERRUPT_POLL_S = 0.1  # how soon a Ctrl-C stops `generate` at the latest

# Tokens a step computes, offline: twice a server's budget, as vLLM's LLM class takes on CPUs.
# Nothing waits for a decode offline, so fewer, larger prefill steps only pay: with a shared
# 512-token prefix, 64 requests ran 3,136-3,900 output tok/s against 2,713-3,361 at 2,048
# (interleaved, 3 runs each, 2026-12-02); ShareGPT-like prompts 3,548-3,670 against 3,334-3,497.
OFFLINE_MAX_NUM_BATCHED_TOKENS = 4096


class LLM:
    """An engine in this process: a scheduler and its workers, driven to completion per call.

    At `tensor_parallel_size > 1` the workers are Ray actors (started on a local Ray if none
    is running); at 1 the worker runs in this process.
    """

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        """`kwargs` are `EngineConfig`'s fields (vLLM's names: `tensor_parallel_size`,
        `max_num_seqs`, `max_model_len`, `dtype`, ...); refused with a ValueError naming the
        field when one is not, or its value is bad. Without `model`, the built default."""
        if model is None:
            from pagedray.tools.default_model import default_model_path

            model = str(default_model_path())
        settings = {"max_num_batched_tokens": OFFLINE_MAX_NUM_BATCHED_TOKENS, **kwargs}
        self.config = validated(EngineConfig, {"model": str(model), **settings})
        from pagedray.engine.engine_factory import build_engine

        make_executor = None  # the one rank in this process
        if not self.config.in_process:  # worker actors: only then is Ray imported
            from pagedray.cluster.ray_executor import executor_factory

            make_executor = executor_factory(self.config)
        # The model is built and stepped on one thread (see workers/compute_thread.py).
        built = compute_thread().run(build_engine, self.config, make_executor)
        self.engine, self.executor, self.tokenizer, self.validator = built
        # Nothing streams out of `generate`: text is decoded once per output, at its end.
        self.output_processor = OutputProcessor(self.tokenizer, stream_text=False)
        self._request_counter = itertools.count()
        self._interrupted = threading.Event()  # set: `_run` stops before its next step
        self._shut_down = False

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` samples with when given no parameters: the model's defaults from its
        generation_config.json (`generation_config="auto"`, as vLLM's; its `max_new_tokens` as
        `max_tokens`) and `override_generation_config` over them, else the neutral ones."""
        return SamplingParams(**self.validator.sampling_defaults)

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in input order.

        A prompt dict may carry "cache_salt" to isolate its prefix-cache entries; `priority`
        (lower first) matters when the engine runs with scheduling_policy="priority".
        `lora_request`: the LoRA adapter of every prompt, or one per prompt (None: the base
        model), with `enable_lora`.

        Raises:
            ValueError: a prompt or parameter is invalid; nothing was queued.
        """
        prompt_list = as_prompt_list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompt_list)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompt_list):
                raise refusal(
                    "sampling_params", f"got {len(params_list)} for {len(prompt_list)} prompts"
                )
        # Validate everything before queueing anything, so a bad prompt allocates nothing.
        validated = [self.validator.validate(p, sp) for p, sp in zip(prompt_list, params_list)]
        thinking_ends = [
            self._thinking_end(p.token_ids, sp) for p, sp in zip(validated, params_list)
        ]
        priorities = list(priority) if priority is not None else [0] * len(validated)
        if len(priorities) != len(validated):
            raise refusal("priority", f"got {len(priorities)} for {len(validated)} prompts")
        adapters = self._lora_names(lora_request, len(validated))
        request_ids = [str(next(self._request_counter)) for _ in validated]
        for request_id, prompt, params, prio, thinking_end, lora_name in zip(
            request_ids, validated, params_list, priorities, thinking_ends, adapters
        ):
            self.engine.add_request(
                EngineRequest(
                    request_id,
                    prompt.token_ids,
                    params,
                    priority=prio,
                    cache_salt=prompt.cache_salt,
                    lora_name=lora_name,
                    thinking_end_token_id=thinking_end,
                    thinking_start_token_id=self._thinking_start,
                )
            )
            self.output_processor.add_request(request_id, prompt.text, prompt.token_ids, params)
        try:
            self._run_on_compute_thread(request_ids, use_tqdm)
        except BaseException:
            self.engine.abort_requests(request_ids)
            for request_id in request_ids:
                self.output_processor.abort(request_id)
            raise
        return [self.output_processor.requests.pop(rid).to_output() for rid in request_ids]

    def _lora_names(
        self, lora_request: LoRARequest | Sequence[LoRARequest | None] | None, num_prompts: int
    ) -> list[str | None]:
        """Each prompt's adapter name, every adapter added to the engine (checked) first."""
        if lora_request is None or isinstance(lora_request, LoRARequest):
            requests: list[LoRARequest | None] = [lora_request] * num_prompts
        else:
            requests = list(lora_request)
            if len(requests) != num_prompts:
                raise refusal("lora_request", f"got {len(requests)} for {num_prompts} prompts")
        for request in {r for r in requests if r is not None}:
            add_adapter(self.engine, self.config, request.lora_name, request.lora_path)
        return [None if r is None else r.lora_name for r in requests]

    def _thinking_end(self, prompt_token_ids: list[int], params: SamplingParams) -> int | None:
        """With `reasoning_parser`, the `</think>` an output of this prompt thinks until, unless
        its prompt closed the thinking: a structured output holds to its grammar after it
        (vLLM's default) and `thinking_token_budget` counts before it. Raises ValueError for a
        budget that cannot be kept (no parser, or no such token)."""
        thinking = self._thinking_tokens
        check_budget(thinking, params.thinking_token_budget)
        return None if thinking is None else thinking.thinking_end(prompt_token_ids)

    @property
    def _thinking_start(self) -> int | None:
        thinking = self._thinking_tokens
        return thinking.start if thinking is not None else None

    @functools.cached_property
    def _thinking_tokens(self) -> ThinkingTokens | None:
        return ThinkingTokens.of(self.tokenizer, self.config.reasoning_parser)

    def chat(
        self,
        messages: list[dict[str, str]] | list[list[dict[str, str]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Apply the tokenizer's chat template to each conversation, then generate."""
        conversations: list[list[dict[str, str]]] = (
            [messages] if messages and isinstance(messages[0], dict) else messages  # type: ignore[assignment]
        )
        prompts = [
            {"prompt_token_ids": self.validator.chat_prompt_token_ids(conversation)}
            for conversation in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm, lora_request=lora_request)

    def stats(self) -> dict[str, float]:
        """KV pool, prefix cache (in tokens), preemption and batch-size statistics."""
        return self.engine.stats()

    def shutdown(self) -> None:
        """Stop the workers; first, with a host KV tier, leave the pool's cached blocks in it
        (the next engine of this model on the node finds them)."""
        if self._shut_down:
            return
        self._shut_down = True
        try:
            compute_thread().run(self.engine.save_cache_to_tier)
        except Exception:  # noqa: BLE001 - a dead rank: nothing to save, and never a new error
            logger.warning("saving the KV cache to the host tier failed", exc_info=True)
        finally:
            self.executor.shutdown()

    def _run_on_compute_thread(self, request_ids: list[str], use_tqdm: bool) -> None:
        """`_run` on the compute thread. Interrupted here (Ctrl-C), it first stops the loop
        between two steps, so that the caller's abort never runs beside a step."""
        self._interrupted.clear()
        if compute_thread().is_current():
            return self._run(request_ids, use_tqdm)
        run = compute_thread().submit(self._run, request_ids, use_tqdm)
        try:
            # NOTE: in slices, since a SIGINT that lands on another thread reaches this one only
            # when it next runs Python code.
            while not futures.wait([run], timeout=INTERRUPT_POLL_S).done:
                pass
            run.result()
        except BaseException:
            self._interrupted.set()
            while not run.done():  # even through a second Ctrl-C: no abort beside a step
                with contextlib.suppress(KeyboardInterrupt):
                    futures.wait([run], timeout=INTERRUPT_POLL_S)
            raise

    def _run(self, request_ids: list[str], use_tqdm: bool) -> None:
        pending = set(request_ids)
        bar = tqdm(total=len(request_ids), desc="Processed prompts", disable=not use_tqdm)
        start, num_output_tokens = time.perf_counter(), 0
        while pending and not self._interrupted.is_set():
            if not self.engine.has_unfinished_requests():
                raise RuntimeError("engine stopped with requests unfinished")
            outputs = self.engine.step()
            deltas, stopped = self.output_processor.process(outputs)
            if stopped:
                self.engine.stop_requests(stopped)
            num_output_tokens += sum(len(d.token_ids) for d in deltas)
            for request_id in {d.request_id for d in deltas if d.finish_reason}:
                state = self.output_processor.requests[request_id]
                if request_id in pending and state.finished:
                    pending.discard(request_id)
                    bar.update(1)
                    elapsed = time.perf_counter() - start
                    bar.set_postfix_str(f"output: {num_output_tokens / elapsed:.1f} toks/s")
        bar.close()
        if pending:
            raise RuntimeError("generate was interrupted")
