"""`pagedray serve --no-ray` (pagedray/cli/serve_local.py): the same API from one process, over
an engine it steps itself, through the official SDK; no Ray daemon starts, and what needs Ray
is refused by name before the model loads."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import openai
from _subprocesses import pagedray_serve

KEY = "sk-no-ray"
FLAGS = ("--no-ray", "--served-model-name", "tiny", "--num-kv-blocks", "32", "--api-key", KEY)
LOGGED = ("--enable-log-requests",)  # vLLM's request log, on the console here


def test_one_process_serves_the_api(tiny_llama: str) -> None:
    with pagedray_serve(tiny_llama, *FLAGS, *LOGGED) as server:
        assert not server.processes("raylet") and not server.processes("gcs_server")
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY)
        messages: list = [{"role": "user", "content": "Hello"}]
        whole = client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=5, temperature=0
        )
        stream = client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=5, temperature=0, stream=True
        )
        text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
        assert text == whole.choices[0].message.content
        assert [model.id for model in client.models.list().data] == ["tiny"]
        assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
        assert httpx.get(f"{server.url}/v1/models").status_code == 401  # the key is asked
        log = server.log_tail()
    assert "pagedray: serving the OpenAI API at" in log and "Ray" not in log.replace("no Ray", "")
    assert f"Received request {whole.id}: params: SamplingParams(" in log


def test_what_needs_ray_is_refused_before_the_model_loads(tiny_llama: str) -> None:
    pagedray = str(Path(sys.executable).with_name("pagedray"))
    for flags, named in [
        (("--tensor-parallel-size", "2"), "--tensor-parallel-size"),
        (("--num-replicas", "2"), "--num-replicas"),
        (("--address", "auto"), "--address"),
    ]:
        done = subprocess.run(
            [pagedray, "serve", tiny_llama, "--no-ray", *flags],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode != 0 and named in done.stderr, done.stderr
        assert "loading" not in done.stdout + done.stderr
