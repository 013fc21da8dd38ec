"""The periodic stats line (vLLM's `Avg prompt throughput: ...`): its figures over an interval,
what appears only when it happened, an idle engine's line at DEBUG; and a served engine writing
it through the OpenAI server over HTTP, unless `disable_log_stats`."""

from __future__ import annotations

import logging
import time
from typing import Any

import openai
import pytest
from fastapi.testclient import TestClient

from pagedray.engine.config import EngineConfig
from pagedray.engine.stats_log import INTERVAL_ENV, StatsLog, stats_log_for
from pagedray.engine.step_metrics import StepMetricsRecorder
from pagedray.openai.local_app import local_openai_app

LOGGER = "pagedray.engine.stats_log"


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _snapshot(**counters: float) -> dict[str, float]:
    base = {"num_running": 0, "num_waiting": 0, "kv_usage": 0.0, "num_preemptions": 0}
    return {**base, **counters}


def _lines(caplog: pytest.LogCaptureFixture) -> list[tuple[int, str]]:
    return [(r.levelno, r.getMessage()) for r in caplog.records if r.name == LOGGER]


def test_the_line_over_an_interval(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    clock = Clock()
    log = StatsLog("CPU", interval_s=10.0, clock=clock)
    log.stats(_snapshot(prompt_tokens_local_compute=500, prefix_cache_queries=64))  # baseline
    log.step(30)
    clock.now += 5.0
    log.stats(_snapshot(prompt_tokens_local_compute=900))
    assert _lines(caplog) == []  # within the interval
    log.step(70)
    clock.now += 5.0
    log.stats(
        _snapshot(
            prompt_tokens_local_compute=1500,
            num_running=3,
            num_waiting=2,
            kv_usage=0.125,
            num_preemptions=1,
            prefix_cache_queries=64 + 400,
            prefix_cache_hits=100,
        )
    )
    assert _lines(caplog) == [
        (
            logging.INFO,
            "Avg prompt throughput: 100.0 tokens/s, Avg generation throughput: 10.0 tokens/s, "
            "Running: 3 reqs, Waiting: 2 reqs, Preemptions: 1, CPU KV cache usage: 12.5%, "
            "Prefix cache hit rate: 25.0%",
        )
    ]
    caplog.clear()
    # The load ends: its last line still at INFO (no preemption since, the hit rate over the
    # recent lookups, the tiers' when they were asked), then DEBUG while idle.
    ended = _snapshot(
        prompt_tokens_local_compute=1500,
        num_preemptions=1,
        prefix_cache_queries=464,
        prefix_cache_hits=100,
        external_prefix_cache_queries=32,
        external_prefix_cache_hits=16,
    )
    for _ in range(2):
        clock.now += 10.0
        log.stats(ended)
    assert _lines(caplog) == [
        (
            logging.INFO,
            "Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: 0.0 tokens/s, "
            "Running: 0 reqs, Waiting: 0 reqs, CPU KV cache usage: 0.0%, "
            "Prefix cache hit rate: 25.0%, External prefix cache hit rate: 50.0%",
        ),
        (
            logging.DEBUG,
            "Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: 0.0 tokens/s, "
            "Running: 0 reqs, Waiting: 0 reqs, CPU KV cache usage: 0.0%, "
            "Prefix cache hit rate: 25.0%, External prefix cache hit rate: 50.0%",
        ),
    ]


def test_the_period_is_read_as_vllm_reads_it(monkeypatch: pytest.MonkeyPatch) -> None:
    config = EngineConfig(model="m")
    for given, period in (("2.5", 2.5), ("0", 10.0), ("-1", 10.0), ("soon", 10.0)):
        monkeypatch.setenv(INTERVAL_ENV, given)
        stats_log = stats_log_for(config, on_gpu=False)
        assert stats_log is not None and stats_log.interval_s == period
    assert stats_log_for(EngineConfig(model="m", disable_log_stats=True), on_gpu=True) is None
    assert stats_log_for(config, on_gpu=True).kv_device == "GPU"  # type: ignore[union-attr]


def test_a_failing_line_is_turned_off_not_the_engine(caplog: pytest.LogCaptureFixture) -> None:
    class Broken(StatsLog):
        def stats(self, stats: Any) -> None:
            raise RuntimeError("broken")

    recorder = StepMetricsRecorder(None, Broken("CPU"))
    recorder.stats(_snapshot())  # logged, not raised
    assert recorder.stats_log is None and "the stats line failed" in caplog.text


@pytest.mark.parametrize("disabled", [False, True])
def test_a_served_engine_writes_it(
    tiny_llama: str,
    disabled: bool,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(INTERVAL_ENV, "0.3")
    caplog.set_level(logging.INFO, logger=LOGGER)
    config = EngineConfig(
        model=tiny_llama,
        num_kv_blocks=64,
        max_num_seqs=4,
        served_model_name=["x"],
        disable_log_stats=disabled,
    )
    with TestClient(local_openai_app(config)) as http:
        sdk = openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=http)
        sdk.completions.create(
            model="x", prompt="Once upon a time", max_tokens=64, extra_body={"ignore_eos": True}
        )
        deadline = time.monotonic() + 10
        while not disabled and not _lines(caplog) and time.monotonic() < deadline:
            time.sleep(0.1)  # the idle loop writes the line that shows the load ending
        time.sleep(0.5)
    lines = [message for _, message in _lines(caplog)]
    if disabled:
        assert lines == []
        return
    assert lines and "Avg generation throughput" in lines[0]
    generated = [line for line in lines if "Avg generation throughput: 0.0" not in line]
    assert generated, lines  # the 64 tokens show in some interval's throughput
