"""`pagedray serve` as clients and operators see its API port (issue P6), with direct ingress:
`/metrics` in Prometheus text without the API key, OpenAI's 404 for an unknown path, vLLM's 400
for a max_tokens that cannot fit, and logs that hold one access line per request in the ingress,
no traceback for a stream its client dropped, and no per-call line of the engine at INFO; a
`--lora-modules` adapter answering as a model of its own; the
engine's torch threads (a core left to the serving path), the scheduling policies of Ray's
processes and of the model's threads, and the dashboard in Ray's Grafana.

Where it listens and what its command lines show (issue P5's closed surface), on the same
server: with the default `--host 127.0.0.1`, the API, the dashboard, Ray's metrics export port
and Ray's own GCS and raylet listen on loopback only (Ray Serve 2.60 starts an inter-deployment
gRPC server on "[::]:0" in every replica unconditionally, ray/serve/_private/replica.py: the one
listener that cannot be kept on loopback, as the README says); the ingress replica itself on the
API port; the engine replica at full priority; the API key given as a file in no command line.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import httpx
from _subprocesses import (
    ServeProcess,
    command_line,
    descendants,
    listeners,
    pagedray_serve,
    thread_policies,
)
from prometheus_client.parser import text_string_to_metric_families

from pagedray import LLM, LoRARequest, SamplingParams
from pagedray.cli.serve_runtime import (
    CONTROL_LOOP_INTERVAL_ENV,
    LOG_MONITOR_FILES_THRESHOLD_ENV,
    METRICS_EXPORT_INTERVAL_ENV,
)
from pagedray.observability.grafana_dashboard import dashboard_json
from pagedray.observability.ray_grafana import DASHBOARD_FILE
from pagedray.workers import cpu_scheduling
from pagedray.workers.compute_thread import OS_THREAD_NAME
from pagedray.workers.cpu_threads import quiet_threads_per_rank, serving_threads_per_rank

KEY = "sk-api-port-test"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_MODEL_LEN = 32 * 16  # --num-kv-blocks 32 of 16 tokens
# Ray's metrics agent exports every few seconds (10 by default).
EXPORT_TIMEOUT_S = 60.0
DROPS = 5
LOG_WAIT_S = 30.0  # for the dropped streams' access lines


def _error(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status
    return error


def _serve_logs(server: ServeProcess, component: str) -> str:
    folder = server.ray_tmp / "session_latest" / "logs" / "serve"
    files = sorted(folder.glob(f"replica_pagedray_{component}_*.log"))
    assert files, f"no {component} log in {folder}"
    return "".join(path.read_text(errors="replace") for path in files)


def _family_names(text: str) -> set[str]:
    return {family.name for family in text_string_to_metric_families(text)}


# One family of each process that records: the engine replica's and the ingress's.
RECORDED_FAMILIES = {"ray_pagedray_generation_tokens", "ray_pagedray_http_requests"}


def _exported_families(server: ServeProcess) -> set[str]:
    """The pagedray families on Ray's export port once it holds both processes' series (each
    process's reach the export on its own schedule)."""
    deadline = time.monotonic() + EXPORT_TIMEOUT_S
    while True:
        text = httpx.get(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=30).text
        names = {name for name in _family_names(text) if name.startswith("ray_pagedray_")}
        if names >= RECORDED_FAMILIES:
            return names
        assert time.monotonic() < deadline, sorted(names)
        time.sleep(1.0)


def _metrics(server: ServeProcess, families: set[str]) -> str:
    """The API port's /metrics (no key) once it holds every given family.

    NOTE: Ray's agent exports each process's metrics on its own schedule, so a family the export
    port showed a moment ago may be newer than the API port's last read of it: wait for it.
    """
    deadline = time.monotonic() + EXPORT_TIMEOUT_S
    while True:
        response = httpx.get(f"{server.url}/metrics", timeout=30)
        assert response.status_code == 200, response.text
        if families <= _family_names(response.text):
            return response.text
        assert time.monotonic() < deadline, families - _family_names(response.text)
        time.sleep(1.0)


def _check_serve_intervals(server: ServeProcess) -> None:
    """Serve's processes and Ray's log monitor run with `pagedray serve`'s intervals
    (serve_runtime.py)."""
    for marker in ("ray::ServeController", "OpenAIIngress", "PagedRayEngine", "ProxyActor"):
        pids = server.processes(marker)
        assert pids, marker
        for pid in pids:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            assert b"%s=0.5" % CONTROL_LOOP_INTERVAL_ENV.encode() in environ, marker
            assert b"%s=1000" % METRICS_EXPORT_INTERVAL_ENV.encode() in environ, marker
    (log_monitor,) = server.processes("log_monitor.py")
    environ = Path(f"/proc/{log_monitor}/environ").read_bytes().split(b"\0")
    assert b"%s=0" % LOG_MONITOR_FILES_THRESHOLD_ENV.encode() in environ


def _check_scheduling_policies(server: ServeProcess) -> None:
    """Ray's daemons and the serving path under SCHED_BATCH, the model's thread and its OpenMP
    team under SCHED_OTHER (workers/cpu_scheduling.py)."""
    if not cpu_scheduling.supported():
        return
    for marker in ("gcs_server", "raylet", "ray::ServeController", "OpenAIIngress"):
        pids = server.processes(marker)
        assert pids, marker
        for pid in pids:
            assert set().union(*thread_policies(pid).values()) == {os.SCHED_BATCH}, marker
    (engine,) = server.processes("PagedRayEngine")
    policies = thread_policies(engine)
    assert policies.pop(OS_THREAD_NAME) == {os.SCHED_OTHER}
    assert set().union(*policies.values()) == {os.SCHED_BATCH}


def _check_ingress_runs_without_torch(server: ServeProcess) -> None:
    """The ingress tokenizes with the model's own tokenizer class, without transformers' auto
    classes, which import torch: 1.5-2 s off its start, so off the API's outage when it is
    replaced (pagedray/engine/tokenizer_loading.py)."""

    def maps_torch(pid: int) -> bool:
        return "libtorch" in Path(f"/proc/{pid}/maps").read_text()

    (ingress,), (engine,) = server.processes("OpenAIIngress"), server.processes("PagedRayEngine")
    assert maps_torch(engine)
    assert not maps_torch(ingress)


def _check_lora_adapter(client: httpx.Client, model: str, adapter: str) -> None:
    """A `--lora-modules` adapter is a model of the base's, and its chat answers are the
    offline `LoRARequest`'s tokens: loaded into the engine replica's slot through the plan."""
    cards = {card["id"]: card for card in client.get("/v1/models").json()["data"]}
    assert cards["tiny-lora"]["parent"] == "tiny" and cards["tiny-lora"]["root"] == adapter
    messages = [{"role": "user", "content": "Say something."}]
    body = {"messages": messages, "max_tokens": 6, "temperature": 0, "return_token_ids": True}
    answers = {
        name: client.post("/v1/chat/completions", json={**body, "model": name}).json()
        for name in ("tiny", "tiny-lora")
    }
    assert answers["tiny-lora"]["model"] == "tiny-lora"
    (replica,) = client.get("/stats").json()["replicas"]
    assert replica["num_lora_loads"] == 1 and replica["num_lora_adapters_running"] == 0
    offline = LLM(model, num_kv_blocks=32, enable_lora=True)
    params = SamplingParams(temperature=0, max_tokens=6)
    for name, lora in (("tiny", None), ("tiny-lora", LoRARequest("l", 1, adapter))):
        (want,) = offline.chat(messages, params, use_tqdm=False, lora_request=lora)
        assert answers[name]["choices"][0]["token_ids"] == want.outputs[0].token_ids
    offline.shutdown()


SERVE_REPLICA = "ray::ServeReplica"  # the processes allowed to listen beyond loopback


def _loopback(address: str) -> bool:
    return address.startswith(("127.", "::ffff:127.")) or address == "::1"


def _check_listeners_and_command_lines(server: ServeProcess) -> None:
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
    models = httpx.get(f"{server.url}/v1/models", headers=AUTH, timeout=10).json()
    assert models["data"][0]["max_model_len"] == 32 * 16  # the pool's, not the model's


def test_api_port_metrics_errors_and_logs(tiny_llama: str, tiny_lora: str, tmp_path: Path) -> None:
    # No --num-threads: the default leaves a core to the serving path (1 thread on 2 cores).
    flags = ["--served-model-name", "tiny", "--num-kv-blocks", "32"]
    flags += ["--enable-lora", "--lora-modules", f"tiny-lora={tiny_lora}"]  # _check_lora_adapter
    key_file = tmp_path / "api-key"
    key_file.write_text(f"  {KEY}\n")
    # NOTE: pagedray serve writes each access line at once (Serve's throughput mode would buffer
    # 1,000), so they are in the replica logs read below.
    flags.append("--enable-log-requests")  # vLLM's request log, read below
    stats_every_second = {"VLLM_LOG_STATS_INTERVAL": "1"}  # the engine's stats line, read below
    with pagedray_serve(
        tiny_llama, *flags, "--api-key-file", str(key_file), env=stats_every_second
    ) as server:
        _check_listeners_and_command_lines(server)
        client = httpx.Client(base_url=server.url, headers=AUTH, timeout=60)
        num_prompt = client.post("/tokenize", json={"prompt": "Hello"}).json()["count"]
        error = _error(
            client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 5000}), 400
        )
        assert error == {
            "message": "'max_tokens' or 'max_completion_tokens' is too large: 5000. This model's "
            f"maximum context length is {MAX_MODEL_LEN} tokens and your request has {num_prompt} "
            f"input tokens (5000 > {MAX_MODEL_LEN} - {num_prompt}).",
            "type": "BadRequestError",
            "param": "max_tokens",
            "code": 400,
        }
        for method in ("GET", "POST"):
            error = _error(client.request(method, "/v2/nothing", json={}), 404)
            assert error["type"] == "NotFoundError"

        stream = {"prompt": "drop me", "max_tokens": 400, "ignore_eos": True, "stream": True}
        for _ in range(DROPS):
            with client.stream("POST", "/v1/completions", json=stream) as response:
                assert next(line for line in response.iter_lines() if line.startswith("data: "))
        whole = client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 4})
        assert whole.json()["usage"]["completion_tokens"] == 4
        # Serve's proxy gives each request an id and each answer its header, once: the answer
        # is named by it (vLLM's X-Request-Id).
        assert len(whole.headers.get_list("x-request-id")) == 1
        assert whole.json()["id"] == "cmpl-" + whole.headers["x-request-id"]
        replicas = client.get("/stats").json()["replicas"]
        assert [replica["num_threads"] for replica in replicas] == [serving_threads_per_rank(1)]
        quiet = [replica["quiet_num_threads"] for replica in replicas]
        assert quiet == [quiet_threads_per_rank(1)]
        _check_scheduling_policies(server)
        _check_serve_intervals(server)
        _check_ingress_runs_without_torch(server)
        _check_lora_adapter(client, tiny_llama, tiny_lora)
        # The dashboard lies where the Grafana of Ray's session loads Ray's own dashboards.
        grafana = (server.ray_tmp / "session_latest" / "metrics" / "grafana").resolve()
        assert (grafana / "dashboards" / DASHBOARD_FILE).read_text() == dashboard_json()
        provider = (grafana / "provisioning" / "dashboards" / "default.yml").read_text()
        assert f"path: {grafana / 'dashboards'}" in provider

        # The same series names as Ray's export port, so one dashboard reads either.
        exported = _exported_families(server)
        text = _metrics(server, exported)
        headers = [line for line in text.splitlines() if line.startswith("#")]
        assert len(headers) == len(set(headers))
        assert all(name.startswith("ray_pagedray_") for name in _family_names(text))

        def completions_logged() -> list[str]:
            log = _serve_logs(server, "OpenAIIngress")
            return [line for line in log.splitlines() if "POST /v1/completions " in line]

        # A dropped stream's access line is written once the ingress sees the disconnect, which
        # can take a moment on a loaded machine: wait for it rather than a fixed second.
        deadline = time.monotonic() + LOG_WAIT_S
        while len(completions_logged()) < 1 + DROPS + 1 and time.monotonic() < deadline:
            time.sleep(0.5)
        time.sleep(0.5)  # and a moment more: a line too many would show now
        ingress, engine = (
            _serve_logs(server, "OpenAIIngress"),
            _serve_logs(server, "PagedRayEngine"),
        )
        for log in (ingress, engine, server.log_path.read_text(errors="replace")):
            assert "Traceback" not in log and "TaskCancelledError" not in log
        # One access line per request: the 400, the dropped streams and the whole one.
        completions = completions_logged()
        assert len(completions) == 1 + DROPS + 1, completions
        assert all(line.startswith("INFO ") for line in completions)
        assert "CALL generate" not in engine
        # The request log: each request's line in the ingress's file and on the console (Serve's
        # throughput mode writes its own lines to the file only).
        received = f"Received request {whole.json()['id']}: params: SamplingParams("
        assert received in ingress
        assert ", lora_request: tiny-lora." in ingress  # _check_lora_adapter's, as vLLM's line
        deadline = time.monotonic() + LOG_WAIT_S
        console = server.log_path.read_text
        while received not in console(errors="replace") and time.monotonic() < deadline:
            time.sleep(0.5)
        assert received in console(errors="replace")
        # The engine's stats line (vLLM's), in its file and on the console, at INFO once it
        # generated (an idle engine's line is at DEBUG).
        stats_line = (
            " -- Avg prompt throughput: "  # Serve's format in the file, ours on the console
        )
        assert stats_line in engine
        assert f"pagedray.engine.stats_log{stats_line}" in console(errors="replace")
        # pagedray's own INFO lines reach the replica's file, in Serve's format: here the
        # rank's choice of threads for streamed steps (cluster/replica_logging.py), made where
        # the two counts differ (a core is left to the serving path).
        if serving_threads_per_rank(1) != quiet_threads_per_rank(1):
            chosen = [line for line in engine.splitlines() if "streamed steps run on" in line]
            assert len(chosen) == 1 and chosen[0].startswith("INFO "), chosen
            assert " pagedray_PagedRayEngine " in chosen[0]
