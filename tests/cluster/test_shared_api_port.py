"""Serve's port allocator, patched as `cluster/shared_api_port.py` patches it in the controller:
with sharing on, every ingress replica gets the range's one HTTP port and keeps it whatever the
others do; gRPC ports, and a process without sharing, keep Serve's own allocation. Each case
runs in a fresh interpreter, as the controller's worker starts: the hook first, Serve's module
after (the hook must not import it), or the module first (the hook patches it at once).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from pagedray.cluster.shared_api_port import SHARED_API_PORT_ENV

ALLOCATIONS = """
import json, sys
BEFORE
from pagedray.cluster.shared_api_port import install
install()
hook_imported_serve = "ray.serve._private.node_port_manager" in sys.modules
from ray.serve._private.common import RequestProtocol
from ray.serve._private.node_port_manager import PortAllocator
http = PortAllocator(8000, 8001, RequestProtocol.HTTP, "node")
first, second = http.allocate("a"), http.allocate("b")
http.release("a", first, block_port=True)  # a replica that failed to listen asks for a block
third = http.allocate("c")
grpc = PortAllocator(9000, 9002, RequestProtocol.GRPC, "node")
print(json.dumps({
    "hook_imported_serve": hook_imported_serve,
    "http": [first, second, third],
    "held": sorted(http._allocated_ports),
    "grpc": [grpc.allocate("a"), grpc.allocate("b")],
}))
"""


def _allocations(sharing: str, serve_first: bool) -> dict[str, object]:
    before = "import ray.serve._private.node_port_manager" if serve_first else ""
    env = {**os.environ, SHARED_API_PORT_ENV: sharing}
    code = ALLOCATIONS.replace("BEFORE", before)
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("serve_first", [False, True], ids=["hook-first", "serve-first"])
def test_every_ingress_replica_gets_the_one_api_port(serve_first: bool) -> None:
    got = _allocations("1", serve_first)
    assert got["http"] == [8000, 8000, 8000]
    assert got["held"] == ["b", "c"]  # the released replica's record only: no block
    assert got["grpc"] == [9000, 9001]  # one port each, as Serve allocates them
    assert got["hook_imported_serve"] is serve_first  # patched on import, not imported early


def test_without_sharing_serve_allocates_as_it_does() -> None:
    done = subprocess.run(
        [sys.executable, "-c", ALLOCATIONS.replace("BEFORE", "")],
        env={**os.environ, SHARED_API_PORT_ENV: "0"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    # One port for two replicas: Serve's own allocator has none left for the second.
    assert done.returncode != 0 and "NoAvailablePortError" in done.stderr
