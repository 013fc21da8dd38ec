"""Drives an engine's tensor-parallel worker actors: one `SchedulerOutput` in, rank 0's tokens out.

Every rank gets the same plan each step (they run the same forward pass, joined by all-reduces);
only rank 0 samples. How a step reaches the ranks is a `_Dispatcher`: named pipes on the node
(the default: tens of microseconds, and nothing spins between steps), a Ray Compiled Graph
(shared-memory channels set up once, but its readers busy-poll), or plain actor calls (about a
millisecond of Ray task overhead per step; works wherever Ray does).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import pickle
import time
import uuid
from typing import TYPE_CHECKING, Any, Literal, Protocol, cast

import ray
from ray.actor import ActorHandle
from ray.dag import DAGNode, InputNode, MultiOutputNode
from ray.util.placement_group import PlacementGroup

from pagedray.cluster.pipe_dispatch import PipeDispatcher
from pagedray.cluster.placement import EnginePlacement, ensure_ray, reserve_placement
from pagedray.cluster.worker_actor import WorkerActor
from pagedray.scheduler.messages import ModelRunnerOutput, SchedulerOutput
from pagedray.workers.worker_config import WorkerConfig

if TYPE_CHECKING:  # types only: the engine factory imports the tokenizer libraries
    from pagedray.engine.config import EngineConfig
    from pagedray.engine.engine_factory import ExecutorFactory

logger = logging.getLogger(__name__)

Dispatch = Literal["actor", "compiled", "pipe"]
DISPATCHES: tuple[Dispatch, ...] = ("actor", "compiled", "pipe")
# Seconds to wait for killed actors to be reported dead, so their CPUs are free on return.
_SHUTDOWN_WAIT_S = 30.0


class _Dispatcher(Protocol):
    """Sends one plan to every rank and returns rank 0's output."""

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...

    def shutdown(self) -> None: ...


class ActorCallDispatcher:
    """One `execute_model.remote()` per rank per step, then `ray.get` of all of them."""

    def __init__(self, workers: list[ActorHandle]) -> None:
        self.workers = workers

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        # NOTE: wait for every rank, not just rank 0, so a failure on any rank surfaces here.
        outputs: list[ModelRunnerOutput] = ray.get(
            [w.execute_model.remote(scheduler_output) for w in self.workers]
        )
        return outputs[0]

    def shutdown(self) -> None:
        pass


class CompiledGraphDispatcher:
    """A Ray Compiled Graph: input fanned out to every rank, every rank's output read back.

    The plan crosses the graph's shared-memory channels pickled (see
    `WorkerActor.execute_model_compiled`); it is still the same `SchedulerOutput` dataclass.
    NOTE: channel readers poll, so while the graph exists each idle rank (and the driver while
    it waits) keeps burning part of a core; on a machine with fewer cores than ranks + 1 this
    slows the forward pass itself, and `shutdown()` is what stops it.
    """

    def __init__(self, workers: list[ActorHandle]) -> None:
        with InputNode() as scheduler_output:
            # NOTE: every rank's output must be read, not only rank 0's, or results pile up
            # in the graph's buffers; ranks other than 0 return None, which costs little.
            outputs: list[DAGNode] = [
                w.execute_model_compiled.bind(scheduler_output) for w in workers
            ]
            dag = MultiOutputNode(outputs)
        self.graph = dag.experimental_compile(_submit_timeout=-1)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        refs = self.graph.execute(pickle.dumps(scheduler_output, pickle.HIGHEST_PROTOCOL))
        # NOTE: no timeout (-1), as with `ray.get` on the actor path: a step may legitimately
        # take long (a big prefill, kernels compiled on first use); the graph's default is 10 s.
        outputs = [ref.get(timeout=-1) for ref in refs]
        return pickle.loads(outputs[0])

    def shutdown(self) -> None:
        self.graph.teardown()


def executor_factory(config: EngineConfig) -> ExecutorFactory | None:
    """How `build_engine` should run `config`'s ranks: None (its default: the one rank in the
    engine's process) or worker actors driven by a `RayExecutor` over `config.dispatch`."""
    if config.in_process:
        return None
    return functools.partial(RayExecutor, dispatch=config.dispatch)


class RayExecutor:
    """Starts one worker actor per TP rank in the engine's placement group and steps them.

    Attributes:
        num_kv_blocks: KV blocks every rank can hold (the minimum over ranks); the scheduler's
            block pool is sized with it.
        kv_tiers: the node's KV tier files every rank opened, by name ("host", "disk").
        workers: actor handles, index = rank.
        actor_ids: the workers' Ray actor ids, index = rank.
        actor_names: the workers' actor names, index = rank: `pagedray-<engine>-rank<r>`, as
            the Ray dashboard's Actors page shows them.
        dispatch: the dispatch path in use (pipes fall back to the compiled graph when this
            process is not on the workers' node).
    """

    def __init__(
        self,
        worker_config: WorkerConfig,
        dispatch: Dispatch = "pipe",
        placement_group: PlacementGroup | None = None,
    ) -> None:
        if dispatch not in DISPATCHES:
            raise ValueError(f"dispatch must be one of {DISPATCHES}, got {dispatch!r}")
        tp = worker_config.tensor_parallel_size
        ensure_ray(min_cpus=1 + tp)
        self.placement: EnginePlacement = reserve_placement(
            tp, worker_config.device, placement_group
        )
        self.worker_config = _rank_config(worker_config, self.placement.use_gpu)
        self.workers: list[ActorHandle] = []
        self.actor_ids: list[str] = []
        self.kv_tiers: dict[str, str] = {}
        self._dispatcher: _Dispatcher | None = None
        self.dispatch: Dispatch = dispatch
        try:
            self._start_workers()
            self.num_kv_blocks = self._init_kv_caches()
            self.dispatch = self._usable_dispatch(dispatch)
            self._dispatcher = _make_dispatcher(self.dispatch, self.workers)
        except BaseException:
            self.shutdown()
            raise

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Send the same plan to every rank; return rank 0's sampled tokens."""
        assert self._dispatcher is not None, "executor is shut down"
        return self._dispatcher.execute_model(scheduler_output)

    def dead_rank(self) -> int | None:
        """A rank known to have exited while no step ran (pipe dispatch only); else None."""
        if isinstance(self._dispatcher, PipeDispatcher):
            return self._dispatcher.dead_rank()
        return None

    def shutdown(self) -> None:
        """Stop the dispatch, kill the workers and remove a group created here; idempotent."""
        if self._dispatcher is not None:
            try:
                self._dispatcher.shutdown()
            except Exception:  # a dead worker can fail the teardown; it is killed below anyway
                logger.exception("tearing down the worker dispatch failed")
            self._dispatcher = None
        for worker in self.workers:
            ray.kill(worker, no_restart=True)
        _wait_until_dead(self.workers)
        self.workers = []
        self.placement.release()

    def _start_workers(self) -> None:
        cfg = self.worker_config
        num_gpus = 1 if self.placement.use_gpu else 0
        engine = _engine_label()
        self.actor_names = [f"pagedray-{engine}-rank{r}" for r in range(cfg.tensor_parallel_size)]
        # NOTE: Ray's decorator gives the class `options` at run time, which mypy cannot see.
        actor_class: Any = WorkerActor
        self.workers = [
            actor_class.options(
                name=name,
                num_cpus=1,
                num_gpus=num_gpus,
                scheduling_strategy=self.placement.scheduling_strategy(rank),
            ).remote()
            for rank, name in enumerate(self.actor_names)
        ]
        self.actor_ids = ray.get([w.get_actor_id.remote() for w in self.workers])
        init_method = None
        if cfg.tensor_parallel_size > 1:
            address: Any = ray.get(self.workers[0].get_node_ip_and_free_port.remote())
            ip, port = cast(tuple[str, int], address)
            init_method = f"tcp://{ip}:{port}"
        # All ranks at once: the rendezvous returns only when every rank has joined.
        ray.get(
            [w.init_worker.remote(cfg, rank, init_method) for rank, w in enumerate(self.workers)]
        )

    def _init_kv_caches(self) -> int:
        fits: list[int] = ray.get([w.determine_num_kv_blocks.remote() for w in self.workers])
        num_blocks = min(fits)
        tiers: list[dict[str, str]] = ray.get(
            [w.init_kv_cache.remote(num_blocks) for w in self.workers]
        )
        # Every rank must hold its shard of a saved block, or no rank may load it; and the
        # scheduler reads the file's records, so it must be on the ranks' node.
        if self._workers_on_this_node():
            self.kv_tiers = {
                name: path for name, path in tiers[0].items() if all(name in t for t in tiers)
            }
        return num_blocks

    def _workers_on_this_node(self) -> bool:
        here = ray.get_runtime_context().get_node_id()
        return set(ray.get([w.get_node_id.remote() for w in self.workers])) == {here}

    def _usable_dispatch(self, dispatch: Dispatch) -> Dispatch:
        """`dispatch`, unless pipes were asked for and this process is not on the workers' node.

        The group keeps the ranks together, but a driver joined to a cluster from elsewhere
        (`LLM` with `address="auto"` on another machine) shares no FIFOs with them.
        """
        if dispatch != "pipe" or self._workers_on_this_node():
            return dispatch
        logger.warning(
            "dispatch='pipe' needs the workers on this process's node; using dispatch='compiled'"
        )
        return "compiled"


def _make_dispatcher(dispatch: Dispatch, workers: list[ActorHandle]) -> _Dispatcher:
    if dispatch == "pipe":
        return PipeDispatcher(workers)
    if dispatch == "compiled":
        return CompiledGraphDispatcher(workers)
    return ActorCallDispatcher(workers)


def _rank_config(config: WorkerConfig, use_gpu: bool) -> WorkerConfig:
    """The config each rank gets: the device decided by placement, one torch thread per CPU."""
    if use_gpu:
        return dataclasses.replace(config, device="cuda")
    # NOTE: each rank holds one logical CPU of the group; more threads than that oversubscribe
    # the node's cores (two ranks of two threads on two cores run matmuls many times slower).
    return dataclasses.replace(config, device="cpu", num_threads=config.num_threads or 1)


def _engine_label() -> str:
    """Which engine the ranks belong to, for their actor names: the Serve engine replica's id
    (as the dashboard lists the replica), else a fresh id (an offline `LLM`). Unique while the
    ranks live, as a named actor's name must be."""
    try:
        from ray import serve

        return f"replica-{serve.get_replica_context().replica_id.unique_id}"
    except Exception:  # noqa: BLE001 - not in a Serve replica
        return f"llm-{uuid.uuid4().hex[:8]}"


def _wait_until_dead(workers: list[ActorHandle]) -> None:
    """Ping each killed actor until Ray reports it dead (a ping may still beat the kill)."""
    deadline = time.monotonic() + _SHUTDOWN_WAIT_S
    for worker in workers:
        while time.monotonic() < deadline:
            try:
                ray.get(worker.ping.remote(), timeout=max(0.0, deadline - time.monotonic()))
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                break
            time.sleep(0.01)
