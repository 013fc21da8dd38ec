"""The serving path under SCHED_BATCH, the model's thread and its OpenMP team under SCHED_OTHER.

Each case runs in a fresh Python process: a policy set here would pass to every process the rest
of the suite starts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from pagedray.workers.cpu_scheduling import POLICY_ENV, supported

pytestmark = pytest.mark.skipif(not supported(), reason="no SCHED_BATCH on this OS (Linux only)")

# A parallel op on the compute thread, run on 2 torch threads, so that its OpenMP team exists.
_COMPUTE_AND_REPORT = """
import torch
from pagedray.workers.compute_thread import OS_THREAD_NAME, compute_thread

def step():
    torch.set_num_threads(2)
    x = torch.randn(512, 512)
    for _ in range(20):
        x = torch.tanh(x @ x)
    return os.sched_getscheduler(0)

compute = compute_thread()
compute_policy = compute.run(step)

def comm(tid):
    with open(f"/proc/self/task/{tid}/comm") as f:
        return f.read().strip()

team = [int(t) for t in os.listdir("/proc/self/task") if comm(t) == OS_THREAD_NAME]
report["compute"] = compute_policy
report["team"] = sorted({os.sched_getscheduler(tid) for tid in team})
report["team_size"] = len(team)
report["main"] = os.sched_getscheduler(0)
"""


def _run(body: str, env: dict[str, str] | None = None) -> dict:
    """`body` in a fresh interpreter, which fills `report`; returns it."""
    script = "import json, os, subprocess, sys\nreport = {}\n" + textwrap.dedent(body)
    script += "\nprint(json.dumps(report))\n"
    child_env = {k: v for k, v in os.environ.items() if k != POLICY_ENV}
    child_env.update(env or {})
    result = subprocess.run(
        [sys.executable, "-c", script], env=child_env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.splitlines()[-1])


def test_a_server_and_what_it_starts_run_under_batch() -> None:
    report = _run(
        """
        from pagedray.workers.cpu_scheduling import serve_under_batch_policy
        report["switched"] = serve_under_batch_policy()
        report["self"] = os.sched_getscheduler(0)
        report["nice"] = os.getpriority(os.PRIO_PROCESS, 0)
        child = "import os; print(os.sched_getscheduler(0), os.environ['PAGEDRAY_SERVING_POLICY'])"
        report["child"] = subprocess.check_output([sys.executable, "-c", child], text=True).split()
        """
    )
    assert report["switched"] and report["self"] == os.SCHED_BATCH
    assert report["nice"] == os.getpriority(os.PRIO_PROCESS, 0)  # the nice value stays
    assert report["child"] == [str(os.SCHED_BATCH), "batch"]


def test_the_model_thread_and_its_openmp_team_leave_batch() -> None:
    switch = "from pagedray.workers.cpu_scheduling import serve_under_batch_policy\n"
    report = _run(switch + "assert serve_under_batch_policy()\n" + _COMPUTE_AND_REPORT)
    assert report["main"] == os.SCHED_BATCH
    assert report["compute"] == os.SCHED_OTHER
    assert report["team_size"] >= 2 and report["team"] == [os.SCHED_OTHER]


def test_a_process_under_batch_for_its_own_reasons_keeps_it() -> None:
    """Without the server's word (the variable), a batch job's model thread stays in batch."""
    report = _run(
        "os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))\n" + _COMPUTE_AND_REPORT
    )
    assert report["compute"] == os.SCHED_BATCH and report["team"] == [os.SCHED_BATCH]


def test_normal_opts_out() -> None:
    report = _run(
        """
        from pagedray.workers.cpu_scheduling import serve_under_batch_policy
        report["switched"] = serve_under_batch_policy()
        report["self"] = os.sched_getscheduler(0)
        """,
        env={POLICY_ENV: "normal"},
    )
    assert not report["switched"] and report["self"] == os.SCHED_OTHER
