"""`pagedray serve` on its own local Ray, seen from outside: where its ports listen and what
its processes' command lines show (issue P5's closed surface), and the lean path (P6): the
ingress replica on the API port, the engine replica at full priority.

With the default `--host 127.0.0.1`, the API, the dashboard, Ray's metrics export port and Ray's
own GCS and raylet listen on loopback only; the API key given as a file is in no command line,
and only its digest reaches Serve.
"""

from __future__ import annotations

import os
from pathlib import Path

import httpx
from _subprocesses import command_line, descendants, listeners, pagedray_serve

KEY = "sk-binding-test-key"
# Ray Serve 2.60 starts an inter-deployment gRPC server on "[::]:0" in every replica,
# unconditionally (ray/serve/_private/replica.py): the one listener that cannot be kept on
# loopback. The README says so; these are the only processes allowed to listen elsewhere.
SERVE_REPLICA = "ray::ServeReplica"


def _loopback(address: str) -> bool:
    return address.startswith(("127.", "::ffff:127.")) or address == "::1"


def test_everything_but_serve_replicas_listens_on_loopback(tiny_llama: str, tmp_path: Path) -> None:
    key_file = tmp_path / "api-key"
    key_file.write_text(f"  {KEY}\n")
    flags = ["--served-model-name", "tiny", "--num-kv-blocks", "32", "--num-threads", "1"]
    with pagedray_serve(tiny_llama, *flags, "--api-key-file", str(key_file)) as server:
        pids = {server.proc.pid, *descendants(server.proc.pid)}
        found = listeners(pids)
        ports = {port for _, port, _ in found}
        api_port = int(server.url.rsplit(":", 1)[1])
        assert {api_port, server.metrics_port} <= ports
        # Direct ingress: the ingress replica itself listens on the API port, not Serve's proxy.
        api_listeners = {command_line(pid) for _, port, pid in found if port == api_port}
        assert api_listeners and all("OpenAIIngress" in c for c in api_listeners), api_listeners
        # The model's threads run in the engine replica: at nice 0, not Ray's default 15.
        engines = [pid for pid in pids if "PagedRayEngine" in command_line(pid)]
        assert engines and all(os.getpriority(os.PRIO_PROCESS, pid) == 0 for pid in engines)
        exposed = [
            (address, port, command_line(pid))
            for address, port, pid in found
            if not _loopback(address) and SERVE_REPLICA not in command_line(pid)
        ]
        assert not exposed, exposed
        assert not [pid for pid in pids if KEY in command_line(pid)]
        # The key works, and /health needs none.
        assert httpx.get(f"{server.url}/health", timeout=10).json() == {"status": "ok"}
        assert httpx.get(f"{server.url}/v1/models", timeout=10).status_code == 401
        auth = {"Authorization": f"Bearer {KEY}"}
        models = httpx.get(f"{server.url}/v1/models", headers=auth, timeout=10).json()
        assert models["data"][0]["max_model_len"] == 32 * 16  # the pool's, not the model's
