"""vLLM's request log (`--enable-log-requests`, `--enable-log-outputs`, `--max-log-len`): the
lines a served request writes, through the OpenAI server over HTTP and the official SDK. Off by
default, prompts only at DEBUG, outputs only when asked, every text cut to `max_log_len`."""

from __future__ import annotations

import logging
import re
from typing import Any

import openai
import pytest
from fastapi.testclient import TestClient

from pagedray.engine.config import EngineConfig
from pagedray.openai.local_app import local_openai_app

LOGGER = "pagedray.openai.request_log"
MESSAGES = [{"role": "user", "content": "Hello there, how are you today?"}]


def _served(tiny_llama: str, **settings: Any) -> tuple[TestClient, openai.OpenAI]:
    config = EngineConfig(
        model=tiny_llama, num_kv_blocks=64, max_num_seqs=4, served_model_name=["x"], **settings
    )
    http = TestClient(local_openai_app(config))
    return http, openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=http)


def _lines(caplog: pytest.LogCaptureFixture, level: int) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno == level]


def test_nothing_is_logged_unless_asked(tiny_llama: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    http, sdk = _served(tiny_llama)
    with http:
        sdk.chat.completions.create(model="x", messages=MESSAGES, max_tokens=4)
    assert not [r for r in caplog.records if r.name == LOGGER]


def test_requests_and_outputs_logged_as_vllm_logs_them(
    tiny_llama: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    http, sdk = _served(
        tiny_llama, enable_log_requests=True, enable_log_outputs=True, max_log_len=5
    )
    with http:
        answer = sdk.chat.completions.create(
            model="x", messages=MESSAGES, max_tokens=6, temperature=0.0, n=2
        )
        stream = sdk.chat.completions.create(
            model="x", messages=MESSAGES, max_tokens=6, temperature=0.0, stream=True
        )
        streamed = "".join(
            chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices
        )
    info, debug = _lines(caplog, logging.INFO), _lines(caplog, logging.DEBUG)
    received = [line for line in info if line.startswith("Received request")]
    assert len(received) == 2  # one per engine request, the answer's id first
    assert received[0].startswith(f"Received request {answer.id}: params: SamplingParams(")
    assert "max_tokens=6" in received[0] and "n=2" in received[0]
    # The prompt only at DEBUG, its text cut to 5 characters and its token ids to 5 ids.
    assert not any("prompt" in line.split("params")[0] for line in received)
    details = [line for line in debug if line.startswith(f"Request {answer.id} details")]
    prompt_ids = re.search(r"prompt_token_ids: \[(.*)\]", details[0])
    assert prompt_ids is not None and len(prompt_ids.group(1).split(",")) == 5
    # Whole: one line per choice when it ends, with its text (cut) and finish reason.
    whole = [line for line in info if line.startswith(f"Generated response {answer.id}:")]
    assert sorted(whole) == sorted(
        f"Generated response {answer.id}: output: {c.message.content[:5]!r}, finish_reason: "
        f"{c.finish_reason}"
        for c in answer.choices
    )
    # Streamed: a line per delta, and the whole text when it ends.
    deltas = [line for line in info if "(streaming delta)" in line]
    assert len(deltas) >= 2
    complete = [line for line in info if "(streaming complete)" in line]
    assert complete == [
        f"Generated response {complete[0].split()[2]} (streaming complete): output: "
        f"{streamed[:5]!r}, finish_reason: length"
    ]
    assert any("output_token_ids: [" in line for line in debug)


def test_deltas_can_be_left_out(tiny_llama: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    http, sdk = _served(
        tiny_llama, enable_log_requests=True, enable_log_outputs=True, enable_log_deltas=False
    )
    with http:
        stream = sdk.completions.create(
            model="x", prompt="Once upon", max_tokens=5, temperature=0.0, stream=True
        )
        text = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
    info = _lines(caplog, logging.INFO)
    assert not [line for line in info if "(streaming delta)" in line]
    complete = [line for line in info if "(streaming complete)" in line]
    assert len(complete) == 1 and f"output: {text!r}" in complete[0]
    # Without --enable-log-outputs, the requests alone.
    caplog.clear()
    http, sdk = _served(tiny_llama, enable_log_requests=True)
    with http:
        sdk.completions.create(model="x", prompt=["a", "b"], max_tokens=2)
    info = _lines(caplog, logging.INFO)
    assert len(info) == 2 and all(line.startswith("Received request cmpl-") for line in info)
