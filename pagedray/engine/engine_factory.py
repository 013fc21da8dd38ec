"""Builds an engine from the config: the executor first (it learns how many KV blocks fit), then
the scheduler sized with that number, and the tokenizer-side validator."""

from __future__ import annotations

import functools
import logging
from typing import Any, Callable

from tokenizers import Tokenizer

from pagedray.engine.config import EngineConfig
from pagedray.engine.executor import UniProcExecutor
from pagedray.engine.lora_adapters import configured_adapters, serve_adapters
from pagedray.engine.prompt_validator import PromptValidator
from pagedray.engine.tokenizer_loading import load_tokenizer, make_validator
from pagedray.scheduler.engine_core import EngineCore
from pagedray.scheduler.grammar import StructuredOutputManager
from pagedray.scheduler.host_kv_tier import HostKVTier
from pagedray.scheduler.request_failure import refusal
from pagedray.workers.model_config import ModelConfig
from pagedray.workers.worker_config import WorkerConfig

logger = logging.getLogger(__name__)


def open_tiers(paths: dict[str, str]) -> HostKVTier | None:
    """The scheduler's handle on the KV tiers its ranks opened (`paths` by name): the host
    tier, with the disk tier below it if there is one; None without a host tier."""
    if "host" not in paths:
        return None
    disk = None
    try:
        if "disk" in paths:
            disk = HostKVTier(paths["disk"], name="disk")
        return HostKVTier(paths["host"], lower=disk)
    except (OSError, ValueError) as exc:
        logger.warning("KV tiers off: %s (%s)", paths, exc)
        return None


def structured_output_manager(
    tokenizer: Callable[[], Any], model_config: ModelConfig
) -> StructuredOutputManager:
    """Grammars for structured outputs, over the model's whole logits width and EOS ids; the
    tokenizer (`tokenizer()`) is read by `prepare` in a server, else at the first compile: one
    without a `tokenizers` backend fails it, and such requests are refused."""

    def tokenizer_json() -> str:
        backend = getattr(tokenizer(), "backend_tokenizer", None)
        if backend is None:
            raise refusal("structured_outputs", "the tokenizer has no `tokenizers` backend")
        # NOTE: a copy without padding or truncation, which would change how text tokenizes.
        copy = Tokenizer.from_str(backend.to_str())
        copy.no_padding()
        copy.no_truncation()
        return copy.to_str()

    return StructuredOutputManager(
        tokenizer_json, model_config.vocab_size, model_config.eos_token_id
    )


# Makes the executor that runs the ranks, from their config: `UniProcExecutor` for one rank in
# this process; the Ray executor's (pagedray.cluster.ray_executor.executor_factory) for worker
# actors. Passed in, as the engine sits below Ray's layer and never imports it.
ExecutorFactory = Callable[[WorkerConfig], Any]


def build_engine(
    config: EngineConfig, make_executor: ExecutorFactory | None = None
) -> tuple[EngineCore, Any, Any, PromptValidator]:
    """The engine core (`build_engine_core`), the executor, the tokenizer and the prompt
    validator: what an engine that takes text needs (offline `LLM`, `--no-ray`)."""
    tokenizer = load_tokenizer(config)
    engine, executor = build_engine_core(config, make_executor, lambda: tokenizer)
    max_model_len = engine.scheduler.max_model_len
    return engine, executor, tokenizer, make_validator(config, tokenizer, max_model_len)


def build_engine_core(
    config: EngineConfig,
    make_executor: ExecutorFactory | None = None,
    tokenizer: Callable[[], Any] | None = None,
) -> tuple[EngineCore, Any]:
    """The engine core (its executor first: it learns how many KV blocks fit) and the executor:
    tokens in, tokens out. `make_executor` None: the one rank in this process. `tokenizer` gives
    the grammars' tokenizer; None: loaded when first needed (`StructuredOutputManager.prepare`
    in an engine replica, whose ingress makes the text)."""
    max_model_len = config.resolved_max_model_len()
    if make_executor is None:
        if not config.in_process:
            raise ValueError(
                "tensor_parallel_size: this config runs its ranks as Ray actors; pass the Ray "
                "executor's factory (pagedray.cluster.ray_executor.executor_factory)"
            )
        make_executor = UniProcExecutor
    adapters = configured_adapters(config)
    executor = make_executor(config.worker_config(max_model_len))
    model_config = ModelConfig.from_pretrained(config.model, config.dtype)
    engine = EngineCore(
        config.scheduler_config(max_model_len),
        executor.num_kv_blocks,
        executor,
        eos_token_ids=model_config.eos_token_id,
        structured=structured_output_manager(
            tokenizer or functools.cache(lambda: load_tokenizer(config)), model_config
        ),
        host_tier=open_tiers(getattr(executor, "kv_tiers", {})),
    )
    serve_adapters(engine, config, adapters)
    return engine, executor
