"""The engine deployment's request router: by cached prefix, else power-of-two choices, plus calls
addressed to one replica (an ingress following that replica's outputs or KV index) delivered there.

Cache-aware: a request that carries its routing hashes (the ingress adds them when the engines
publish their prefix caches, cluster/kv_views.py) goes to the replica holding most of its
leading blocks, unless that replica's load exceeds the lightest's by `load_threshold` ongoing
requests (then the lightest; SGLang's router balances the same way); with no match (or no
hashes: `--routing power-of-two`) it is the lesser loaded of two drawn at random. A replica's
load here is this process's generation calls on it (`replica_watch.generating`), as each SGLang
router counts its own.

A Serve handle has no way to call one chosen replica; a request router sees each call's
arguments and can. Serve builds it from the deployment's `request_router_config` in every
process that holds a handle to the engines (the ingress replicas, and an engine replica that
pulls blocks from another, cluster/kv_puller.py).

NOTE: a routing task's replica goes to the oldest call waiting, as in Serve's own router: the
calls one HTTP request makes (a batch of prompts, a subscription) share Serve's internal request
id, so matching by id cannot tell them apart. An addressed call is only ever given its replica.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass
from typing import Any

from ray.serve.request_router import (
    LocalityMixin,
    PendingRequest,
    ReplicaID,
    RequestRouter,
    RunningReplica,
)

# NOTE: the modules, not their globals: Serve pickles this router's module by value into each
# process that routes, and a global bound here would travel as a copy of the ingress's views
# instead of naming them; a module is pickled by name, so `kv_views.KV_VIEWS` is this process's
# (and `replica_watch.UNHEALTHY_REPLICA_IDS` likewise).
from pagedray.cluster import kv_views, replica_watch
from pagedray.cluster.ingress_metrics import RouterMetrics
from pagedray.engine.output_channel import REPLICA_ID_KWARG
from pagedray.engine.wire import GenerateRequest, KVPull

# Ongoing requests (this process's on each) by which the best-matching replica may exceed the
# lightest and still be chosen.
DEFAULT_LOAD_THRESHOLD = 32
# Leading blocks by which a replica's pool must out-hold the one a request went to (load) for
# that one to pull them from it (scheduler/kv_transfer.py) rather than compute them: a pull
# waits for the holder's step in flight (tens of ms when loaded) and a round trip, which a few
# blocks' prefill costs less than (512 tokens at 16 a block).
DEFAULT_PULL_MIN_BLOCKS = 32
# What a block in a replica's node's host KV tier counts for against one in its pool: it is
# loaded rather than computed, but loaded (Dynamo's router weighs a host-tier block so).
DEFAULT_TIER_WEIGHT = 0.75
# And one in its node's disk tier (Dynamo's disk weight): read from a file, slower still.
DEFAULT_DISK_WEIGHT = 0.25


# The reasons of a call sent where its prefix is: its pool's blocks, or only its node's tier's.
MATCHES = ("prefix_match", "tier_match")


@dataclass(frozen=True)
class RoutingDecision:
    """Why a call was ranked as it was: the reason and, for a prefix match, how many leading
    blocks each candidate replica caches (by replica id; its node tier's weighted)."""

    reason: str  # a `RouterMetrics` reason
    matched: dict[str, float] | None = None  # pool blocks + the tier's, weighted
    pooled: dict[str, int] | None = None  # leading blocks in each replica's pool
    tiered: dict[str, int] | None = None  # then in its node's tiers (host, then disk)

    def for_replica(self, replica_id: str) -> tuple[str, float | None]:
        """The reason and matched blocks (weighted) for the replica that took the call: a
        prefix or tier match that Serve gave to a less-matching replica (the best were full)
        is a load fallback."""
        if self.matched is None:
            return self.reason, None
        blocks = self.matched.get(replica_id, 0)
        if self.reason in MATCHES and blocks < max(self.matched.values()):
            return "load_fallback", blocks
        return self.reason, blocks

    def pull_for(self, replica_id: str, min_blocks: int) -> KVPull | None:
        """Where `replica_id` should pull the prompt's leading blocks from: the replica whose
        pool holds at least `min_blocks` more of them than `replica_id` has in its pool and
        node tier together (0: never); None when none does."""
        if self.pooled is None or self.tiered is None or min_blocks <= 0:
            return None
        holder = max(self.pooled, key=self.pooled.__getitem__)
        held = self.pooled[holder]
        have = self.pooled.get(replica_id, 0) + self.tiered.get(replica_id, 0)
        if holder == replica_id or held - have < min_blocks:
            return None
        return KVPull(holder, held, have)


class EngineRequestRouter(LocalityMixin, RequestRouter):
    """The replicas caching most of a request's prefix (cache-aware, see the module), else two
    random replicas (same node first), the less loaded taken; a call with `replica_id=...` goes
    to that replica, or, if it is gone, to any (which then refuses it, so that it fails at once
    instead of waiting); a request that replicas failed goes to none of them, nor, while
    another is there, to a replica found to make no progress (cluster/replica_watch.py). Cache-aware
    ranking ignores locality: a cached prefix saves more than a hop."""

    _live_replica_ids: frozenset[str] = frozenset()
    load_threshold: int = DEFAULT_LOAD_THRESHOLD
    tier_weight: float = DEFAULT_TIER_WEIGHT
    disk_weight: float = DEFAULT_DISK_WEIGHT
    pull_min_blocks: int = DEFAULT_PULL_MIN_BLOCKS
    metrics: RouterMetrics | None = None

    def initialize_state(
        self,
        load_threshold: int = DEFAULT_LOAD_THRESHOLD,
        model_name: str | None = None,
        tier_weight: float = DEFAULT_TIER_WEIGHT,
        disk_weight: float = DEFAULT_DISK_WEIGHT,
        pull_min_blocks: int = DEFAULT_PULL_MIN_BLOCKS,
        **kwargs: Any,
    ) -> None:
        """`request_router_kwargs` of the deployment's `request_router_config`; with
        `model_name`, each routed call is counted (`RouterMetrics`)."""
        super().initialize_state(**kwargs)
        self.load_threshold = load_threshold
        self.tier_weight = tier_weight
        self.disk_weight = disk_weight
        self.pull_min_blocks = pull_min_blocks
        self.metrics = RouterMetrics(model_name) if model_name is not None else None

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        self._live_replica_ids = frozenset(r.replica_id.unique_id for r in replicas)
        kv_views.KV_VIEWS.set_live_replicas(self._live_replica_ids)
        replica_watch.set_live_replicas(self._live_replica_ids)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        # NOTE: Serve drops a replica whose call failed with ActorDiedError here, well before
        # its controller's update: the calls addressed to it must then go elsewhere at once.
        super().on_replica_actor_died(replica_id)
        self._live_replica_ids = self._live_replica_ids - {replica_id.unique_id}
        kv_views.KV_VIEWS.set_live_replicas(self._live_replica_ids)
        replica_watch.set_live_replicas(self._live_replica_ids)

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        target = addressed_replica(pending_request)
        if target is not None:
            addressed = [r for r in candidate_replicas if r.replica_id.unique_id == target]
            if pending_request is not None and not addressed:
                pending_request.routing_context.should_backoff = True  # never a busy loop
            return [addressed or candidate_replicas[:1]]
        # A replica that makes no progress is routed around while another is there.
        unhealthy = replica_watch.UNHEALTHY_REPLICA_IDS
        healthy = [r for r in candidate_replicas if r.replica_id.unique_id not in unhealthy]
        candidate_replicas = healthy or candidate_replicas
        request = _generate_request(pending_request)
        if request is not None and request.failed_replica_ids:  # a request moving elsewhere
            failed = request.failed_replica_ids
            candidate_replicas = [
                r for r in candidate_replicas if r.replica_id.unique_id not in failed
            ]
            if not candidate_replicas:  # none yet: back off (the sender gives up in time)
                if pending_request is not None:
                    pending_request.routing_context.should_backoff = True  # never a busy loop
                return []
        by_id = {replica.replica_id: replica for replica in candidate_replicas}
        local = [by_id[i] for i in self.apply_locality_routing(pending_request) if i in by_id]
        pool = local or candidate_replicas
        hashes = _routing_hashes(pending_request)
        ranked: list[list[RunningReplica]] = []
        decision = RoutingDecision("load_only")
        if hashes is not None and len(candidate_replicas) > 1:
            # A prompt shorter than a block has no hashes: nothing of it can be cached.
            ranked, decision = self._by_cached_prefix(candidate_replicas, hashes)
        _keep_decision(pending_request, decision)
        if ranked:
            return ranked
        return _power_of_two(pool)

    def _by_cached_prefix(
        self, replicas: list[RunningReplica], hashes: list[bytes]
    ) -> tuple[list[list[RunningReplica]], RoutingDecision]:
        """The replicas holding the longest cached prefix first (then the rest, should those be
        full); the least loaded first when the best match is too loaded; none when nothing
        matches (power of two decides). A replica's match is
        the leading blocks its pool holds, plus those that follow in its node's host tier
        weighted by `tier_weight`, then in its disk tier by `disk_weight` (a `tier_match` when
        no best replica's pool has any)."""
        views = kv_views.KV_VIEWS
        ids = [r.replica_id.unique_id for r in replicas]
        pooled = [views.matched_blocks(replica_id, hashes) for replica_id in ids]
        hosted = [views.tier_blocks(replica_id, hashes, n) for replica_id, n in zip(ids, pooled)]
        on_disk = [
            views.disk_blocks(replica_id, hashes, n + h)
            for replica_id, n, h in zip(ids, pooled, hosted)
        ]
        matched = [
            n + self.tier_weight * h + self.disk_weight * d
            for n, h, d in zip(pooled, hosted, on_disk)
        ]
        by_id = dict(zip(ids, matched))
        tiered = [h + d for h, d in zip(hosted, on_disk)]
        blocks = {"pooled": dict(zip(ids, pooled)), "tiered": dict(zip(ids, tiered))}
        best = max(matched, default=0)
        if best == 0:
            return [], RoutingDecision("no_match", by_id)
        best_pooled = (n for n, m in zip(pooled, matched) if m == best)
        reason = "prefix_match" if any(best_pooled) else "tier_match"
        # This process's generation calls per replica (see `replica_watch.count_generation`).
        load = [replica_watch.generating(replica_id) for replica_id in ids]
        best_load = min(n for n, m in zip(load, matched) if m == best)
        if best_load - min(load) > self.load_threshold:
            lightest = [r for r, n in zip(replicas, load) if n == min(load)]
            rest = [r for r, n in zip(replicas, load) if n > min(load)]
            return [lightest, rest], RoutingDecision("load_fallback", by_id, **blocks)
        first = [r for r, m in zip(replicas, matched) if m == best]
        ranked = [first, [r for r, m in zip(replicas, matched) if m < best]]
        return ranked, RoutingDecision(reason, by_id, **blocks)

    def _fulfill_next_pending_request(
        self, replica: RunningReplica, request_metadata: Any = None
    ) -> None:
        """Give `replica` to the call it was chosen for, if that one still waits, else to the
        oldest waiting call that may have it (see the NOTE above).

        NOTE: the call a routing task routes is known by the task (Serve records it), and it
        must get its replica: cache-aware choices depend on the call's prompt, and a routing
        task that paused (a queue-length probe) must not hand its choice to a newer call.
        Overrides a private hook of Serve's `RequestRouter` (as its FIFO mixin does), using
        the same private bookkeeping; pinned Ray version.
        """
        unique_id = replica.replica_id.unique_id
        pending_calls = self._pending_requests_to_fulfill
        routing_task = asyncio.current_task()
        own = [
            position
            for position, pending in enumerate(pending_calls)
            if self._routing_task_by_pending_request_future.get(pending.future) is routing_task
        ]
        for position in [*own, *range(len(pending_calls))]:
            pending = pending_calls[position]
            if pending.future.done():
                continue
            target = addressed_replica(pending)
            if target not in (None, unique_id) and target in self._live_replica_ids:
                continue  # addressed to another replica, which is there to take it
            request = _generate_request(pending)
            if request is not None and unique_id in request.failed_replica_ids:
                continue  # moving away from that replica
            del pending_calls[position]  # by position: no __eq__ scan
            self._cancel_routing_task_for_pending_request(pending)
            self._record_queue_wait_time(pending)
            self._record_decision(pending, unique_id)
            pending.future.set_result(replica)
            self._remove_pending_request_from_indices(pending)
            return

    def _record_decision(self, pending: PendingRequest, replica_id: str) -> None:
        """Tell the sender that the call `pending` goes to `replica_id` (a streamed request's
        outputs come through that replica's channel), count it, name the replica it should
        pull its prefix from if any, and take its decision out of the request (before the
        request is sent)."""
        request = _generate_request(pending)
        if request is None:
            return
        if request.on_routed is not None:
            request.on_routed(replica_id)
        decision, request.routing_decision = request.routing_decision, None
        # Set on every routing: a call sent again must not pull from where it failed before.
        request.pull_from = None
        if isinstance(decision, RoutingDecision):
            request.pull_from = decision.pull_for(replica_id, self.pull_min_blocks)
        if decision is not None and self.metrics is not None:
            self.metrics.record(replica_id, *decision.for_replica(replica_id))


def _generate_request(pending_request: PendingRequest | None) -> GenerateRequest | None:
    """The engine request a call carries; None for calls that are not the engines' generation
    calls (health, stats, subscriptions)."""
    if pending_request is None or not pending_request.args:
        return None
    request = pending_request.args[0]
    return request if isinstance(request, GenerateRequest) else None


def _keep_decision(pending_request: PendingRequest | None, decision: RoutingDecision) -> None:
    """Leave `decision` on the call's request until a replica takes it (a retry replaces it);
    it never leaves this process (`GenerateRequest` does not pickle it)."""
    request = _generate_request(pending_request)
    if request is not None:
        request.routing_decision = decision


def _power_of_two(pool: list[RunningReplica]) -> list[list[RunningReplica]]:
    """Two replicas drawn at random, the one with fewer of this process's generation calls first
    (the draw's order among equals); Serve's probe then takes the first unless it is full.

    NOTE: not Serve's own comparison of the two's queue lengths: those also count this process's
    subscriptions and liveness probes, and cancelled calls for seconds after they ended; with
    them, twelve concurrent streams once all went to one of two idle replicas."""
    pair = random.sample(pool, k=min(2, len(pool)))
    pair.sort(key=lambda replica: replica_watch.generating(replica.replica_id.unique_id))
    return [group for group in (pair[:1], pair[1:]) if group]


def _routing_hashes(pending_request: PendingRequest | None) -> list[bytes] | None:
    """The call's routing hashes; None when the ingress gave none (not cache-aware)."""
    request = _generate_request(pending_request)
    return request.routing_hashes if request is not None else None


def addressed_replica(pending_request: PendingRequest | None) -> str | None:
    kwargs: dict[str, Any] = pending_request.kwargs if pending_request is not None else {}
    return kwargs.get(REPLICA_ID_KWARG)
