"""Builds an engine from the config: the executor first (it learns how many KV blocks fit), then
the scheduler sized with that number, and the tokenizer-side validator."""

from __future__ import annotations

from typing import Any

from tokenizers import Tokenizer
from transformers import AutoTokenizer

from pagedray.engine.config import EngineConfig
from pagedray.engine.executor import UniProcExecutor
from pagedray.engine.prompts import PromptValidator
from pagedray.scheduler.engine_core import EngineCore
from pagedray.scheduler.grammar import StructuredOutputManager
from pagedray.workers.model_config import ModelConfig


def load_tokenizer(config: EngineConfig) -> Any:
    return AutoTokenizer.from_pretrained(config.tokenizer or config.model)


def make_validator(config: EngineConfig, tokenizer: Any, max_model_len: int) -> PromptValidator:
    model_config = ModelConfig.from_pretrained(config.model, config.dtype)
    return PromptValidator(tokenizer, max_model_len, model_config.vocab_size, config.max_num_seqs)


def structured_output_manager(
    tokenizer: Any, model_config: ModelConfig
) -> StructuredOutputManager | None:
    """Grammars for structured outputs, over the model's whole logits width and EOS ids; None
    for a tokenizer without a `tokenizers` backend (such requests are then refused)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None

    def tokenizer_json() -> str:
        # NOTE: a copy without padding or truncation, which would change how text tokenizes.
        copy = Tokenizer.from_str(backend.to_str())
        copy.no_padding()
        copy.no_truncation()
        return copy.to_str()

    return StructuredOutputManager(
        tokenizer_json, model_config.vocab_size, model_config.eos_token_id
    )


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
    tokenizer = load_tokenizer(config)
    engine = EngineCore(
        config.scheduler_config(max_model_len),
        executor.num_kv_blocks,
        executor,
        eos_token_ids=model_config.eos_token_id,
        structured=structured_output_manager(tokenizer, model_config),
    )
    return (
        engine,
        executor,
        tokenizer,
        make_validator(config, tokenizer, engine.scheduler.max_model_len),
    )
