"""The engine's settings, in one schema: `EngineConfig`, built at the edge and passed down frozen.

Every way of setting an engine goes through it: the command line's flags are made from its
fields (pagedray/cli/config_flags.py), `LLM(**kwargs)` and Serve's `build_app` arguments are
validated by it, and a server's settings extend it (`ServerConfig`, cluster/server_config.py).
vLLM's spellings of values are taken where vLLM has the setting (`dtype="half"`,
`max_model_len="32k"`). Values learned at run time (how many KV blocks fit) are never written
back here; the executor returns them and the scheduler is built with them.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from pathlib import Path
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from pagedray.scheduler.config import SchedulerConfig
from pagedray.scheduler.sampling_params import MAX_LOGPROBS
from pagedray.workers.worker_config import WorkerConfig

# Weight and activation dtypes; "auto" is the checkpoint's own.
DType = Literal["auto", "float32", "bfloat16", "float16"]
# vLLM's other names for two of them.
DTYPE_ALIASES = {"half": "float16", "float": "float32"}
# A name that `lora_resolver_dir` may resolve: one plain folder name.
_ADAPTER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_SUFFIXED = re.compile(r"(\d+(?:\.\d+)?)([kKmMgGtT])")
_DECIMAL = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
SliceT = TypeVar("SliceT")
# vLLM's folder of adapters that requests may name (its filesystem LoRA resolver).
LORA_RESOLVER_ENV = "VLLM_LORA_RESOLVER_CACHE_DIR"
# vLLM's switch of the HTTP routes that load and unload adapters at run time.
RUNTIME_LORA_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


def human_readable_int(value: Any) -> Any:
    """A count as vLLM reads one: "2048", "8k" (8,000), "8K" (8,192), "1.5m"; decimals only
    with a decimal (lower-case) suffix. Anything else is left to the field's own validation."""
    if not isinstance(value, str):
        return value
    match = _SUFFIXED.fullmatch(value.strip())
    if match is None:
        return value
    number, suffix = match.groups()
    if suffix in _DECIMAL:
        return int(float(number) * _DECIMAL[suffix])
    if "." in number:
        raise ValueError(f"{value!r}: no decimals with a binary suffix")
    return int(number) * _BINARY[suffix]


def _switched_on(value: Any) -> bool:
    """A boolean setting as pydantic reads it, before it does: "false", "0", "off" are off."""
    if isinstance(value, str):
        return value.strip().lower() in ("1", "true", "t", "yes", "y", "on")
    return bool(value)


def flags(*names: str, choices: tuple[str, ...] = (), json: bool = False) -> dict[str, Any]:
    """A field's command-line spelling (its `json_schema_extra`): the flags that set it, the
    first shown in the help (none given: `--field-name`), values taken beyond its type's (vLLM's
    aliases), and whether a list is given as one JSON text (vLLM's CORS flags)."""
    return {"cli": {"flags": list(names), "choices": list(choices), "json": json}}


# A field that is set from Python or a Serve config, never from the command line.
NOT_A_FLAG: dict[str, Any] = {"cli": None}
POSITIONAL: dict[str, Any] = {"cli": {"positional": True}}


ConfigT = TypeVar("ConfigT", bound=BaseModel)


def validated(schema: type[ConfigT], values: dict[str, Any]) -> ConfigT:
    """`schema` (a settings schema) from `values`; ValueError "field: message" naming the first
    bad field, as every other refusal in pagedray reads."""
    try:
        return schema.model_validate(values)
    except ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(part) for part in first["loc"])
        message = str(first["msg"]).removeprefix("Value error, ")
        raise ValueError(f"{field}: {message}" if field else message) from None


class EngineConfig(BaseModel):
    """Everything one engine (a scheduler and its tensor-parallel workers) is built from."""

    model_config = ConfigDict(frozen=True, extra="forbid", protected_namespaces=())

    model: str = Field(
        description="the checkpoint's directory (Hugging Face format; default: the built model)",
        json_schema_extra=POSITIONAL,
    )
    tokenizer: str | None = Field(
        None, description="the tokenizer's directory (default: the model's)"
    )
    trust_remote_code: bool = Field(
        False,
        description="let the tokenizer (and its config class) run code the checkpoint ships "
        "(an auto_map), as vLLM's; the model runs none either way",
    )
    chat_template: str | None = Field(
        None,
        description="the chat template of chat requests: a Jinja file, or the template itself "
        "(default: the tokenizer's)",
    )
    served_model_name: list[str] | None = Field(
        None,
        min_length=1,
        description="the names clients may send as `model`, the first the one answers report "
        "(default: the model directory's name)",
    )
    tensor_parallel_size: int = Field(
        1,
        ge=1,
        description="ranks (GPUs) of one engine",
        json_schema_extra=flags("--tensor-parallel-size", "-tp"),
    )
    block_size: int = Field(16, ge=1, le=256, description="tokens per KV block")
    enable_prefix_caching: bool = Field(True, description="automatic prefix caching")
    enable_kv_cache_events: bool = Field(
        False,
        description="publish the prefix cache's changes, for a cache-aware router (set by the "
        "server's routing)",
        json_schema_extra=NOT_A_FLAG,
    )
    max_num_seqs: int = Field(256, ge=1, description="sequences in one step")
    max_num_batched_tokens: int = Field(
        2048, ge=1, description="tokens computed in one step (prompt chunks and decodes): 2048, 8k"
    )
    max_model_len: int | None = Field(
        None,
        ge=1,
        description="tokens of prompt and output per sequence: 8192, 32k, or auto (the model's, "
        "capped by what the KV pool holds)",
    )
    num_kv_blocks: int | None = Field(
        None,
        ge=1,
        description="KV blocks per rank (default: as many as the memory budget holds)",
        json_schema_extra=flags("--num-kv-blocks", "--num-gpu-blocks-override"),
    )
    kv_cache_memory_gb: float | None = Field(None, gt=0, description="the KV pool per rank, GiB")
    kv_cache_memory_bytes: int | None = Field(
        None, ge=1, description="the KV pool per rank, bytes (vLLM's spelling: 40G, 8.5g)"
    )
    kv_offloading_size: float | None = Field(
        None,
        ge=0,
        description="GiB of the node's host KV tier, shared by this model's engines on the node: "
        "evicted blocks go there and prefix misses are loaded from it (default: a quarter of "
        "the memory free at start, at most 8; 0: off)",
    )
    kv_disk_dir: str | None = Field(
        None,
        description="a directory for a disk KV tier below the host tier: blocks the host tier "
        "evicts go there, prompts found there load from it, and it outlives restarts",
    )
    kv_disk_gb: float = Field(16.0, gt=0, description="the disk KV tier's size, GiB")
    kv_offloading_write_through: bool = Field(
        False,
        description="save every block to the host KV tier as it is computed, not only when the "
        "pool evicts it: a restarted replica, or one a request migrates to, finds the pool's "
        "blocks too, for one copy of each block (on a CPU with cold memory, 9% of offline "
        "throughput until the tier's memory has been written once)",
    )
    gpu_memory_utilization: float = Field(
        0.9, gt=0, le=1, description="CUDA: the share of device memory a rank may use"
    )
    dtype: DType = Field(
        "auto",
        description="weights and activations (auto: the checkpoint's; vLLM's half and float too)",
        json_schema_extra=flags(choices=tuple(DTYPE_ALIASES)),
    )
    seed: int = Field(0, description="the seed of requests that give none")
    scheduling_policy: Literal["fcfs", "priority"] = Field(
        "fcfs", description="admission order: arrival, or each request's `priority` (lower first)"
    )
    max_num_waiting: int | None = Field(
        None,
        ge=1,
        description="serving: waiting requests beyond which new ones get 503 (default: two "
        "batches, at most the KV blocks); offline, the queue is unbounded",
    )
    request_timeout_s: float = Field(
        600.0,
        ge=0,
        description="serving: seconds a request may take before it is aborted with 504 (0: none)",
        json_schema_extra=flags("--request-timeout"),
    )
    num_threads: int | None = Field(
        None,
        ge=1,
        description="torch threads per rank on a CPU, for every step (default: the cores but one "
        "while a request streams, all while none does)",
    )
    quiet_num_threads: int | None = Field(
        None,
        ge=1,
        description="torch threads per CPU rank for a step in which no request streams",
        json_schema_extra=NOT_A_FLAG,
    )
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="where the ranks run")
    use_ray_workers: bool = Field(
        False,
        description="run even a single rank as a Ray actor, rather than in the engine's process",
        json_schema_extra=NOT_A_FLAG,
    )
    dispatch: Literal["actor", "compiled", "pipe"] = Field(
        "pipe",
        description="how each step reaches the worker actors: named pipes on the node, a Ray "
        "Compiled Graph, or actor calls",
    )
    stream_interval: int = Field(
        1, ge=1, description="streamed responses get a chunk every N tokens (vLLM's)"
    )
    migration_limit: int = Field(
        3,
        ge=0,
        description="served: times a request moves to another engine when its own fails it "
        "(a stream resumes from its tokens; 0: never)",
    )
    migration_max_seq_len: int | None = Field(
        None,
        ge=1,
        description="served: a request whose prompt and delivered tokens exceed this many does "
        "not move (another engine would compute them all again); default: any",
    )
    tool_call_parser: Literal["auto", "hermes", "llama3_json"] = Field(
        "auto", description="how tool_choice auto reads calls from the text (auto: by the template)"
    )
    enable_force_include_usage: bool = Field(
        False,
        description="every streamed response ends with its usage, as if the request set "
        "stream_options.include_usage",
    )
    enable_request_id_headers: bool = Field(
        False,
        description="every answer carries an X-Request-Id header: the request's, else a new one",
    )
    disable_log_stats: bool = Field(
        False,
        description="no periodic stats line (throughput, requests, KV usage, hit rate) in a "
        "serving engine's log; the metrics stay exported",
    )
    enable_log_requests: bool = Field(
        False,
        description="log each request's id and sampling parameters (INFO), its prompt at DEBUG",
    )
    enable_log_outputs: bool = Field(
        False,
        description="with --enable-log-requests: log each choice's text when it ends (INFO), "
        "its token ids at DEBUG",
    )
    enable_log_deltas: bool = Field(
        True, description="with --enable-log-outputs: log each streamed delta's text too"
    )
    max_log_len: int | None = Field(
        None,
        ge=0,
        description="logged prompts and outputs cut to this many characters or token ids "
        "(default: whole)",
    )
    max_logprobs: int = Field(
        MAX_LOGPROBS,
        ge=-1,
        description="the most logprobs (top_logprobs, prompt_logprobs) a request may ask a "
        "token (-1: the whole vocabulary)",
    )
    default_chat_template_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="chat template variables a request does not set in its "
        'chat_template_kwargs, a JSON object such as {"enable_thinking": false}',
        json_schema_extra=flags(json=True),
    )
    reasoning_parser: Literal["deepseek_r1", "deepseek_v3", "qwen3"] | None = Field(
        None,
        description="chat answers give the model's thinking (<think>...</think>) as `reasoning`, "
        "apart from the content",
    )
    generation_config: str = Field(
        "auto",
        description="defaults of the sampling parameters a request leaves unset: auto, from "
        "the model's generation_config.json; vllm, none (temperature 1, no filters or "
        "penalties); or a folder holding a generation_config.json",
    )
    override_generation_config: dict[str, Any] = Field(
        default_factory=dict,
        description="sampling defaults set over the generation config's, a JSON object such as "
        '{"temperature": 0.5}; its max_new_tokens caps every request\'s max_tokens',
        json_schema_extra=flags(json=True),
    )

    enable_lora: bool = Field(
        False, description="serve LoRA adapters (PEFT folders) beside the base model"
    )
    lora_modules: list[str] | None = Field(
        None,
        description="the adapters requests may name as `model`: name=path, or vLLM's JSON "
        '{"name": ..., "path": ...}',
    )
    lora_resolver_dir: str | None = Field(
        None,
        description="a folder of adapter folders: a request whose `model` names one of them "
        "runs with it, loaded when first named (vLLM's VLLM_LORA_RESOLVER_CACHE_DIR, read "
        "when this is unset)",
    )
    allow_runtime_lora_updating: bool = Field(
        False,
        description="POST /v1/load_lora_adapter and /v1/unload_lora_adapter link and unlink "
        "adapters in --lora-resolver-dir at run time (vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING, "
        "read when this is unset); whoever holds the API key may then have the server read any "
        "folder it can",
    )
    max_loras: int = Field(1, ge=1, description="LoRA adapters in one step (device slots)")
    max_lora_rank: int = Field(16, ge=1, description="the largest LoRA rank an adapter may have")

    @field_validator("served_model_name", mode="before")
    @classmethod
    def _one_name_is_a_list(cls, value: Any) -> Any:
        # Serve config files, the Helm chart and `build_app` give one name as a string.
        if isinstance(value, str):
            return [value] if value else None
        return value

    @field_validator("chat_template")
    @classmethod
    def _template_text(cls, value: str | None) -> str | None:
        # A file is read where the settings are made (the CLI, build_app), so its text travels
        # with them to every replica, on any node. Text holding a Jinja character ({, } or a
        # newline) is a template: vLLM's rule, and what keeps the text itself a template when a
        # replica validates the settings again (it is never taken for a file name there).
        if value is None or value in ("", "None"):
            return None
        if any(char in value for char in "{}\n"):
            return value
        path = Path(value).expanduser()
        try:
            return path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as error:
            message = f"{value!r} looks like a path, but it cannot be read: {error}"
            raise ValueError(message) from None

    @field_validator("override_generation_config", "default_chat_template_kwargs", mode="before")
    @classmethod
    def _json_object(cls, value: Any) -> Any:
        # vLLM's flag, and `serve run key=value`, give the object as JSON text.
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError:
                raise ValueError(
                    f'must be a JSON object, as {{"temperature": 0.5}}, got {value!r}'
                ) from None
        return value

    @field_validator("dtype", mode="before")
    @classmethod
    def _vllm_dtype_names(cls, value: Any) -> Any:
        return DTYPE_ALIASES.get(value, value) if isinstance(value, str) else value

    @field_validator("max_model_len", mode="before")
    @classmethod
    def _max_model_len(cls, value: Any) -> Any:
        if value == -1 or (isinstance(value, str) and value.strip().lower() in ("auto", "-1")):
            return None  # vLLM's: the model's own
        return human_readable_int(value)

    @field_validator("max_num_batched_tokens", "kv_cache_memory_bytes", mode="before")
    @classmethod
    def _counts(cls, value: Any) -> Any:
        return human_readable_int(value)

    @model_validator(mode="after")
    def _one_kv_budget(self) -> EngineConfig:
        if self.kv_cache_memory_gb is not None and self.kv_cache_memory_bytes is not None:
            raise ValueError("kv_cache_memory_bytes: give it or kv_cache_memory_gb, not both")
        return self

    @field_validator("default_chat_template_kwargs")
    @classmethod
    def _template_variables(cls, value: dict[str, Any]) -> dict[str, Any]:
        from pagedray.engine.chat_tokens import reserved_template_kwarg

        reason = reserved_template_kwarg(value)
        if reason is not None:
            raise ValueError(reason)
        return value

    @field_validator("lora_modules", mode="before")
    @classmethod
    def _lora_module_texts(cls, value: Any) -> Any:
        # vLLM's flag takes name=path or a JSON object; a Serve config or Helm gives objects.
        if isinstance(value, (str, dict)):
            value = [value]
        if not isinstance(value, list):
            return value
        texts = []
        for item in value:
            if isinstance(item, str) and item.lstrip().startswith("{"):
                try:
                    item = json.loads(item)
                except json.JSONDecodeError:
                    raise ValueError(f"{item!r} is not a JSON object") from None
            if isinstance(item, dict):
                name, path = item.get("name"), item.get("path")
                if not isinstance(name, str) or not isinstance(path, str):
                    raise ValueError(f"{item!r}: an adapter needs a name and a path")
                item = f"{name}={path}"
            if isinstance(item, str) and "=" in item:
                # Made absolute where the settings are made (the CLI): a replica's working
                # directory is not the command's.
                name, _, path = item.partition("=")
                item = f"{name}={os.path.abspath(os.path.expanduser(path)) if path else ''}"
            texts.append(item)
        return texts

    @field_validator("lora_resolver_dir")
    @classmethod
    def _absolute_folder(cls, value: str | None) -> str | None:
        return None if not value else os.path.abspath(os.path.expanduser(value))

    @model_validator(mode="before")
    @classmethod
    def _vllm_lora_environment(cls, values: Any) -> Any:
        # vLLM's filesystem resolver reads its folder from the environment, and its routes
        # that load adapters at run time are switched on there (here they link into it).
        if not isinstance(values, dict) or not _switched_on(values.get("enable_lora")):
            return values
        folder = os.environ.get(LORA_RESOLVER_ENV)
        if values.get("lora_resolver_dir") is None and folder:
            values = {**values, "lora_resolver_dir": folder}
        allowed = _switched_on(os.environ.get(RUNTIME_LORA_ENV, ""))
        if values.get("allow_runtime_lora_updating") is None and allowed:
            runtime = bool(values.get("lora_resolver_dir"))
            values = {**values, "allow_runtime_lora_updating": runtime}
        return values

    @model_validator(mode="after")
    def _lora_adapters(self) -> EngineConfig:
        for name in ("lora_modules", "lora_resolver_dir", "allow_runtime_lora_updating"):
            if getattr(self, name) and not self.enable_lora:
                raise ValueError(f"{name}: requires enable_lora")
        if self.allow_runtime_lora_updating and self.lora_resolver_dir is None:
            raise ValueError(
                "allow_runtime_lora_updating: requires lora_resolver_dir (the folder it links "
                "adapters into, which every replica reads)"
            )
        names = set(self.served_names())
        for name in self.lora_adapters():
            if name in names:
                raise ValueError(f"lora_modules: {name!r} is already a model name")
            names.add(name)
        return self

    def resolvable_name(self, name: str) -> str | None:
        """The path `name` names in `lora_resolver_dir`; None for a name that could leave it
        (one plain folder name only), or without one."""
        if self.lora_resolver_dir is None or not _ADAPTER_NAME.fullmatch(name) or ".." in name:
            return None
        return str(Path(self.lora_resolver_dir) / name)

    def resolvable_lora(self, name: str) -> str | None:
        """The folder of `lora_resolver_dir` that `name` names, if it holds an adapter; None
        for any other name (one that could leave the folder is no adapter's)."""
        path = self.resolvable_name(name)
        if path is None:
            return None
        folder = Path(path)
        try:
            return str(folder) if (folder / "adapter_config.json").is_file() else None
        except OSError:  # unreadable here: no adapter this server can serve
            return None

    def lora_adapters(self) -> dict[str, str]:
        """name -> path of each adapter given by `lora_modules`."""
        adapters = {}
        for text in self.lora_modules or []:
            name, equals, path = text.partition("=")
            if not equals or not name or not path:
                raise ValueError(f"lora_modules: {text!r} is not name=path")
            adapters[name] = path
        return adapters

    @model_validator(mode="after")
    def _outputs_logged_with_requests(self) -> EngineConfig:
        if self.enable_log_outputs and not self.enable_log_requests:
            raise ValueError("enable_log_outputs: requires enable_log_requests (as vLLM's)")
        return self

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
        """The scheduler's slice (a plain dataclass: the scheduler has no pydantic)."""
        return self._slice(SchedulerConfig, max_model_len=max_model_len)

    def worker_config(self, max_model_len: int) -> WorkerConfig:
        """What each rank is built from."""
        budget = self.kv_cache_memory_gb
        if self.kv_cache_memory_bytes is not None:
            budget = self.kv_cache_memory_bytes / 2**30
        return self._slice(WorkerConfig, max_model_len=max_model_len, kv_cache_memory_gb=budget)

    def _slice(self, config_class: type[SliceT], **resolved: Any) -> SliceT:
        """`config_class` with the fields of the same names, and what run time `resolved`."""
        names = {field.name for field in dataclasses.fields(config_class)}  # type: ignore[arg-type]
        values = {name: getattr(self, name) for name in names - set(resolved)}
        return config_class(**values, **resolved)
