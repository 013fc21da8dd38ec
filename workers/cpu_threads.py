"""How many torch threads a serving engine's ranks get on a CPU: all of the node but one core
while a request streams, all of it while none does, for a step that is mostly prompt, or for
every step of a model whose work outweighs the serving path's.

Offline, the model is all a process runs, and `LLM` leaves torch at its default: every core.
Served, the same cores also run the ingress (tokens to text, SSE), the engine's event loop,
Ray's daemons and often the client. With the model's OpenMP team on every core, each of those
takes a core from a thread of the team, and the others spin at the next barrier until it
returns: measured on 2 cores (64 streams of 128 prompt / 64 output tokens through
`pagedray serve`, two rounds each), 1,923 output tok/s with 2 threads against 3,437 with 1,
and a lone request's 64 tokens in 154 ms against 136. vLLM's CPU build reserves a core for its
API and engine-core processes the same way (`VLLM_CPU_NUM_OF_RESERVED_CPU`, 1 by default).

A step whose prompt tokens dominate also runs on every core while requests stream: it computes
many tokens for each one it streams (a prompt chunk beside a batch of decodes), so the work it
leaves the serving path is small next to what the reserved core would add to it. Measured on 2
cores (64 streams of the HTTP benchmark, alternated on one server, 5 rounds): the prefill steps
took 0.79-0.97 s instead of 1.32-1.47, and the runs 1,616 against 1,531 output tok/s (medians).

The reserve pays for a light model only. Off the reserved core, a step takes longer by what
the core would have computed; on it, the serving path's work stalls the whole team for as long as
it runs. So a rank measures the work of its projections at a decode batch (`RESERVE_PROBE_ROWS`
rows, CPU time on one thread) as it starts, and gives every step every core when the time that
would save, spread over each count, is more than the serving path's work for that many streamed
tokens (`reserved_core_pays`). (Timing the two counts' wall time instead read the same model
either side of the line from one start to the next: the server's other processes start beside
it and take a core from the wider team.) Measured on 2 cores (the Qwen2.5-0.5B shape in bf16,
one engine, host tier off, 303-token prompts and 64 tokens out, 5 requests one at a time then 32
at once; two rounds, alternated): with the reserve, 66-70 ms between tokens alone and 58-60
output tok/s at 32; on every core, 49-53 ms and 67 tok/s (the first token alone the same, 670-694
ms: a prompt-heavy step ran on every core already). The estimate spreads the work evenly, which
flatters a second thread: the 0.5B shape's projections at 16 rows are 96 ms of work, 48 saved by
the estimate and 38 measured (58 ms on 2 threads), far past the serving path's 6.4 either way;
the small model's are 1.8 ms, 0.9 saved by the estimate and none measured (2.1 ms on 2): it keeps
the reserve. A model within a few milliseconds of the line may go either way, at little cost
either way. On 16 cores the reserve is one core of 16, and the 0.5B shape keeps it too.

A serving rank without `num_threads` gets `serving_threads_per_rank`: the cores this process may
use (its affinity, lowered by the least CPU quota of its cgroup and its ancestors, v2 or v1, as a
container's or a pod's CPU limit sets; cgroups.py), less `RESERVED_SERVING_CORES`, split evenly
among the ranks that share the node, at least one each.

The reserved core is for work done per streamed token. While no request in flight streams (every
client waits for its whole completion; stop strings count as streaming, since the ingress reads
such a request's tokens as they come), the serving path wakes only as requests arrive and finish,
and the reserved core would idle beside a model held to the others: such a step runs on
`quiet_threads_per_rank`, every core. Measured on 2 cores (`benchmarks/http_throughput.py`, 64
requests not streamed, as a share of `LLM.generate` in the same run): 0.40x with the model on
1 thread, 0.52x on 2 (single runs); with this policy 0.53x and 0.60x (two runs, medians of 3),
streaming unchanged.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

from pagedray.workers.cgroups import CGROUP_ROOT, PROC_SELF_CGROUP, cgroup_levels, read_text

# Cores left to the serving path (ingress, engine loop, Ray) on each node.
RESERVED_SERVING_CORES = 1
# Tokens a step computes per sequence it schedules, at and above which it runs on every core
# while requests stream. The break-even on 2 cores: a 1-thread step costs about 0.28 ms a decode
# and 0.07 ms a prompt token, and the serving path about 0.4 ms per token it streams (client
# included), so a second thread pays once prompt tokens pass about 8 per decode.
PROMPT_HEAVY_TOKENS_PER_SEQUENCE = 8
# The serving path's CPU time per token it streams, on the machine the costs above are from.
SERVING_MS_PER_STREAMED_TOKEN = 0.4
# Decode rows whose projections' work (one thread's CPU time) a rank measures to judge the reserve.
RESERVE_PROBE_ROWS = 16


def usable_cores(proc_cgroup: Path = PROC_SELF_CGROUP, root: Path = CGROUP_ROOT) -> int:
    """Cores this process may run on: its CPU affinity, capped by the least CPU quota of its
    cgroup and its ancestors (cgroups.py)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    cores = cores or 1
    levels, v2 = cgroup_levels("cpu", proc_cgroup, root)
    quota_of = _v2_quota if v2 else _v1_quota
    quotas = [quota for level in levels if (quota := quota_of(level)) is not None]
    return cores if not quotas else max(1, min(cores, math.ceil(min(quotas))))


def _v2_quota(level: Path) -> float | None:
    """cpu.max: "<quota> <period>" in microseconds, or "max <period>" for none; in cores."""
    fields = (read_text(level / "cpu.max") or "").split()
    if len(fields) < 2 or not fields[0].isdigit() or not fields[1].isdigit():
        return None
    return int(fields[0]) / int(fields[1]) if int(fields[1]) > 0 else None


def _v1_quota(level: Path) -> float | None:
    """cpu.cfs_quota_us (-1 for none) over cpu.cfs_period_us, in cores."""
    try:
        quota_us = int(read_text(level / "cpu.cfs_quota_us") or "")
        period_us = int(read_text(level / "cpu.cfs_period_us") or "")
    except ValueError:
        return None
    return None if quota_us <= 0 or period_us <= 0 else quota_us / period_us


def serving_threads_per_rank(ranks_on_node: int, cores: int | None = None) -> int:
    """Torch threads for each of `ranks_on_node` serving ranks: the node's usable cores but
    `RESERVED_SERVING_CORES`, split evenly, at least 1."""
    return _split(ranks_on_node, cores, RESERVED_SERVING_CORES)


def quiet_threads_per_rank(ranks_on_node: int, cores: int | None = None) -> int:
    """Torch threads for each of `ranks_on_node` serving ranks in a step in which no request
    streams: the node's usable cores, none reserved, split evenly, at least 1."""
    return _split(ranks_on_node, cores, 0)


def serving_thread_counts(ranks_on_node: int) -> dict[str, int]:
    """The engine config's thread fields for serving ranks that share this node: `num_threads`
    (a step while a request streams) and `quiet_num_threads` (one while none does)."""
    cores = usable_cores()
    return {
        "num_threads": serving_threads_per_rank(ranks_on_node, cores),
        "quiet_num_threads": quiet_threads_per_rank(ranks_on_node, cores),
    }


def step_runs_on_every_core(streaming: bool, num_tokens: int, num_sequences: int) -> bool:
    """Whether a step gets `quiet_threads_per_rank` rather than the serving count: while no
    request streams, or when it computes at least `PROMPT_HEAVY_TOKENS_PER_SEQUENCE` tokens for
    each of its `num_sequences` (its prompt tokens dominate)."""
    if not streaming:
        return True
    return num_tokens >= PROMPT_HEAVY_TOKENS_PER_SEQUENCE * max(1, num_sequences)


def break_even_work_s(rows: int, serving_threads: int, all_threads: int) -> float:
    """The work of a step of `rows` sequences (CPU seconds on one thread) at which spreading it
    evenly over `all_threads` rather than `serving_threads` saves just what the serving path
    costs for the `rows` tokens it streams."""
    spread = 1 / serving_threads - 1 / all_threads
    return math.inf if spread <= 0 else rows * SERVING_MS_PER_STREAMED_TOKEN / 1000 / spread


def reserved_core_pays(work_s: float, rows: int, serving_threads: int, all_threads: int) -> bool:
    """Whether streamed decode steps keep off the reserved core: unless `work_s` of a step of
    `rows` sequences is past the break-even (`break_even_work_s`)."""
    return work_s <= break_even_work_s(rows, serving_threads, all_threads)


def _split(ranks_on_node: int, cores: int | None, reserved: int) -> int:
    if ranks_on_node < 1:
        raise ValueError(f"ranks_on_node must be at least 1, not {ranks_on_node}")
    cores = usable_cores() if cores is None else cores
    return max(1, (cores - reserved) // ranks_on_node)
