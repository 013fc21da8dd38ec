"""`pagedray serve`'s security flags, without starting anything: where the API key comes from,
that only its digest is bound into the Serve application, the body limit, and the metrics host.
Their effect on a running server: tests/deploy/test_serve_api_port.py."""

from __future__ import annotations

import argparse
import hashlib
from pathlib import Path
from typing import Any

import pytest

from pagedray.cli import serve as serve_cli
from pagedray.cli.serve import add_serve_parser, serve_app_args
from pagedray.cluster.openai_app import build_app

KEY = "sk-flag-test"
DIGEST = hashlib.sha256(KEY.encode()).hexdigest()


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["serve", *argv])


def _ingress_args(app_args: dict[str, Any]) -> tuple[Any, ...]:
    """What Serve is given for the ingress (and shows in its deployment): after engine, config."""
    return build_app(app_args)._bound_deployment.init_args[2:]


def test_key_from_a_file_reaches_serve_only_as_its_digest(tiny_llama: str, tmp_path: Path) -> None:
    key_file = tmp_path / "key"
    key_file.write_text(f"\n  {KEY}  \n")
    app_args = serve_app_args(_parse([tiny_llama, "--api-key-file", str(key_file)]))
    assert app_args["api_key_file"] == str(key_file) and "api_key" not in app_args
    bound = _ingress_args(app_args)
    assert bound[0] == DIGEST and KEY not in repr(bound)
    assert _ingress_args({"model": tiny_llama, "api_key": KEY})[0] == DIGEST
    assert _ingress_args({"model": tiny_llama, "api_key_sha256": DIGEST.upper()})[0] == DIGEST
    assert _ingress_args({"model": tiny_llama})[0] is None  # no key: every route is open


def test_key_from_the_environment(tiny_llama: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGEDRAY_API_KEY", KEY)
    assert serve_app_args(_parse([tiny_llama]))["api_key"] == KEY
    assert serve_app_args(_parse([tiny_llama, "--api-key", "other"]))["api_key"] == "other"
    monkeypatch.setenv("PAGEDRAY_API_KEY", "")
    assert "api_key" not in serve_app_args(_parse([tiny_llama]))


def test_bad_key_arguments_are_refused(tiny_llama: str, tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="not both"):
        serve_app_args(_parse([tiny_llama, "--api-key", "a", "--api-key-file", "f"]))
    empty = tmp_path / "empty"
    empty.write_text("  \n")
    with pytest.raises(ValueError, match="^api_key_file: .* is empty"):
        build_app({"model": tiny_llama, "api_key_file": str(empty)})
    with pytest.raises(ValueError, match="^api_key: give one of"):
        build_app({"model": tiny_llama, "api_key": "a", "api_key_sha256": DIGEST})
    with pytest.raises(ValueError, match="^api_key_sha256: must be 64 hex digits"):
        build_app({"model": tiny_llama, "api_key_sha256": "abc"})


def test_body_limit_flag(tiny_llama: str) -> None:
    app_args = serve_app_args(_parse([tiny_llama, "--max-request-body-bytes", "1000"]))
    assert _ingress_args(app_args)[1] == 1000
    assert _ingress_args({"model": tiny_llama})[1] == 4 * 1024 * 1024
    with pytest.raises(ValueError, match="^max_request_body_bytes: "):
        build_app({"model": tiny_llama, "max_request_body_bytes": 0})


def test_routing_is_cache_aware_with_several_engines(tiny_llama: str) -> None:
    """Cache-aware routing has the engines publish their prefix caches (and the ingress,
    given the same config, follow them); the flag overrides the default either way."""

    def kv_events(flags: list[str]) -> bool:
        config = build_app(serve_app_args(_parse([tiny_llama, *flags])))._bound_deployment
        return config.init_args[1]["enable_kv_cache_events"]

    assert not kv_events([])
    assert kv_events(["--num-replicas", "2"])
    assert kv_events(["--min-replicas", "1", "--max-replicas", "3"])
    assert not kv_events(["--num-replicas", "2", "--routing", "power-of-two"])
    assert kv_events(["--routing", "cache-aware"])
    assert not kv_events(["--num-replicas", "2", "--no-enable-prefix-caching"])
    with pytest.raises(ValueError, match="^routing: Input should be 'cache-aware' or"):
        build_app({"model": tiny_llama, "routing": "random"})
    with pytest.raises(ValueError, match="^routing: cache-aware needs prefix caching"):
        build_app({"model": tiny_llama, "routing": "cache-aware", "enable_prefix_caching": False})


def test_metrics_host_follows_the_api_host() -> None:
    assert _parse([]).metrics_host is None  # run_serve then uses --host
    for host in ("127.0.0.1", "localhost", "::1"):
        assert serve_cli._is_loopback(host) and serve_cli._bind_ray_to(host) == {}
    assert serve_cli._bind_ray_to("0.0.0.0") == {}
    assert serve_cli._bind_ray_to("10.1.2.3") == {"_node_ip_address": "10.1.2.3"}
