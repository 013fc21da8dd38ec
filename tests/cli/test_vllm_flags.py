"""vLLM's spellings of every flag `pagedray serve` and `pagedray generate` share with it
(vllm/engine/arg_utils.py, vllm/entrypoints/openai/cli_args.py) parse, and their values reach
the app's arguments and the engine's config as vLLM means them: `--dtype half`,
`--enable-prefix-caching`, `--max-model-len 32k`, `--served-model-name a b` (two names), ..."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest

from pagedray.cli.config_flags import add_config_flags, config_values
from pagedray.cli.serve import add_serve_parser, serve_app_args
from pagedray.cluster.server_config import ServerConfig
from pagedray.engine.config import EngineConfig, human_readable_int, validated
from pagedray.openai.cors import CORSSettings

MODEL = "/models/tiny-llama"
ABSENT = object()  # the flag leaves the argument to its default (absent from the app's args)

# (vLLM's command line after the model, the `build_app` argument it sets, its value)
SPELLINGS: list[tuple[list[str], str, Any]] = [
    (["--tensor-parallel-size", "2"], "tensor_parallel_size", 2),
    (["-tp", "2"], "tensor_parallel_size", 2),
    (["--dtype", "auto"], "dtype", "auto"),
    (["--dtype", "half"], "dtype", "float16"),
    (["--dtype", "float16"], "dtype", "float16"),
    (["--dtype", "bfloat16"], "dtype", "bfloat16"),
    (["--dtype", "float"], "dtype", "float32"),
    (["--dtype", "float32"], "dtype", "float32"),
    (["--enable-prefix-caching"], "enable_prefix_caching", True),
    (["--no-enable-prefix-caching"], "enable_prefix_caching", False),
    (["--max-model-len", "4096"], "max_model_len", 4096),
    (["--max-model-len", "32k"], "max_model_len", 32_000),
    (["--max-model-len", "32K"], "max_model_len", 32_768),
    (["--max-model-len", "25.6k"], "max_model_len", 25_600),
    (["--max-model-len", "auto"], "max_model_len", ABSENT),
    (["--max-model-len", "-1"], "max_model_len", ABSENT),
    (["--max-num-batched-tokens", "8k"], "max_num_batched_tokens", 8_000),
    (["--max-num-batched-tokens", "512"], "max_num_batched_tokens", 512),
    (["--max-num-seqs", "8"], "max_num_seqs", 8),
    (["--block-size", "32"], "block_size", 32),
    (["--seed", "7"], "seed", 7),
    (["--scheduling-policy", "priority"], "scheduling_policy", "priority"),
    (["--gpu-memory-utilization", "0.5"], "gpu_memory_utilization", 0.5),
    (["--num-gpu-blocks-override", "64"], "num_kv_blocks", 64),
    (["--kv-cache-memory-bytes", "2G"], "kv_cache_memory_bytes", 2 * 2**30),
    (["--stream-interval", "4"], "stream_interval", 4),
    (["--served-model-name", "tiny"], "served_model_name", ["tiny"]),
    (["--served-model-name", "tiny", "tiny-alias"], "served_model_name", ["tiny", "tiny-alias"]),
    (["--generation-config", "vllm"], "generation_config", "vllm"),
    (["--generation-config", "/models/tuned"], "generation_config", "/models/tuned"),
    (
        ["--override-generation-config", '{"temperature": 0.5, "max_new_tokens": 64}'],
        "override_generation_config",
        {"temperature": 0.5, "max_new_tokens": 64},
    ),
    (["--chat-template", "{{ messages }}"], "chat_template", "{{ messages }}"),
    (["--tool-call-parser", "hermes"], "tool_call_parser", "hermes"),
    (["--tool-call-parser", "llama3_json"], "tool_call_parser", "llama3_json"),
    (["--enable-auto-tool-choice"], "tool_call_parser", ABSENT),  # always on here
    (["--enable-chunked-prefill"], "enable_chunked_prefill", ABSENT),  # always on here
    (["--enforce-eager"], "enforce_eager", ABSENT),  # always eager here
    (["--disable-log-requests"], "disable_log_requests", ABSENT),  # the default
    (["--enable-log-requests"], "enable_log_requests", True),
    (["--no-enable-log-requests"], "enable_log_requests", False),
    (["--enable-log-requests", "--enable-log-outputs"], "enable_log_outputs", True),
    (
        ["--enable-log-requests", "--enable-log-outputs", "--no-enable-log-deltas"],
        "enable_log_deltas",
        False,
    ),
    (["--max-log-len", "100"], "max_log_len", 100),
    (["--disable-log-stats"], "disable_log_stats", True),
    (["--enable-force-include-usage"], "enable_force_include_usage", True),
    (["--enable-prompt-tokens-details"], "enable_prompt_tokens_details", ABSENT),  # always
    (["--kv-cache-dtype", "auto"], "kv_cache_dtype", ABSENT),  # the model's, always
    (["-pp", "1"], "pipeline_parallel_size", ABSENT),  # one stage, always
    (["--pipeline-parallel-size", "1"], "pipeline_parallel_size", ABSENT),
    (["--distributed-executor-backend", "ray"], "distributed_executor_backend", ABSENT),
    (["--api-server-count", "2"], "num_ingress_replicas", 2),
    (["-asc", "3"], "num_ingress_replicas", 3),
    (["--disable-uvicorn-access-log"], "disable_uvicorn_access_log", True),
    (["--enable-request-id-headers"], "enable_request_id_headers", True),
    (["--max-logprobs", "50"], "max_logprobs", 50),
    (["--max-logprobs", "-1"], "max_logprobs", -1),
    (["--reasoning-parser", "deepseek_r1"], "reasoning_parser", "deepseek_r1"),
    (["--reasoning-parser", "qwen3"], "reasoning_parser", "qwen3"),
    (["--reasoning-parser", "deepseek_v3"], "reasoning_parser", "deepseek_v3"),
    (
        ["--default-chat-template-kwargs", '{"enable_thinking": false}'],
        "default_chat_template_kwargs",
        {"enable_thinking": False},
    ),
    (["--data-parallel-size", "2"], "num_replicas", 2),
    (["-dp", "3"], "num_replicas", 3),
    (["--trust-remote-code"], "trust_remote_code", True),
    (["--no-trust-remote-code"], "trust_remote_code", False),
    (["--api-key", "sk-1"], "api_key", "sk-1"),
    (["--allowed-origins", '["https://app.example"]'], "allowed_origins", ["https://app.example"]),
    (["--allowed-methods", '["GET", "POST"]'], "allowed_methods", ["GET", "POST"]),
    (["--allowed-headers", '["Authorization"]'], "allowed_headers", ["Authorization"]),
    (["--allow-credentials"], "allow_credentials", True),
    (["--no-allow-credentials"], "allow_credentials", False),
    (["--enable-lora"], "enable_lora", True),
    (["--enable-lora", "--max-loras", "4"], "max_loras", 4),
    (["--enable-lora", "--max-lora-rank", "64"], "max_lora_rank", 64),
    (
        ["--enable-lora", "--lora-modules", "sql=/lora/sql", '{"name": "chat", "path": "/lora/c"}'],
        "lora_modules",
        ["sql=/lora/sql", "chat=/lora/c"],
    ),
]


def test_lora_settings_as_vllm_s(monkeypatch: pytest.MonkeyPatch) -> None:
    config = validated(
        EngineConfig,
        {"model": MODEL, "enable_lora": True, "lora_modules": [{"name": "a", "path": "/l/a"}]},
    )
    assert config.lora_adapters() == {"a": "/l/a"} and config.lora_resolver_dir is None
    # A relative folder is made absolute where the settings are made: replicas run elsewhere.
    relative = validated(EngineConfig, {"model": MODEL, "enable_lora": True, "lora_modules": "a=r"})
    assert relative.lora_adapters() == {"a": str(Path("r").absolute())}
    # vLLM's filesystem resolver's folder, from its environment variable, with LoRA on only.
    monkeypatch.setenv("VLLM_LORA_RESOLVER_CACHE_DIR", "/loras")
    assert validated(EngineConfig, {"model": MODEL, "enable_lora": True}).lora_resolver_dir == (
        "/loras"
    )
    assert validated(EngineConfig, {"model": MODEL}).lora_resolver_dir is None
    # `serve run ... enable_lora=false` gives text: off, so the environment is not read.
    assert (
        validated(EngineConfig, {"model": MODEL, "enable_lora": "false"}).lora_resolver_dir is None
    )
    # vLLM's switch of the run-time routes: on where there is a folder to link adapters into.
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")
    lora_on = {"model": MODEL, "enable_lora": True}
    assert validated(EngineConfig, lora_on).allow_runtime_lora_updating
    monkeypatch.delenv("VLLM_LORA_RESOLVER_CACHE_DIR")
    assert not validated(EngineConfig, lora_on).allow_runtime_lora_updating
    with pytest.raises(ValueError, match="allow_runtime_lora_updating: requires lora_resolver"):
        validated(EngineConfig, {**lora_on, "allow_runtime_lora_updating": True})
    refusals = [
        ({"lora_modules": ["a=/l/a"]}, "lora_modules: requires enable_lora"),
        ({"enable_lora": True, "lora_modules": ["a"]}, "lora_modules: 'a' is not name=path"),
        ({"enable_lora": True, "lora_modules": [f"{Path(MODEL).name}=/l"]}, "already a model"),
        ({"enable_lora": True, "lora_modules": ['{"name": 1}']}, "needs a name and a path"),
    ]
    for values, message in refusals:
        with pytest.raises(ValueError, match=message):
            validated(EngineConfig, {"model": MODEL, **values})


def _serve(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["serve", *argv])


@pytest.mark.parametrize(("flags", "name", "value"), SPELLINGS, ids=lambda x: repr(x))
def test_each_vllm_spelling_reaches_the_app_args(flags: list[str], name: str, value: Any) -> None:
    # NOTE: the model first, as vLLM's `--served-model-name a b MODEL` would name MODEL too.
    app_args = serve_app_args(_serve([MODEL, *flags]))
    assert app_args["model"] == MODEL
    assert app_args.get(name, ABSENT) == value
    engine_args = {key: v for key, v in app_args.items() if key in EngineConfig.model_fields}
    config = validated(EngineConfig, engine_args)  # the engine takes them as they are
    if name in EngineConfig.model_fields and value is not ABSENT:
        assert getattr(config, name) == value


def test_the_engine_flags_mean_the_same_offline() -> None:
    parser = argparse.ArgumentParser()
    add_config_flags(parser, EngineConfig)
    flags = ["--dtype", "half", "--no-enable-prefix-caching", "--max-model-len", "2k"]
    given = config_values(
        parser.parse_args([MODEL, *flags, "--gpu-memory-utilization", "0.8"]), EngineConfig
    )
    config = validated(EngineConfig, given)  # what `LLM(**given)` is built from
    assert (config.dtype, config.enable_prefix_caching) == ("float16", False)
    assert (config.max_model_len, config.gpu_memory_utilization) == (2000, 0.8)
    assert config_values(parser.parse_args([]), EngineConfig) == {}  # the schema's defaults stand
    assert config.worker_config(2000).kv_cache_memory_gb is None
    in_bytes = validated(EngineConfig, {"model": MODEL, "kv_cache_memory_bytes": "2G"})
    assert in_bytes.worker_config(2000).kv_cache_memory_gb == 2.0


def _serve_options() -> dict[str, str]:
    """`pagedray serve`'s options, by the setting each sets (its dest)."""
    parser = argparse.ArgumentParser()
    commands = parser.add_subparsers(dest="command")
    add_serve_parser(commands)
    return {
        a.dest: a.option_strings[0] for a in commands.choices["serve"]._actions if a.option_strings
    }


def test_every_setting_is_a_flag_or_says_why_not() -> None:
    """One schema: each field of the server's settings is a `pagedray serve` flag, but for those
    set from Python or a Serve config (the API key has flags of its own, fed from a file or the
    environment too)."""
    not_flags = {
        name
        for name, field in ServerConfig.model_fields.items()
        if isinstance(field.json_schema_extra, dict)
        and field.json_schema_extra.get("cli", {}) is None
    }
    assert not_flags == {
        "enable_kv_cache_events", "quiet_num_threads", "use_ray_workers", "api_key",
        "api_key_file", "api_key_sha256", "stuck_after_s", "health_check_period_s",
        "ingress_num_cpus", "responses_max_stored", "responses_ttl_s",
    }  # fmt: skip
    options = _serve_options()
    for name in set(ServerConfig.model_fields) - not_flags - {"model"}:
        assert name in options, f"{name} has no flag"
    assert options["request_timeout_s"] == "--request-timeout"  # the flag's own name


def test_two_served_names_the_first_reported() -> None:
    config = EngineConfig(model=MODEL, served_model_name=["a", "b"])
    assert config.served_names() == ["a", "b"] and config.served_name() == "a"
    # One name as a string (Serve config files, the Helm chart, `build_app` args) is one name.
    assert EngineConfig(model=MODEL, served_model_name="a").served_names() == ["a"]
    assert EngineConfig(model=MODEL).served_names() == ["tiny-llama"]


def test_values_vllm_refuses_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    for flags in (
        ["--dtype", "fp8"],
        ["--max-model-len", "1.5K"],  # no decimals with a binary suffix, as vLLM
        ["--allowed-origins", "*"],  # a JSON list, as vLLM's
        ["--kv-cache-memory-gb", "1", "--kv-cache-memory-bytes", "1G"],
        ["--enable-log-outputs"],  # without --enable-log-requests, as vLLM refuses it
        ["--max-log-len", "-1"],
        ["--kv-cache-dtype", "fp8"],  # no fp8 KV cache here
        ["-pp", "2"],  # no pipeline parallelism here
        ["--distributed-executor-backend", "mp"],
        ["--reasoning-parser", "granite"],  # not one of this server's
    ):
        with pytest.raises(SystemExit):  # by the parser, or by the settings' schema
            serve_app_args(_serve([MODEL, *flags]))
    with pytest.raises(SystemExit, match="one --api-key"):
        serve_app_args(_serve([MODEL, "--api-key", "a", "b"]))
    assert human_readable_int("1m") == 1_000_000 and human_readable_int("1M") == 2**20


def test_cors_defaults_are_vllms_and_build_app_takes_json_text() -> None:
    def cors(**given: Any) -> CORSSettings:
        return validated(ServerConfig, {"model": MODEL, **given}).cors()

    assert cors() == CORSSettings(("*",), ("*",), ("*",), False)
    settings = cors(allowed_origins='["https://a.example"]', allow_credentials="true")
    assert settings.allowed_origins == ("https://a.example",) and settings.allow_credentials
    assert cors(allowed_methods=["GET"]).allowed_methods == ("GET",)
    with pytest.raises(ValueError, match="^allowed_headers: .*JSON list"):
        cors(allowed_headers="Authorization")
    with pytest.raises(ValueError, match="^allow_credentials: "):
        cors(allow_credentials="maybe")


@pytest.mark.parametrize("command", ["serve", "generate", "make-model", "dashboard"])
def test_every_command_prints_its_help(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    """argparse reads each flag's help as a %-format: a description with a bare "%" (one did
    have "9% of offline throughput") must not break `--help`."""
    from pagedray.cli.main import main

    with pytest.raises(SystemExit) as exit_info:
        main([command, "--help"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: pagedray {command}")
