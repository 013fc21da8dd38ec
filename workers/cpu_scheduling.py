"""The Linux scheduling policy of a CPU server's processes: the serving path and Ray's daemons under
SCHED_BATCH, the model's compute thread (and the OpenMP team it starts) under SCHED_OTHER, so that
no wake-up of theirs preempts the model.

A served model shares its cores with the ingress, the engine's event loop, Ray's daemons (GCS,
raylet, dashboard agent, Serve controller: dozens of threads waking on timers and RPCs) and often
the client. Each wake-up of a SCHED_OTHER thread may preempt the model's thread on the spot; with
an OpenMP team the rest of the team then waits at the next barrier. A SCHED_BATCH thread gets the
same share of the CPU at the same nice value, but never preempts on waking: it takes an idle core,
or runs from the next tick (sched(7)). Switching between the two needs no privilege while the
nice value stays, and children inherit the policy, so `pagedray serve` puts itself under
SCHED_BATCH before it starts its local Ray (every Ray process and worker follows), and the
threads on the model's step path switch themselves back: each process's compute thread
(workers/compute_thread.py) and a tensor-parallel rank's plan reader (cluster/pipe_dispatch.py);
the threads they start (the OpenMP team, gloo's) inherit SCHED_OTHER from them.

Measured on 2 cores (`benchmarks/http_throughput.py`'s workload, one server, each pass alternated
with the policy on and off, 5 rounds): the model's thread was preempted 165-220 times a second
instead of 380-500 while streaming, 550-690 instead of 1,200-1,450 not streaming; streamed at
`--stream-interval 1` 1,320 against 1,259 output tok/s (median; batch won all 5 pairs, by 2-12%),
not streamed 1,725 against 1,724. Only the ingress and the engine replica's own threads under
SCHED_BATCH, Ray's daemons left as they were, gained nothing (1,108 against 1,122): their
wake-ups were the ones that cost.

`PAGEDRAY_SERVING_POLICY` holds what was chosen, and the processes of that Ray inherit it: `batch`
(the compute thread then leaves SCHED_BATCH) or `normal` (a user's opt-out: nothing changes).
"""

from __future__ import annotations

import os

POLICY_ENV = "PAGEDRAY_SERVING_POLICY"
BATCH = "batch"  # the other value, "normal", is a user's opt-out


def supported() -> bool:
    """Whether this OS has SCHED_BATCH (Linux) and per-thread policies."""
    return hasattr(os, "SCHED_BATCH") and hasattr(os, "sched_setscheduler")


def serve_under_batch_policy() -> bool:
    """Put the calling thread, and so every process it starts from now on, under SCHED_BATCH,
    and say so in `PAGEDRAY_SERVING_POLICY` for them; returns whether it did.

    Leaves everything as it is where the OS lacks the policy, where the variable says `normal`,
    or where the thread runs under another policy than SCHED_OTHER (a user's real-time or idle
    choice stands).
    """
    if not supported() or os.environ.get(POLICY_ENV, BATCH) != BATCH:
        return False
    if os.sched_getscheduler(0) not in (os.SCHED_OTHER, os.SCHED_BATCH):
        return False
    try:
        # NOTE: the plain call keeps the nice value; for these policies the priority is 0.
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
    except OSError:
        return False
    os.environ[POLICY_ENV] = BATCH
    return True


def run_model_under_normal_policy() -> None:
    """On a thread of the model's step path: back to SCHED_OTHER where
    `serve_under_batch_policy` put its process under SCHED_BATCH (threads it starts from now on,
    the OpenMP team among them, inherit it). A process under SCHED_BATCH for another reason keeps
    it."""
    if not supported() or os.environ.get(POLICY_ENV) != BATCH:
        return
    if os.sched_getscheduler(0) == os.SCHED_BATCH:
        os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
