"""Builds an engine from the config: the executor first (it learns how many KV blocks fit), then
the scheduler sized with that number, and the tokenizer-side validator."""

from __future__ import annotations

from typing import Any

from transformers import AutoTokenizer

from pagedray.engine.config import EngineConfig
from pagedray.engine.executor import UniProcExecutor
from pagedray.engine.prompts import PromptValidator
from pagedray.scheduler.engine_core import EngineCore
from pagedray.workers.model_config import ModelConfig


def load_tokenizer(config: EngineConfig) -> Any:
    return AutoTokenizer.from_pretrained(config.tokenizer or config.model)


def make_validator(config: EngineConfig, tokenizer: Any, max_model_len: int) -> PromptValidator:
    model_config = ModelConfig.from_pretrained(config.model, config.dtype)
    return PromptValidator(tokenizer, max_model_len, model_config.vocab_size, config.max_num_seqs)


def build_executor(config: EngineConfig, max_model_len: int) -> Any:
    worker_config = config.worker_config(max_model_len)
    if config.tensor_parallel_size == 1 and not config.use_ray_workers:
        return UniProcExecutor(worker_config)
    from pagedray.cluster.ray_executor import RayExecutor

    return RayExecutor(worker_config, dispatch=config.dispatch)


def build_engine(config: EngineConfig) -> tuple[EngineCore, Any, Any, PromptValidator]:
    max_model_len = config.resolved_max_model_len()
    executor = build_executor(config, max_model_len)
    model_config = ModelConfig.from_pretrained(config.model, config.dtype)
    engine = EngineCore(
        config.scheduler_config(max_model_len),
        executor.num_kv_blocks,
        executor,
        eos_token_ids=model_config.eos_token_id,
    )
    tokenizer = load_tokenizer(config)
    return (
        engine,
        executor,
        tokenizer,
        make_validator(config, tokenizer, engine.scheduler.max_model_len),
    )
