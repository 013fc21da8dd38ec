"""The one frozen config tree, built at the edge (CLI, `LLM`, Serve app) and passed down.

Values learned at run time (how many KV blocks fit) are never written back here; the executor
returns them and the scheduler is built with them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from pagedray.scheduler.config import SchedulerConfig
from pagedray.workers.worker_config import WorkerConfig

# Weight and activation dtypes; "auto" is the checkpoint's own.
DType = Literal["auto", "float32", "bfloat16", "float16"]


class EngineConfig(BaseModel):
    """Everything one engine (a scheduler and its tensor-parallel workers) is built from."""

    model_config = ConfigDict(frozen=True, extra="forbid", protected_namespaces=())

    model: str  # HF checkpoint directory
    tokenizer: str | None = None  # defaults to the model directory
    # The names clients may send as `model` (vLLM's `--served-model-name a b`); the first is the
    # one answers and metrics report. One string is one name; None = the directory name.
    served_model_name: list[str] | None = Field(None, min_length=1)
    tensor_parallel_size: int = Field(1, ge=1)
    block_size: int = Field(16, ge=1, le=256)
    enable_prefix_caching: bool = True
    # The prefix cache's changes as deltas, for a cache-aware router (vLLM's KV cache events).
    enable_kv_cache_events: bool = False
    max_num_seqs: int = Field(256, ge=1)
    max_num_batched_tokens: int = Field(2048, ge=1)
    max_model_len: int | None = Field(None, ge=1)  # None = the model's maximum
    num_kv_blocks: int | None = Field(None, ge=1)  # None = sized from memory
    kv_cache_memory_gb: float | None = Field(None, gt=0)
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    dtype: DType = "auto"
    seed: int = 0
    scheduling_policy: Literal["fcfs", "priority"] = "fcfs"
    # Serving: beyond this many waiting requests new ones are refused (503); None = sized from
    # max_num_seqs and the KV pool (see admission.default_max_num_waiting). Offline `LLM`
    # queues without bound.
    max_num_waiting: int | None = Field(None, ge=1)
    # Serving: a request still unfinished this many seconds after it arrived is aborted (504)
    # and its KV blocks freed; 0 = no deadline.
    request_timeout_s: float = Field(600.0, ge=0)
    num_threads: int | None = Field(None, ge=1)  # torch threads per worker on CPU
    # Serving on CPU: torch threads per worker for a step in which no request streams (the
    # cores otherwise left to the serving path; workers/cpu_threads.py). None: `num_threads`.
    quiet_num_threads: int | None = Field(None, ge=1)
    device: Literal["auto", "cpu", "cuda"] = "auto"
    use_ray_workers: bool = False  # run even a single rank as a Ray actor (the serving path)
    # How a step reaches the worker actors: named pipes on the node, a Ray Compiled Graph, or
    # plain actor calls (see cluster/ray_executor.py).
    dispatch: Literal["actor", "compiled", "pipe"] = "pipe"
    # A streamed request gets a message once this many tokens have accumulated (the first token
    # and the finish at once), as vLLM's --stream-interval: fewer, larger messages through Serve.
    stream_interval: int = Field(1, ge=1)
    # How `tool_choice="auto"` reads calls out of the text (vLLM's --tool-call-parser); "auto"
    # picks by the chat template: <tool_call> blocks (Hermes, Qwen) or Llama 3's JSON calls.
    tool_call_parser: Literal["auto", "hermes", "llama3_json"] = "auto"

    @field_validator("served_model_name", mode="before")
    @classmethod
    def _one_name_is_a_list(cls, value: Any) -> Any:
        # Serve config files, the Helm chart and `build_app` give one name as a string.
        if isinstance(value, str):
            return [value] if value else None
        return value

    @property
    def in_process(self) -> bool:
        """Whether its one rank runs in the engine's own process, rather than as Ray actors."""
        return self.tensor_parallel_size == 1 and not self.use_ray_workers

    def served_names(self) -> list[str]:
        """Every name clients may send as `model`, `served_name()` first."""
        return list(self.served_model_name or [Path(self.model).name])

    def served_name(self) -> str:
        """The name answers report as `model` (vLLM's first served name) and every metric's
        `model_name` tag."""
        return self.served_names()[0]

    def resolved_max_model_len(self) -> int:
        """The model's context limit, lowered by `max_model_len` and any sliding window."""
        # NOTE: imported here: the model's config brings torch, which a process that only
        # parses flags or drives Ray (`pagedray serve`'s own) should not spend seconds loading.
        from pagedray.workers.model_config import ModelConfig

        model_config = ModelConfig.from_pretrained(self.model, self.dtype)
        limit = model_config.max_position_embeddings
        if model_config.sliding_window is not None:
            limit = min(limit, model_config.sliding_window)
        if self.max_model_len is not None:
            if self.max_model_len > limit:
                raise ValueError(
                    f"max_model_len: {self.max_model_len} exceeds the model's limit of {limit}"
                )
            limit = self.max_model_len
        return limit

    def scheduler_config(self, max_model_len: int) -> SchedulerConfig:
        return SchedulerConfig(
            max_model_len=max_model_len,
            block_size=self.block_size,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            enable_prefix_caching=self.enable_prefix_caching,
            policy=self.scheduling_policy,
            record_kv_events=self.enable_kv_cache_events,
            max_num_waiting=self.max_num_waiting,
        )

    def worker_config(self, max_model_len: int) -> WorkerConfig:
        return WorkerConfig(
            model=self.model,
            dtype=self.dtype,
            tensor_parallel_size=self.tensor_parallel_size,
            block_size=self.block_size,
            max_num_seqs=self.max_num_seqs,
            max_model_len=max_model_len,
            num_kv_blocks=self.num_kv_blocks,
            kv_cache_memory_gb=self.kv_cache_memory_gb,
            gpu_memory_utilization=self.gpu_memory_utilization,
            seed=self.seed,
            num_threads=self.num_threads,
            quiet_num_threads=self.quiet_num_threads,
            device=self.device,
        )
