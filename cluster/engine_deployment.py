"""The engine Serve deployment: each replica is one scheduler actor with its own TP workers.

A replica reserves a placement group (its own bundle, then one per TP rank, STRICT_PACK), builds
the engine inside it so the worker actors land in bundles 1..TP, and runs the continuous-batching
loop. More replicas = more independent engines; Serve routes requests among them.
"""

from __future__ import annotations

import asyncio
import logging
import pickle
from typing import Any, AsyncIterator, Callable, cast

from ray import serve
from ray.serve import Deployment
from ray.serve.config import RequestRouterConfig

from pagedray.cluster.engine_autoscaling import report as autoscaling_report
from pagedray.cluster.engine_metrics import EngineMetrics
from pagedray.cluster.engine_router import (
    DEFAULT_DISK_WEIGHT,
    DEFAULT_LOAD_THRESHOLD,
    DEFAULT_PULL_MIN_BLOCKS,
    DEFAULT_TIER_WEIGHT,
    EngineRequestRouter,
)
from pagedray.cluster.kv_puller import KVPuller
from pagedray.cluster.placement import engine_bundles, resolve_use_gpu
from pagedray.cluster.replica_logging import (
    STATS_LOG_NAME,
    log_through_serve,
    on_console,
    serve_logs_to_stderr,
)
from pagedray.engine.async_engine import DEFAULT_STUCK_AFTER_S, SAVE_ON_EXIT_S, AsyncEngine
from pagedray.engine.config import EngineConfig
from pagedray.engine.kv_index_publisher import KVIndexPublisher, pack_delta
from pagedray.engine.output_channel import IDLE_S as OUTPUT_CHANNEL_IDLE_S
from pagedray.engine.output_channel import OutputChannels
from pagedray.engine.output_processor import OutputProcessor
from pagedray.engine.request_errors import failure_of
from pagedray.engine.stats_log import stats_log_for
from pagedray.engine.wire import GenerateRequest, RequestStepOutput
from pagedray.scheduler.kv_transfer import KVExport, TierAddress
from pagedray.scheduler.prefix_hash import BlockHash
from pagedray.workers.compute_thread import compute_thread
from pagedray.workers.cpu_threads import RESERVED_SERVING_CORES, serving_thread_counts

# Serve's default of 5 concurrent requests per replica would starve continuous batching.
MAX_ONGOING_REQUESTS = 4096
# Seconds Serve waits for a health check before it replaces the replica; a replica that holds
# requests but stops answering loses them sooner (cluster/replica_watch.py).
HEALTH_CHECK_TIMEOUT_S = 30.0
# Serve asks each replica this often whether its engine steps; a dead one is replaced then.
DEFAULT_HEALTH_CHECK_PERIOD_S = 2.0
# Draining: a replica being removed (scale-down, rolling update, shutdown) gets no new requests,
# and Serve waits for its calls this long before it kills it. Its requests end by their deadline
# (`request_timeout_s`), then its output channels within `IDLE_S`: that, plus a margin, lets
# every one finish. Without a deadline, an hour. Serve's own default, 20 s, would cut them off.
DRAIN_MARGIN_S = 10.0
NO_DEADLINE_DRAIN_S = 3600.0
# How often a draining replica looks whether its calls are done (Serve's default: 2 s). Serve
# waits this long before it first looks, so an idle replica's stop takes at least this: a
# redeploy, a scale-in and a Ctrl-C each wait for it. A look counts the replica's calls, and
# Serve logs a line for each while calls remain (so not more often).
DRAIN_POLL_S = 0.5

EngineBuilder = Callable[[EngineConfig], tuple[Any, Any, Any, Any]]

logger = logging.getLogger(__name__)


@serve.deployment(
    name="PagedRayEngine",
    max_ongoing_requests=MAX_ONGOING_REQUESTS,
    health_check_period_s=DEFAULT_HEALTH_CHECK_PERIOD_S,
    health_check_timeout_s=HEALTH_CHECK_TIMEOUT_S,
    # The ingress writes the one access line per HTTP request; Serve's per-call line here (each
    # generate, health and stats call) is off, and `generate` logs its own at DEBUG. NOTE: being
    # set, it is not replaced by an application-level `logging_config` (Serve applies that only
    # to deployments without one); a Serve config sets this deployment's own to change it.
    logging_config={"enable_access_log": False},
)
class EngineDeployment:
    """One engine: scheduler and KV block table here, TP workers in this replica's group."""

    def __init__(
        self,
        config: dict[str, Any],
        stuck_after_s: float = DEFAULT_STUCK_AFTER_S,
        engine_builder: EngineBuilder | None = None,
    ) -> None:
        """`engine_builder` (default `_replica_engine`) lets tests inject a faulty engine."""
        log_through_serve()  # before the engine's start-up lines
        self.config = _with_serving_threads(EngineConfig.model_validate(config))
        # Built on the thread that will step it (see workers/compute_thread.py).
        engine, self.executor, _, _ = compute_thread().run(
            engine_builder or _replica_engine, self.config
        )
        if engine.scheduler.structured is not None:
            engine.scheduler.structured.prepare()  # before this replica counts as ready
        # The name clients use, as the ingress answers it: the `model_name` tag of every metric.
        model_name = self.config.served_name()
        self.engine = AsyncEngine(
            engine,
            # Token ids only: the ingress makes the text (and finds stop strings).
            OutputProcessor(None),
            stuck_after_s,
            metrics=EngineMetrics(model_name),
            request_timeout_s=self.config.request_timeout_s or None,
            stats_log=stats_log_for(self.config, resolve_use_gpu(self.config.device)),
        )
        if not self.config.disable_log_stats and not serve_logs_to_stderr():
            on_console(STATS_LOG_NAME)
        self.replica_id = _replica_id()
        self.channels = OutputChannels(self.engine.abort)
        # With KV cache events on, routers follow this engine's prefix cache (subscribe_kv).
        self.kv_index = KVIndexPublisher() if self.config.enable_kv_cache_events else None
        tier = engine.scheduler.kv_cache_manager.host_tier
        self.tier_address = TierAddress(_node_id(), tier.path) if tier is not None else None
        self.puller = KVPuller(self.engine, self.replica_id, self.tier_address)

    async def generate(self, request: GenerateRequest) -> RequestStepOutput:
        """A request, the one call shape: one unary call, answered when the request ends. A
        failure is an answer with `error` set, never raised (engine/engine_client.py's
        contract); cancelling the call aborts the request.

        With a `channel_id` (a streamed request), its outputs go through that output channel
        as they come, and the answer, unless a refusal or a failure, is an empty finished output
        naming this replica. Without one, the request wants one output (`stream_interval` None),
        and the answer is that output: the request and its answer are the only two messages.
        """
        logger.debug(
            "generate %s: %d prompt tokens", request.request_id, len(request.prompt_token_ids)
        )
        self._publish_kv_deltas()
        request_id, channel_id = request.request_id, request.channel_id
        if channel_id is None and request.stream_interval is not None:  # a caller's bug
            return error_output(request_id, RuntimeError("a streamed request needs a channel"))
        if request.pull_from is not None:  # before its channel opens: the caller may go
            await self.puller.pull(request, request.pull_from)
        channel = self.channels.open(channel_id) if channel_id is not None else None
        ended: asyncio.Future[RequestStepOutput] = asyncio.get_running_loop().create_future()

        def sink(item: RequestStepOutput | BaseException) -> None:
            # NOTE: called by the engine loop: it must not raise.
            if ended.done():
                return
            if isinstance(item, BaseException):
                ended.set_result(error_output(request_id, item))
                return
            if channel is None:
                ended.set_result(item)  # the one output, at the end
                return
            channel.put(item)
            if item.finished:
                ended.set_result(
                    RequestStepOutput(request_id, finished=True, replica_id=self.replica_id)
                )

        try:
            self.engine.submit(request, sink)
        except Exception as exc:  # noqa: BLE001 - refused: reported to the client, not raised
            return error_output(request_id, exc)
        if channel is not None:
            channel.request_ids.add(request_id)
        answer = None
        try:
            answer = await ended
            return answer
        finally:
            finished = answer is not None and answer.error is None
            if not finished:  # cancelled (the client went away) or failed: nothing more comes
                self.engine.abort(request_id)
            if channel_id is not None:
                self.channels.end_request(channel_id, request_id, discard_outputs=not finished)

    async def export_kv(
        self, block_hashes: list[BlockHash], puller: TierAddress, replica_id: str
    ) -> KVExport:
        """The leading run of `block_hashes` this replica caches, saved into its node's tier
        for `puller` (an engine that would compute them), their bytes included when `puller`
        uses another tier; addressed to `replica_id` as `subscribe` is."""
        if replica_id != self.replica_id:
            raise RuntimeError(f"engine replica {replica_id} is gone")
        if self.tier_address is None or not puller.same_blocks_as(self.tier_address):
            # Another model layout or arithmetic (its tier file is another): its blocks would
            # not be the bits the puller computes.
            return KVExport([])
        return await self.engine.export_kv(block_hashes, puller != self.tier_address)

    async def subscribe(self, channel_id: str, replica_id: str) -> AsyncIterator[bytes]:
        """Output channel `channel_id`'s batches, one per step, while the caller reads: each a
        pickled `list[RequestStepOutput]`.

        `replica_id` is the replica the caller addressed (`EngineRequestRouter` routes such a
        call there, or anywhere if that replica is gone): another replica refuses the call.
        """
        if replica_id != self.replica_id:
            raise RuntimeError(f"engine replica {replica_id} is gone")
        async for batch in self.channels.subscribe(channel_id):
            # NOTE: Serve pickles what a replica yields with cloudpickle's Python-level pickler:
            # 0.18 ms for a step of 64 outputs here, against 0.08 for the C pickler.
            yield pickle.dumps(batch, pickle.HIGHEST_PROTOCOL)

    async def subscribe_kv(self, replica_id: str) -> AsyncIterator[bytes]:
        """This replica's prefix-cache index (and its node host tier's) for a cache-aware
        router, while the caller reads: a snapshot, then each step's changes, each a pickled
        `pack_delta` of routing hashes (kv_index_publisher.py), until idle. Addressed to
        `replica_id` as `subscribe` is."""
        if replica_id != self.replica_id:
            raise RuntimeError(f"engine replica {replica_id} is gone")
        if self.kv_index is None:
            raise RuntimeError("this engine records no KV cache events (enable_kv_cache_events)")
        self._publish_kv_deltas()
        async for delta in self.kv_index.subscribe():
            yield pickle.dumps(pack_delta(delta), pickle.HIGHEST_PROTOCOL)

    def _publish_kv_deltas(self) -> None:
        """From now on, hand each step's KV delta to the publisher (on this event loop).

        NOTE: here, not in `__init__`, which may run without the event loop the hand-over
        needs; the first health check comes before any request. Nothing is lost meanwhile: the
        recorder keeps every change from the engine's start (or a snapshot) for the first take.
        """
        core = self.engine.core
        if self.kv_index is not None and core.kv_delta_listener is None:
            core.kv_delta_listener = self.kv_index.listener(asyncio.get_running_loop())

    async def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)

    async def health(self) -> dict[str, Any]:
        self.engine.start()
        self._publish_kv_deltas()
        return {**self.engine.health(), "replica_id": self.replica_id}

    async def liveness(self, replica_id: str) -> str | None:
        """Why this engine makes no progress (`AsyncEngine.stalled`), or None: an ingress's
        probe of a replica that holds its requests (cluster/replica_watch.py), addressed to
        `replica_id` as `subscribe` is. Answered on the event loop, so a wedged or stopped
        process does not answer at all."""
        if replica_id != self.replica_id:
            raise RuntimeError(f"engine replica {replica_id} is gone")
        return self.engine.stalled()

    async def check_health(self) -> None:
        """Serve's health hook: raising marks this replica unhealthy (Serve then replaces it)."""
        health = await self.health()
        if not health["healthy"]:
            raise RuntimeError(health["error"])

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve's custom autoscaling metrics: this engine's load (engine_autoscaling.py)."""
        return autoscaling_report(self.engine.stats())

    async def stats(self) -> dict[str, Any]:
        return {
            **self.engine.stats(),
            "replica_id": self.replica_id,
            "num_output_channels": len(self.channels),
            "num_channel_batches": self.channels.num_batches,
            "num_kv_subscribers": self.kv_index.num_subscribers if self.kv_index else 0,
            # Torch threads per rank, while a request streams (unless the model outweighs the
            # serving path: workers/cpu_threads.py) and while none does; None on a GPU.
            "num_threads": self.config.num_threads,
            "quiet_num_threads": self.config.quiet_num_threads,
        }

    def __del__(self) -> None:
        """Serve's shutdown hook (a drain, a scale-down, a redeploy): after the requests
        drained, the pool's cache goes to the node's host tier, then the ranks stop."""
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.save_cache_to_tier(SAVE_ON_EXIT_S)
        executor = getattr(self, "executor", None)
        if executor is not None:
            executor.shutdown()


def _replica_engine(config: EngineConfig) -> tuple[Any, Any, None, None]:
    """The replica's engine and executor (ranks in its process, or actors at TP > 1), and no
    tokenizer or validator: the ingress makes and reads the text. Only its grammars read the
    tokenizer, in the constructor (`StructuredOutputManager.prepare`)."""
    from pagedray.cluster.ray_executor import executor_factory
    from pagedray.engine.engine_factory import build_engine_core

    engine, executor = build_engine_core(config, executor_factory(config))
    return engine, executor, None, None


def error_output(request_id: str, exc: BaseException) -> RequestStepOutput:
    """An exception that ended a request, as the output that tells its caller (a typed
    `RequestFailure`: the ingress chooses the status)."""
    return RequestStepOutput(request_id, error=failure_of(exc, request_id))


def engine_deployment_options(
    config: EngineConfig,
    num_replicas: int = 1,
    autoscaling_config: dict[str, Any] | None = None,
    health_check_period_s: float = DEFAULT_HEALTH_CHECK_PERIOD_S,
    routing_load_threshold: int = DEFAULT_LOAD_THRESHOLD,
    routing_tier_weight: float = DEFAULT_TIER_WEIGHT,
    routing_disk_weight: float = DEFAULT_DISK_WEIGHT,
    routing_pull_min_blocks: int = DEFAULT_PULL_MIN_BLOCKS,
) -> dict[str, Any]:
    """Serve options for one engine per replica, each with its own STRICT_PACK group, routed by
    `EngineRequestRouter` (its load threshold, and its metrics tagged with the model's name)."""
    use_gpu = resolve_use_gpu(config.device) if _ray_ready() else config.device == "cuda"
    in_process = config.tensor_parallel_size == 1 and not config.use_ray_workers
    # An in-process rank runs in the replica itself, so the replica's bundle holds its device.
    bundles = engine_bundles(config.tensor_parallel_size, use_gpu)
    if in_process:
        bundles = [bundles[1]]
    head = bundles[0]
    options: dict[str, Any] = {
        "placement_group_bundles": bundles,
        "placement_group_strategy": "STRICT_PACK",
        "ray_actor_options": {"num_cpus": head["CPU"], "num_gpus": head.get("GPU", 0)},
        "health_check_period_s": health_check_period_s,
        "graceful_shutdown_timeout_s": drain_timeout_s(config),
        "graceful_shutdown_wait_loop_s": DRAIN_POLL_S,
        "request_router_config": RequestRouterConfig(
            request_router_class=cast(Any, EngineRequestRouter),  # a class, or its import path
            request_router_kwargs={
                "load_threshold": routing_load_threshold,
                "tier_weight": routing_tier_weight,
                "disk_weight": routing_disk_weight,
                "pull_min_blocks": routing_pull_min_blocks,
                "model_name": config.served_name(),
            },
        ),
    }
    if autoscaling_config is not None:
        options["autoscaling_config"] = autoscaling_config
    else:
        options["num_replicas"] = num_replicas
    return options


def drain_timeout_s(config: EngineConfig) -> float:
    """Seconds a removed replica may take to finish its requests (see `DRAIN_MARGIN_S`)."""
    deadline = config.request_timeout_s or NO_DEADLINE_DRAIN_S
    return deadline + OUTPUT_CHANNEL_IDLE_S + DRAIN_MARGIN_S


def engine_deployment(config: EngineConfig, **options: Any) -> Deployment:
    """The engine deployment configured for `config` (see `engine_deployment_options`)."""
    # NOTE: `serve.deployment` made the class a Deployment, which mypy cannot see.
    return cast(Deployment, EngineDeployment).options(
        **engine_deployment_options(config, **options)
    )


def _ray_ready() -> bool:
    import ray

    return ray.is_initialized()


def _node_id() -> str:
    import ray

    return ray.get_runtime_context().get_node_id() if ray.is_initialized() else "local"


def _replica_id() -> str:
    try:
        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # noqa: BLE001 - outside Serve (unit tests)
        return "local"


def _with_serving_threads(config: EngineConfig) -> EngineConfig:
    """`config` with torch threads per CPU rank set, where it leaves them to us: all the node's
    cores but one, which the ingress and this replica's loop need, while a request streams;
    all of them while none does (workers/cpu_threads.py)."""
    if config.num_threads is not None or _uses_gpu(config):
        return config
    counts = serving_thread_counts(config.tensor_parallel_size)
    if config.quiet_num_threads is not None:  # the config's own stands
        counts["quiet_num_threads"] = config.quiet_num_threads
    logger.info(
        "%d torch thread(s) per rank while a request streams (the node's cores but %d, unless "
        "the model outweighs the serving path), %d while none does, over %d rank(s) "
        "(--num-threads fixes it)", counts["num_threads"],
        RESERVED_SERVING_CORES, counts["quiet_num_threads"], config.tensor_parallel_size,
    )  # fmt: skip
    return config.model_copy(update=counts)


def _uses_gpu(config: EngineConfig) -> bool:
    """Whether this replica's ranks run on GPUs: any bundle of its group holds one."""
    from ray.util import get_current_placement_group

    group = get_current_placement_group() if _ray_ready() else None
    if group is not None:
        return any(bundle.get("GPU", 0) >= 1 for bundle in group.bundle_specs)
    if config.device != "auto":
        return config.device == "cuda"
    return _ray_ready() and resolve_use_gpu("auto")
