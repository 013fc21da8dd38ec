"""Tensor-parallel ranks on CPU take one side of the reserved-core question (workers/worker.py
`_reserve_pays`): each measures its projections' work, and all of them decide from the ranks'
mean. Here rank 0 measures a light model and rank 1 a heavy one: both must keep or both drop
the reserve, or the rank on fewer threads would hold up each all-reduce of every step. And a
rank that does not switch thread counts still joins the collective the others wait in."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from pagedray.tools.default_model import make_model
from pagedray.workers import worker as worker_module
from pagedray.workers.cpu_threads import break_even_work_s
from pagedray.workers.worker import Worker
from pagedray.workers.worker_config import WorkerConfig

ROWS = 16  # the probe's rows (RESERVE_PROBE_ROWS; the pool's max_num_seqs is larger)
JOIN_S = 120  # a rank left alone in the collective would wait for gloo's 30-minute timeout


def _rank(
    rank: int,
    model: str,
    init_method: str,
    works: tuple[float, float],
    num_threads: int | None,
    out: str,
) -> None:
    # This rank's measurement, as if its shard had been that light or that heavy.
    worker_module.projection_work = lambda *args, **kwargs: works[rank]  # type: ignore[assignment]
    torch.set_num_threads(1 + rank)  # what a rank without `num_threads` steps on
    config = WorkerConfig(
        model=model,
        dtype="float32",
        tensor_parallel_size=2,
        num_kv_blocks=8,
        num_threads=num_threads,
        quiet_num_threads=2,
        kv_offloading_size=0,
    )
    worker = Worker(config, rank, init_method)
    worker.init_kv_cache(8)
    Path(out, f"rank{rank}").write_text(str(worker.keeps_reserve))
    torch.distributed.barrier()
    os._exit(0)  # see test_tensor_parallel.py: gloo's teardown is not what is tested


def _decisions(tmp_path: Path, works: tuple[float, float], num_threads: int | None) -> list[str]:
    model = str(make_model(tmp_path / "m", "llama", "tiny"))
    init_method = f"file://{tmp_path / 'rendezvous'}"
    args = (model, init_method, works, num_threads, str(tmp_path))
    ranks = mp.spawn(_rank, args=args, nprocs=2, join=False)
    deadline = time.monotonic() + JOIN_S
    while not ranks.join(timeout=1):
        if time.monotonic() > deadline:
            for process in ranks.processes:
                process.kill()
            pytest.fail(f"the ranks did not finish in {JOIN_S} s (one waits in a collective)")
    return [(tmp_path / f"rank{r}").read_text() for r in (0, 1)]


@pytest.mark.parametrize(("heavy", "keeps"), [(3.0, False), (1.5, True)])
def test_ranks_agree_on_the_reserve(tmp_path: Path, heavy: float, keeps: bool) -> None:
    line = break_even_work_s(ROWS, 1, 2)
    # Alone, rank 0 would keep the reserve and rank 1 drop it; their mean decides for both.
    assert _decisions(tmp_path, (0.1 * line, heavy * line), 1) == [str(keeps)] * 2


def test_a_rank_that_does_not_switch_still_joins(tmp_path: Path) -> None:
    # No `num_threads`: rank 0 steps on 1 thread (it switches to 2 when quiet), rank 1 on 2
    # (it never switches). Both keep the default, after one collective.
    line = break_even_work_s(ROWS, 1, 2)
    assert _decisions(tmp_path, (3.0 * line, 3.0 * line), None) == ["True", "True"]
