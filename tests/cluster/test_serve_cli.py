"""`pagedray serve` flags and the engine deployment's options, without starting anything."""

from __future__ import annotations

import argparse

from ray.serve import Application

from pagedray.cli.serve import add_serve_parser, local_thread_counts, serve_app_args, serve_settings
from pagedray.cluster.engine_deployment import _with_serving_threads, engine_deployment_options
from pagedray.cluster.openai_app import build_app
from pagedray.engine.config import EngineConfig
from pagedray.workers.cpu_threads import (
    quiet_threads_per_rank,
    serving_thread_counts,
    serving_threads_per_rank,
)


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["serve", *argv])


def test_flags_become_app_args(tiny_llama: str) -> None:
    args = _parse(
        [
            tiny_llama,
            "-tp",
            "2",
            "--num-replicas",
            "3",
            "--api-key",
            "k",
            "--max-num-seqs",
            "8",
            "--block-size",
            "32",
            "--num-kv-blocks",
            "100",
            "--max-num-batched-tokens",
            "512",
            "--port",
            "9000",
            "--address",
            "auto",
            "--stream-interval",
            "8",
        ]
    )
    app_args = serve_app_args(args)
    assert app_args["model"] == tiny_llama
    assert (app_args["tensor_parallel_size"], app_args["num_replicas"]) == (2, 3)
    assert (app_args["block_size"], app_args["num_kv_blocks"], app_args["max_num_seqs"]) == (
        32,
        100,
        8,
    )
    assert app_args["max_num_batched_tokens"] == 512 and app_args["api_key"] == "k"
    assert app_args["stream_interval"] == 8
    assert (args.host, args.port, args.address) == ("127.0.0.1", 9000, "auto")
    assert isinstance(build_app(app_args), Application)


def test_no_model_means_the_default() -> None:
    args = _parse([])
    assert "model" not in serve_app_args(args)  # build_app then serves default_model_path()
    assert "stream_interval" not in serve_app_args(args)  # EngineConfig's default, 1


def test_each_replica_reserves_its_tp_group(tiny_llama: str) -> None:
    config = EngineConfig(model=tiny_llama, tensor_parallel_size=2, device="cpu")
    options = engine_deployment_options(config, num_replicas=2)
    assert options["placement_group_bundles"] == [{"CPU": 1}] * 3
    assert options["placement_group_strategy"] == "STRICT_PACK"
    assert options["num_replicas"] == 2
    scaled = engine_deployment_options(config, autoscaling_config={"min_replicas": 1})
    assert "num_replicas" not in scaled and scaled["autoscaling_config"] == {"min_replicas": 1}
    in_process = EngineConfig(model=tiny_llama, use_ray_workers=False, device="cpu")
    assert engine_deployment_options(in_process)["placement_group_bundles"] == [{"CPU": 1}]


def test_admission_flags(tiny_llama: str) -> None:
    args = _parse(
        [tiny_llama, "--request-timeout", "0", "--scheduling-policy", "priority"]
        + ["--max-num-waiting", "7"]
    )
    app_args = serve_app_args(args)
    assert (app_args["request_timeout_s"], app_args["scheduling_policy"]) == (0.0, "priority")
    engine_args = {k: v for k, v in app_args.items() if k in EngineConfig.model_fields}
    config = EngineConfig.model_validate(engine_args)
    assert (config.request_timeout_s, config.max_num_waiting) == (0.0, 7)  # 0: no deadline
    assert EngineConfig(model=tiny_llama).request_timeout_s == 600.0


def test_local_threads_leave_a_core_to_the_serving_path(tiny_llama: str) -> None:
    assert local_thread_counts(serve_settings(_parse([tiny_llama]))) == {
        "num_threads": serving_threads_per_rank(1),
        "quiet_num_threads": quiet_threads_per_rank(1),
    }
    two_engines = _parse([tiny_llama, "--num-replicas", "2", "-tp", "2"])
    assert local_thread_counts(serve_settings(two_engines)) == serving_thread_counts(4)
    autoscaled = _parse([tiny_llama, "--min-replicas", "1", "--max-replicas", "3"])
    assert local_thread_counts(serve_settings(autoscaled)) == serving_thread_counts(3)
    at_least_two = _parse([tiny_llama, "--min-replicas", "2"])  # build_app deploys 2..2
    assert local_thread_counts(serve_settings(at_least_two)) == serving_thread_counts(2)
    assert local_thread_counts(serve_settings(_parse([tiny_llama, "--num-threads", "5"]))) == {}
    assert local_thread_counts(serve_settings(_parse([tiny_llama, "--device", "cuda"]))) == {}


def test_an_engine_replica_without_threads_leaves_a_core_to_serving(tiny_llama: str) -> None:
    """What a Serve config that names no num_threads gets (outside Ray: no GPU bundle)."""
    base = {"model": tiny_llama, "tensor_parallel_size": 2, "device": "cpu"}
    config = _with_serving_threads(EngineConfig(**base))
    assert config.num_threads == serving_threads_per_rank(2)
    assert config.quiet_num_threads == quiet_threads_per_rank(2)
    fixed = _with_serving_threads(EngineConfig(**base, num_threads=3))
    assert (fixed.num_threads, fixed.quiet_num_threads) == (3, None)
    quiet = _with_serving_threads(EngineConfig(**base, quiet_num_threads=5))
    assert (quiet.num_threads, quiet.quiet_num_threads) == (serving_threads_per_rank(2), 5)
    cuda = {**base, "device": "cuda"}
    assert _with_serving_threads(EngineConfig(**cuda)).num_threads is None
