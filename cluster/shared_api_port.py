"""Several ingress replicas listening on the one API port, so that none of them is the API's
single point of failure (`pagedray serve --num-ingress-replicas N`, N > 1, issue P14).

Under Serve's direct ingress each ingress replica listens on a port of its own, taken from a
range, for a load balancer in front to spread requests over. A local `pagedray serve` has no
balancer in front and one API port, so it could run one ingress replica there; more went
through Serve's proxy, one process that then held the API alone (SIGKILLed, the API was down
for over 15 s). Here every ingress replica listens on the API port itself with SO_REUSEPORT and
the kernel spreads new connections over the listeners: a replica that dies takes only its own
connections with it, the others go on accepting (a client's next connection lands on a live
one), and Serve's replacement joins the port as it starts.

Two halves, both switched on by `SHARED_API_PORT_ENV` in the environment of the local Ray:
- in the Serve controller, the HTTP port allocator hands the range's one port to every ingress
  replica (`install`, which `pagedray serve` makes its job's worker setup hook, so that it runs
  in the controller's process before the controller starts);
- in each ingress replica, its listening socket gets SO_REUSEPORT beside SO_REUSEADDR
  (cluster/serve_bind_fix.py).
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import logging
import os
import sys
from types import ModuleType
from typing import Any

logger = logging.getLogger(__name__)
SHARED_API_PORT_ENV = "PAGEDRAY_SHARED_API_PORT"
# The job's `worker_process_setup_hook` that installs the controller's half.
SETUP_HOOK = f"{__name__}.install"
_INSTALLED = "_pagedray_shares_the_api_port"
_ALLOCATOR_MODULE = "ray.serve._private.node_port_manager"


def sharing() -> bool:
    """Whether this process's ingress replicas share the API port."""
    return os.environ.get(SHARED_API_PORT_ENV) == "1"


def install() -> None:
    """Every Ray worker of the job runs this as it starts. Only the Serve controller allocates
    ports: the allocator is patched in whichever process imports it, when it does (importing
    Serve's modules here would cost every worker, TP ranks included, most of a second)."""
    if not sharing():
        return
    module = sys.modules.get(_ALLOCATOR_MODULE)
    if module is not None:
        _share_http_port(module)
    elif not any(isinstance(finder, _PatchOnImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _PatchOnImport())


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Patches Serve's port allocator once its module is imported (then leaves `sys.meta_path`)."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != _ALLOCATOR_MODULE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)  # by the finders that would have found it
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_share(module: ModuleType) -> None:
            exec_module(module)
            _share_http_port(module)

        spec.loader.exec_module = exec_and_share  # type: ignore[method-assign]
        return spec


def _share_http_port(node_port_manager: ModuleType) -> None:
    from ray.serve._private.common import RequestProtocol

    allocator = node_port_manager.PortAllocator
    if getattr(allocator.allocate, _INSTALLED, False):
        return
    allocate, release = allocator.allocate, allocator.release

    def allocate_shared(self: Any, replica_id: str) -> int:
        if self._protocol != RequestProtocol.HTTP or not self._available_ports:
            return allocate(self, replica_id)
        # NOTE: the range is the API port alone (serve_runtime.lean_serve_env): every ingress
        # replica gets it, and it never leaves the pool.
        port = min(self._available_ports)
        self._allocated_ports[replica_id] = port
        return port

    def release_shared(self: Any, replica_id: str, port: int, block_port: bool = False) -> None:
        if self._protocol != RequestProtocol.HTTP:
            release(self, replica_id, port, block_port)
            return
        # NOTE: a replica that failed to listen asks for the port to be blocked, as if another
        # program held it; a listener of another replica holds it here, which is no reason.
        self._allocated_ports.pop(replica_id, None)

    setattr(allocate_shared, _INSTALLED, True)
    allocator.allocate = allocate_shared
    allocator.release = release_shared
    logger.info("Serve's ingress replicas share the API port")
