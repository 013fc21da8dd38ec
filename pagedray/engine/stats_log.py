"""The serving engine's periodic stats line, vLLM's figures in vLLM's words every 10 seconds, so
an operator who watches vLLM's log finds them here (without its `Engine 000:` prefix: an engine
here is a Serve replica, which its log line names):

    Avg prompt throughput: 512.0 tokens/s, Avg generation throughput: 96.4 tokens/s, Running: 8
    reqs, Waiting: 0 reqs, CPU KV cache usage: 12.5%, Prefix cache hit rate: 43.0%

Prompt throughput counts the prompt tokens computed (not those found cached), generation
throughput the tokens generated, both over the interval; preemptions appear when there were
any, and the external (host and disk tier) hit rate where lookups went there. The hit rates are
over the last minute's lookups (vLLM's over its last 1,000 requests). An idle engine writes its
line at DEBUG, as vLLM does, so a quiet server's log stays quiet. `--disable-log-stats` turns
it off (vLLM's flag also stops its metrics; the metrics stay exported here), and vLLM's
VLLM_LOG_STATS_INTERVAL sets its period.
"""

from __future__ import annotations

import collections
import logging
import os
import time
from collections.abc import Callable, Mapping

from pagedray.engine.config import EngineConfig

logger = logging.getLogger(__name__)

LOG_STATS_INTERVAL_S = 10.0
INTERVAL_ENV = "VLLM_LOG_STATS_INTERVAL"  # seconds between lines, vLLM's variable
HIT_RATE_WINDOW = 6  # lines whose lookups a hit rate covers: a minute at the default interval


class StatsLog:
    """Counts what the steps produce and writes the line when an interval has passed. Fed by
    the engine's loop (`StepMetricsRecorder`): each step's tokens, and each stats snapshot."""

    def __init__(
        self,
        kv_device: str,
        interval_s: float = LOG_STATS_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`kv_device`: where the KV pool lives, as the line names it (CPU, GPU)."""
        self.kv_device = kv_device
        self.interval_s = interval_s
        self.clock = clock
        self.last_time = clock()
        self.num_generation_tokens = 0
        self.last: Mapping[str, float] = {}  # the counters at the last line
        self.was_idle = True
        # (queries, hits) of each recent interval, per cache: the pool's and the tiers'.
        self.lookups: dict[str, collections.deque[tuple[float, float]]] = {
            cache: collections.deque(maxlen=HIT_RATE_WINDOW) for cache in ("", "external_")
        }

    def step(self, num_tokens: int) -> None:
        self.num_generation_tokens += num_tokens

    def stats(self, stats: Mapping[str, float]) -> None:
        """A snapshot of the engine's stats: the line, if an interval has passed."""
        if not self.last:  # the first: the counters' baseline (a warm-up's tokens are not load)
            self.last = dict(stats)
            self.last_time = self.clock()
            self.num_generation_tokens = 0
            return
        now = self.clock()
        elapsed = now - self.last_time
        if elapsed < self.interval_s or elapsed <= 0:
            return
        computed = self._delta(stats, "prompt_tokens_local_compute")
        prompt_throughput = computed / elapsed
        generation_throughput = self.num_generation_tokens / elapsed
        idle = not (computed or self.num_generation_tokens)
        parts = [
            f"Avg prompt throughput: {prompt_throughput:.1f} tokens/s",
            f"Avg generation throughput: {generation_throughput:.1f} tokens/s",
            f"Running: {int(stats.get('num_running', 0))} reqs",
            f"Waiting: {int(stats.get('num_waiting', 0))} reqs",
        ]
        preemptions = self._delta(stats, "num_preemptions")
        if preemptions:
            parts.append(f"Preemptions: {int(preemptions)}")
        parts.append(f"{self.kv_device} KV cache usage: {100 * stats.get('kv_usage', 0.0):.1f}%")
        for cache, name in (("", "Prefix"), ("external_", "External prefix")):
            rate = self._hit_rate(stats, cache)
            if rate is not None:
                parts.append(f"{name} cache hit rate: {100 * rate:.1f}%")
        # NOTE: idle only after an idle interval too, so the line that shows the load ending
        # is still written (vLLM's rule).
        log = logger.debug if idle and self.was_idle else logger.info
        log(", ".join(parts))
        self.was_idle = idle
        self.last = dict(stats)
        self.last_time = now
        self.num_generation_tokens = 0

    def _delta(self, stats: Mapping[str, float], name: str) -> float:
        return stats.get(name, 0.0) - self.last.get(name, 0.0)

    def _hit_rate(self, stats: Mapping[str, float], cache: str) -> float | None:
        """Hits over lookups of the recent intervals; None while there were none."""
        window = self.lookups[cache]
        queries = self._delta(stats, f"{cache}prefix_cache_queries")
        window.append((queries, self._delta(stats, f"{cache}prefix_cache_hits")))
        total = sum(q for q, _ in window)
        return sum(h for _, h in window) / total if total else None


def stats_log_for(config: EngineConfig, on_gpu: bool) -> StatsLog | None:
    """A serving engine's stats line, unless `disable_log_stats`; `on_gpu`: where its KV pool
    lives. The period is VLLM_LOG_STATS_INTERVAL's, read as vLLM reads it (a value that is not
    a positive number of seconds leaves the default)."""
    if config.disable_log_stats:
        return None
    interval_s = LOG_STATS_INTERVAL_S
    given = os.environ.get(INTERVAL_ENV)
    if given is not None:
        try:
            interval_s = float(given) if float(given) > 0 else LOG_STATS_INTERVAL_S
        except ValueError:
            logger.warning(
                "%s=%r is not a number of seconds: %s s", INTERVAL_ENV, given, interval_s
            )
    return StatsLog("GPU" if on_gpu else "CPU", interval_s)
