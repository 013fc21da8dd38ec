"""A restart soon after a stop (issue P11): a client's keep-alive connection open when
`pagedray serve` stops leaves the API port in TIME_WAIT, and the next `pagedray serve` on that
port must serve at once. It used to fail to listen there (its ingress replica bound without
SO_REUSEADDR, cluster/serve_bind_fix.py) and wait out --startup-timeout, 600 s, in silence.
The same two starts show what the console says: what is being done, and none of Ray's noise.
"""

from __future__ import annotations

import http.client
import shutil
import tempfile
from pathlib import Path

from _subprocesses import SERVE_START_TIMEOUT_S, free_port, get_ok, pagedray_serve, wait_for

FLAGS = ("--served-model-name", "tiny", "--num-kv-blocks", "32", "--num-threads", "1")
# What any start gets here (Ray, Serve and the model on 2 cores): a quarter of the old 600 s.
RESTART_TIMEOUT_S = SERVE_START_TIMEOUT_S
TIME_WAIT = "06"  # /proc/net/tcp's state code


def _in_time_wait(port: int) -> bool:
    """Whether a TCP connection whose local port is `port` lingers in TIME_WAIT."""
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == TIME_WAIT:
                return True
    return False


def _ingress_log(ray_tmp: Path) -> str:
    folder = ray_tmp / "session_latest" / "logs" / "serve"
    files = folder.glob("replica_pagedray_OpenAIIngress_*.log")
    return "".join(path.read_text(errors="replace") for path in files)


# What Ray and Serve print by themselves that a user cannot act on (pagedray/cli/console.py).
NOISE = (
    "Token authentication is enabled",
    "Throughput optimized Ray Serve enabled",
    "Direct ingress enabled",
    "graceful_shutdown failed",
    "Started Serve in namespace",
    "Deleting app",
)
URL_SAID = "pagedray: serving the OpenAI API at"
# What a start and a stop say, in this order.
STEPS = (
    "pagedray: starting a local Ray",
    "pagedray: Ray is up",
    "pagedray: deploying",
    "pagedray: replicas running: ",
    URL_SAID,
    "pagedray: stopping once the requests in flight finish",
    "pagedray: stopped",
)


def _check_console(console: str) -> None:
    for noise in NOISE:
        assert noise not in console, console
    lines = console.splitlines()
    positions = []
    for step in STEPS:
        found = [i for i, line in enumerate(lines) if line.startswith(step)]
        assert found, f"no line {step!r} in:\n{console}"
        positions.append(found[0])
    assert positions == sorted(positions), console
    assert all(line.startswith("pagedray: ") for line in lines), console


def test_a_restart_right_after_a_stop_with_a_client_connected_serves(tiny_llama: str) -> None:
    port = free_port()
    workdir = Path(tempfile.mkdtemp(prefix="pdr-", dir="/tmp"))  # kept for its log
    try:
        with pagedray_serve(tiny_llama, *FLAGS, port=port, workdir=workdir) as first:
            # NOTE: this test's poll of /health may see 200 before the server's own does.
            wait_for("the URL said", lambda: URL_SAID in first.log_tail(), 30)
            held = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
            held.request("GET", "/health")
            response = held.getresponse()
            response.read()
            assert response.status == 200 and not response.will_close  # kept alive, held open
        _check_console((workdir / "serve.log").read_text(errors="replace"))
        assert "GET /health 200" in _ingress_log(workdir / "ray")  # Serve's line, by default
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    # The server stopped with the connection open, so it closed it first: once the client
    # closes its end too, the server's end lingers in TIME_WAIT, on the API port.
    held.close()
    assert _in_time_wait(port)
    # vLLM's --disable-uvicorn-access-log: no access line (Serve writes them here).
    quiet = (*FLAGS, "--disable-uvicorn-access-log")
    with pagedray_serve(tiny_llama, *quiet, port=port, start_timeout_s=RESTART_TIMEOUT_S) as again:
        assert get_ok(f"{again.url}/v1/models")
        get_ok(f"{again.url}/health")
        assert "Started initializing replica" in _ingress_log(again.ray_tmp)  # the log is there
        assert " /v1/models " not in _ingress_log(again.ray_tmp)
        assert " /health " not in _ingress_log(again.ray_tmp)
