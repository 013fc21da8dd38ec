"""A served application's settings: the engine's (`EngineConfig`) and the server's own, in one
schema. `pagedray serve`'s flags are made from it, `build_app`'s arguments (Serve config files,
the Helm chart) are validated by it, and the application is built from it (`openai_app.py`).

Ray-free, so the command line reads it without importing Ray. The API key never leaves it: the
ingress is given the key's digest, and the engines an `EngineConfig`, which holds no key.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from pagedray.engine.config import NOT_A_FLAG, EngineConfig, flags
from pagedray.openai.cors import CORSSettings
from pagedray.openai.ingress_guard import DEFAULT_MAX_REQUEST_BODY_BYTES, api_key_sha256_of

# The Responses API's store: responses kept, and seconds each is kept (an hour: OpenAI keeps
# stored responses longer; a client re-sends).
DEFAULT_MAX_RESPONSES = 10_000
DEFAULT_RESPONSES_TTL_S = 3600.0
_SECRETS = {"api_key", "api_key_file", "api_key_sha256"}


class ServerConfig(EngineConfig):
    """An engine's settings, and how the application around its replicas serves them."""

    num_replicas: int = Field(
        1,
        ge=1,
        description="engines (each a tensor-parallel group; vLLM's data parallel size)",
        json_schema_extra=flags("--num-replicas", "--data-parallel-size", "-dp"),
    )
    min_replicas: int | None = Field(
        None, ge=0, description="autoscale the engines on their load, from this many"
    )
    max_replicas: int | None = Field(None, ge=1, description="autoscale up to this many engines")
    num_ingress_replicas: int = Field(
        1,
        ge=1,
        description="HTTP ingress replicas, each listening on the API port itself (more than "
        "1: the kernel shares the port among them, so none is the API's single process; "
        "vLLM's API server count)",
        json_schema_extra=flags("--num-ingress-replicas", "--api-server-count", "-asc"),
    )
    disable_uvicorn_access_log: bool = Field(
        False,
        description="no access line per request in the ingress replicas' logs (vLLM's flag; "
        "Serve writes the lines here)",
    )
    routing: Literal["cache-aware", "power-of-two"] | None = Field(
        None,
        description="how requests pick an engine: by its cached prefix (the default with several "
        "engines) or by load",
    )
    routing_load_threshold: int | None = Field(
        None,
        ge=0,
        description="cache-aware: ongoing requests (each ingress replica's own) by which the "
        "best-matching engine may exceed the least loaded and still be chosen (default 32)",
    )
    routing_tier_weight: float | None = Field(
        None,
        ge=0,
        le=1,
        description="cache-aware: what a prompt block in an engine's node host KV tier counts "
        "for against one in its pool (default 0.75; 0: pools only)",
    )
    routing_disk_weight: float | None = Field(
        None,
        ge=0,
        le=1,
        description="cache-aware: likewise a block in its node's disk KV tier (default 0.25)",
    )
    routing_pull_min_blocks: int | None = Field(
        None,
        ge=0,
        description="cache-aware: sent away from the engine whose pool holds its prefix (load), "
        "a request's engine pulls the blocks from it when it holds this many more (default 32; "
        "0: never)",
    )
    max_request_body_bytes: int = Field(
        DEFAULT_MAX_REQUEST_BODY_BYTES, ge=1, description="larger bodies are refused with 413"
    )
    api_key: str | None = Field(
        None, repr=False, description="required of clients", json_schema_extra=NOT_A_FLAG
    )
    api_key_file: str | None = Field(
        None, description="read the API key from this file (stripped)", json_schema_extra=NOT_A_FLAG
    )
    api_key_sha256: str | None = Field(
        None, description="the API key given as its SHA-256 (hex)", json_schema_extra=NOT_A_FLAG
    )
    allowed_origins: list[str] = Field(
        ["*"],
        description="CORS: origins browsers may send from, a JSON list: '[\"https://a.example\"]'",
        json_schema_extra=flags(json=True),
    )
    allowed_methods: list[str] = Field(
        ["*"],
        description="CORS: methods browsers may use, a JSON list",
        json_schema_extra=flags(json=True),
    )
    allowed_headers: list[str] = Field(
        ["*"],
        description="CORS: headers browsers may send, a JSON list",
        json_schema_extra=flags(json=True),
    )
    allow_credentials: bool = Field(False, description="CORS: let browsers send credentials")
    stuck_after_s: float | None = Field(
        None,
        gt=0,
        description="a step running longer marks its engine unhealthy (default 120)",
        json_schema_extra=NOT_A_FLAG,
    )
    health_check_period_s: float | None = Field(
        None,
        gt=0,
        description="Serve's health check of each engine (default 2)",
        json_schema_extra=NOT_A_FLAG,
    )
    ingress_num_cpus: float = Field(
        0.0,
        ge=0,
        description="CPUs Ray reserves for each ingress replica",
        json_schema_extra=NOT_A_FLAG,
    )
    responses_max_stored: int = Field(
        DEFAULT_MAX_RESPONSES,
        ge=1,
        description="the Responses API: responses kept",
        json_schema_extra=NOT_A_FLAG,
    )
    responses_ttl_s: float = Field(
        DEFAULT_RESPONSES_TTL_S,
        gt=0,
        description="the Responses API: seconds a response is kept",
        json_schema_extra=NOT_A_FLAG,
    )

    @field_validator("allowed_origins", "allowed_methods", "allowed_headers", mode="before")
    @classmethod
    def _json_list(cls, value: Any) -> Any:
        # vLLM's flags, and `serve run key=value`, give the lists as JSON text.
        if isinstance(value, str):
            try:
                return json.loads(value)
            except json.JSONDecodeError:
                raise ValueError(
                    f'must be a JSON list of strings, as ["*"], got {value!r}'
                ) from None
        return value

    @model_validator(mode="after")
    def _consistent(self) -> ServerConfig:
        if self.routing == "cache-aware" and not self.enable_prefix_caching:
            raise ValueError("routing: cache-aware needs prefix caching, which is off")
        autoscaled = self.min_replicas is not None or self.max_replicas is not None
        if autoscaled and not 0 <= self.min_engines <= self.max_engines:
            raise ValueError(
                f"min_replicas: need min_replicas <= max_replicas, got {self.min_engines} and "
                f"{self.max_engines}"
            )
        api_key_sha256_of(self.model_dump(include=_SECRETS))  # one of them, and no empty key
        return self

    @property
    def autoscaled(self) -> bool:
        return self.min_replicas is not None or self.max_replicas is not None

    @property
    def min_engines(self) -> int:
        return self.min_replicas if self.min_replicas is not None else 1

    @property
    def max_engines(self) -> int:
        """The most engines there may be: autoscaling's bound, else the fixed count."""
        if not self.autoscaled:
            return self.num_replicas
        return self.max_replicas if self.max_replicas is not None else max(self.min_engines, 1)

    def resolved_routing(self) -> str:
        """cache-aware where several engines may cache prefixes, else power-of-two."""
        several = self.max_engines > 1 and self.enable_prefix_caching
        return self.routing or ("cache-aware" if several else "power-of-two")

    def engine_config(self) -> EngineConfig:
        """What the engine replicas (and the ingress's tokenizer) are built from: no key."""
        fields = set(EngineConfig.model_fields)
        values = self.model_dump(include=fields)
        values["enable_kv_cache_events"] = self.resolved_routing() == "cache-aware"
        return EngineConfig.model_validate(values)

    def api_key_digest(self) -> str | None:
        return api_key_sha256_of(self.model_dump(include=_SECRETS))

    def cors(self) -> CORSSettings:
        return CORSSettings(
            tuple(self.allowed_origins),
            tuple(self.allowed_methods),
            tuple(self.allowed_headers),
            self.allow_credentials,
        )
