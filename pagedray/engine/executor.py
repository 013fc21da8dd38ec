"""Executors run one step on every tensor-parallel rank and hand back rank 0's output.

`UniProcExecutor` keeps the single rank in this process (the offline `LLM` at TP=1); the Ray
executors in `ray_executor.py` drive worker actors.
"""

from __future__ import annotations

from pagedray.scheduler.messages import ModelRunnerOutput, SchedulerOutput
from pagedray.workers.worker import Worker
from pagedray.workers.worker_config import WorkerConfig


class UniProcExecutor:
    """One in-process worker: no serialization, no dispatch cost.

    It runs on the thread that calls it; its callers (`LLM`, `AsyncEngine`) build and step it on
    the process's compute thread (workers/compute_thread.py), so that OpenMP keeps one team.
    """

    # The plan is handed over, not pickled: it may carry a grammar bitmask still being filled.
    in_process = True

    def __init__(self, config: WorkerConfig) -> None:
        if config.tensor_parallel_size != 1:
            raise ValueError("tensor_parallel_size: the in-process executor runs exactly 1 rank")
        self.worker = Worker(config)
        self.num_kv_blocks = self.worker.determine_num_kv_blocks()
        self.kv_tiers = self.worker.init_kv_cache(self.num_kv_blocks)  # tier name -> file path

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute_model(scheduler_output)

    def shutdown(self) -> None:
        self.worker.runner = None
