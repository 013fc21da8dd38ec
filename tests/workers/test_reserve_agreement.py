"""Tensor-parallel ranks on CPU take one side of the reserved-core question (workers/worker.py
`_reserve_pays`): each measures its projections' work, and all of them decide from the ranks'
mean. Here rank 0 measures a light model and rank 1 a heavy one; both must keep or both drop
the reserve, or the rank on fewer threads would hold up each all-reduce of every step."""

from __future__ import annotations

import os
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


def _rank(rank: int, model: str, init_method: str, works: tuple[float, float], out: str) -> None:
    # This rank's measurement, as if its shard had been that light or that heavy.
    worker_module.projection_work = lambda *args, **kwargs: works[rank]  # type: ignore[assignment]
    config = WorkerConfig(
        model=model,
        dtype="float32",
        tensor_parallel_size=2,
        num_kv_blocks=8,
        num_threads=1,
        quiet_num_threads=2,
        kv_offloading_size=0,
    )
    worker = Worker(config, rank, init_method)
    worker.init_kv_cache(8)
    Path(out, f"rank{rank}").write_text(str(worker.keeps_reserve))
    torch.distributed.barrier()
    os._exit(0)  # see test_tensor_parallel.py: gloo's teardown is not what is tested


@pytest.mark.parametrize(("heavy", "keeps"), [(3.0, False), (1.5, True)])
def test_ranks_agree_on_the_reserve(tmp_path: Path, heavy: float, keeps: bool) -> None:
    model = str(make_model(tmp_path / "m", "llama", "tiny"))
    line = break_even_work_s(ROWS, 1, 2)
    # Alone, rank 0 would keep the reserve and rank 1 drop it; their mean decides for both.
    works = (0.1 * line, heavy * line)
    init_method = f"file://{tmp_path / 'rendezvous'}"
    mp.spawn(_rank, args=(model, init_method, works, str(tmp_path)), nprocs=2, join=True)
    decisions = [(tmp_path / f"rank{r}").read_text() for r in (0, 1)]
    assert decisions == [str(keeps)] * 2, decisions
