"""`serve run` of deploy/serve/pagedray-cpu.yaml on a local Ray answers a completion over HTTP.

The config is used as shipped, with three changes a test needs: a free HTTP port, the tiny
model, and a private Ray temp dir so the run cannot meet another Ray on the machine.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml
from _subprocesses import alive, descendants, free_port, get_ok, stop, wait_for

ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 180  # Ray, Serve, the engine replica and its worker on 2 CPU cores

pytestmark = pytest.mark.slow


@pytest.fixture()
def serve_run(tiny_llama: str) -> Iterator[str]:
    workdir = Path(tempfile.mkdtemp(prefix="pdr-run-", dir="/tmp"))
    config = yaml.safe_load((ROOT / "deploy/serve/pagedray-cpu.yaml").read_text())
    port = free_port()
    config["http_options"]["port"] = port
    config["applications"][0]["args"]["model"] = tiny_llama
    path = workdir / "serve.yaml"
    path.write_text(yaml.safe_dump(config))
    env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}
    env.update(RAY_ADDRESS="local", RAY_TMPDIR=str(workdir), OMP_NUM_THREADS="1")
    serve = str(Path(sys.executable).with_name("serve"))
    log = (workdir / "serve.log").open("w")
    proc = subprocess.Popen(
        [serve, "run", str(path)], env=env, stdout=log, stderr=subprocess.STDOUT
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for("serve run healthy", lambda: get_ok(f"{url}/health"), START_TIMEOUT_S, proc)
    except AssertionError as exc:
        stop(proc, 60)
        log.close()
        raise AssertionError(f"{exc}\n{(workdir / 'serve.log').read_text()[-3000:]}") from exc
    ray_pids = descendants(proc.pid)
    try:
        yield url
    finally:
        ray_pids |= descendants(proc.pid)
        stop(proc, 60)
        log.close()
        deadline = time.monotonic() + 30
        while any(alive(pid) for pid in ray_pids) and time.monotonic() < deadline:
            time.sleep(0.5)
        for pid in ray_pids:  # only what this `serve run` started
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_serve_run_of_the_shipped_config_answers_a_completion(serve_run: str) -> None:
    models = httpx.get(f"{serve_run}/v1/models", timeout=30).json()["data"]
    response = httpx.post(
        f"{serve_run}/v1/completions",
        json={"model": models[0]["id"], "prompt": "Hello", "max_tokens": 5, "temperature": 0},
        timeout=60,
    )
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["usage"]["completion_tokens"] == 5
    assert body["choices"][0]["finish_reason"] == "length"
