"""The Ray actor around one tensor-parallel `Worker`: a process per rank, placed by the executor.

The constructor does nothing heavy, so the executor can first ask rank 0 where it lives and
which port is free, then start every rank's `Worker` against that rendezvous at the same time.
Steps arrive as actor calls, through a compiled graph's loop, or on a pipe thread
(cluster/pipe_dispatch.py); whichever way, one step runs at a time, and it runs on the process's
compute thread, which also built the worker (see workers/compute_thread.py).
"""

from __future__ import annotations

import pickle
import socket
import threading

import ray

from pagedray.cluster.pipe_dispatch import PipeWorkerLoop
from pagedray.cluster.replica_logging import log_to_stderr
from pagedray.scheduler.messages import ModelRunnerOutput, SchedulerOutput
from pagedray.workers.compute_thread import compute_thread
from pagedray.workers.worker import Worker
from pagedray.workers.worker_config import WorkerConfig


@ray.remote
class WorkerActor:
    """One rank. Resources (`num_cpus=1`, `num_gpus=1` on GPU) are set by the executor."""

    def __init__(self) -> None:
        log_to_stderr()  # before the rank's start-up lines
        self.worker: Worker | None = None
        self.pipe_loop: PipeWorkerLoop | None = None
        # NOTE: the pipe loop's thread runs steps next to the actor's own method calls; the
        # executor drives one path at a time, and this lock keeps it so even if it did not.
        self._step_lock = threading.Lock()

    def get_actor_id(self) -> str:
        actor_id = ray.get_runtime_context().get_actor_id()
        assert actor_id is not None  # called on an actor
        return actor_id

    def get_node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def get_node_ip_and_free_port(self) -> tuple[str, int]:
        """This node's IP and a TCP port free right now, for rank 0's `tcp://ip:port`."""
        # NOTE: the port is released before torch.distributed binds it; another process could
        # take it in between, which the rendezvous then reports as an address in use.
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("", 0))
            port = sock.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def init_worker(self, config: WorkerConfig, rank: int, init_method: str | None) -> None:
        """Join the TP group and load this rank's weight shard; blocks until all ranks join."""
        self.worker = compute_thread().run(Worker, config, rank, init_method)

    def determine_num_kv_blocks(self) -> int:
        return compute_thread().run(self._worker.determine_num_kv_blocks)

    def init_kv_cache(self, num_blocks: int) -> dict[str, str]:
        """Allocate the pool; the node's KV tiers' paths by name, those this rank opened."""
        return compute_thread().run(self._worker.init_kv_cache, num_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        """Run one step; rank 0 returns the sampled tokens, other ranks None (less to send)."""
        output = self._execute(scheduler_output)
        return output if self._worker.rank == 0 else None

    def execute_model_compiled(self, scheduler_output: bytes) -> bytes | None:
        """`execute_model` for the compiled graph: the plan and rank 0's output as pickles.

        Bound once into the graph; the graph's loop on this actor calls it every step.
        """
        # NOTE: a compiled-graph channel serializes a dataclass far slower than bytes (about
        # 150 µs more per step for an empty plan on 2 CPU cores); stdlib pickle takes ~10 µs.
        output = self.execute_model(pickle.loads(scheduler_output))
        return None if output is None else pickle.dumps(output, pickle.HIGHEST_PROTOCOL)

    def open_pipe_channel(self, plan_path: str, reply_path: str) -> None:
        """Open this rank's end of the driver's FIFOs (the driver holds the reply read end)."""
        assert self.pipe_loop is None, "a pipe channel is already open"
        self.pipe_loop = PipeWorkerLoop(self._worker.rank, plan_path, reply_path, self._execute)

    def start_pipe_loop(self) -> None:
        """Start reading plans, once the driver has opened the plan FIFO for writing."""
        assert self.pipe_loop is not None, "open_pipe_channel must run first"
        self.pipe_loop.start()

    def ping(self, value: object = None) -> object:
        """Echo: for liveness checks and for measuring bare dispatch cost."""
        return value

    def _execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        with self._step_lock:
            return compute_thread().run(self._worker.execute_model, scheduler_output)

    @property
    def _worker(self) -> Worker:
        assert self.worker is not None, "init_worker must run first"
        return self.worker
