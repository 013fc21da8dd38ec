"""Cache-aware ranking of engine replicas (cluster/engine_router.py over cluster/kv_views.py):
the longest cached leading prefix first, unless that replica is too loaded. The router itself,
with Serve, is exercised in test_openai_server.py."""

from __future__ import annotations

import pickle
from types import SimpleNamespace
from typing import Any

import pytest

from pagedray.cluster import engine_router, kv_views, replica_watch
from pagedray.cluster.engine_router import (
    EngineRequestRouter,
    RoutingDecision,
)
from pagedray.cluster.kv_views import KVViews
from pagedray.engine.wire import GenerateRequest, KVPull
from pagedray.scheduler.sampling_params import SamplingParams

H = [bytes([i]) * 8 for i in range(4)]


def _replica(unique_id: str) -> Any:
    return SimpleNamespace(replica_id=SimpleNamespace(unique_id=unique_id))


@pytest.fixture
def views(monkeypatch: pytest.MonkeyPatch) -> KVViews:
    views = KVViews()
    monkeypatch.setattr(kv_views, "KV_VIEWS", views)
    return views


@pytest.fixture(autouse=True)
def generating(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """This process's generation calls by replica (`replica_watch.generating`), for the test."""
    counts: dict[str, int] = {}
    monkeypatch.setattr(replica_watch, "_GENERATING", counts)
    return counts


def _router(load: dict[str, int], threshold: int = 4) -> EngineRequestRouter:
    router = EngineRequestRouter.__new__(EngineRequestRouter)  # no Serve: only the ranking
    replica_watch._GENERATING.update(load)
    router.load_threshold = threshold
    return router


def test_only_leading_blocks_count(views: KVViews) -> None:
    views.by_replica = {"a": {H[0], H[2], H[3]}, "b": {H[0], H[1]}}
    assert views.matched_blocks("a", H) == 1  # H[1] missing: what follows cannot be used
    assert views.matched_blocks("b", H) == 2
    assert views.matched_blocks("gone", H) == 0


def test_the_longest_match_goes_first(views: KVViews) -> None:
    a, b, c = _replica("a"), _replica("b"), _replica("c")
    views.by_replica = {"a": {H[0]}, "b": {H[0], H[1]}, "c": {H[0], H[1]}}
    ranked, decision = _router({"a": 0, "b": 3, "c": 1})._by_cached_prefix([a, b, c], H)
    assert ranked == [[b, c], [a]]  # ties go together: Serve takes the less loaded of them
    assert (decision.reason, decision.matched) == ("prefix_match", {"a": 1, "b": 2, "c": 2})


def test_no_match_or_too_loaded_falls_back(views: KVViews) -> None:
    a, b = _replica("a"), _replica("b")
    views.by_replica = {"a": {H[0], H[1]}, "b": set()}
    ranked, decision = _router({"a": 4, "b": 0}, threshold=4)._by_cached_prefix([a, b], H)
    assert ranked == [[a], [b]] and decision.reason == "prefix_match"
    ranked, decision = _router({"a": 5, "b": 0}, threshold=4)._by_cached_prefix([a, b], H)
    assert ranked == [[b], [a]]  # the lightest first
    assert (decision.reason, decision.matched) == ("load_fallback", {"a": 2, "b": 0})
    ranked, decision = _router({"a": 0, "b": 0})._by_cached_prefix([a, b], [H[3]])
    assert ranked == [] and (decision.reason, decision.matched) == ("no_match", {"a": 0, "b": 0})
    # A prompt shorter than a block: no hashes, nothing to find.
    ranked, decision = _router({"a": 0, "b": 0})._by_cached_prefix([a, b], [])
    assert ranked == [] and (decision.reason, decision.matched) == ("no_match", {"a": 0, "b": 0})


def test_with_nothing_to_match_the_less_loaded_of_two_goes_first() -> None:
    """Power of two choices by this process's generation calls, not by Serve's queue lengths
    (which count subscriptions and cancelled calls too)."""
    a, b, c = _replica("a"), _replica("b"), _replica("c")
    _router({"a": 3, "b": 1})
    assert engine_router._power_of_two([a, b]) == [[b], [a]]
    assert engine_router._power_of_two([a]) == [[a]]
    assert engine_router._power_of_two([]) == []
    firsts = set()
    for _ in range(50):  # equals: either first, by the draw
        ranked = engine_router._power_of_two([b, c] if len(firsts) % 2 else [c, b])
        replica_watch._GENERATING.update({"b": 0, "c": 0})
        firsts.add(ranked[0][0].replica_id.unique_id)
        assert sorted(r.replica_id.unique_id for group in ranked for r in group) == ["b", "c"]
    assert firsts == {"b", "c"}
    three = engine_router._power_of_two([a, b, c])
    assert len(three[0]) == 1 and len(three[1]) == 1  # two drawn of three


def test_blocks_in_a_nodes_tier_count_weighted_after_the_pools(views: KVViews) -> None:
    """A block the replica's node holds in its host tier is loaded, not computed: it counts,
    less than one in the pool, and only where it continues the pool's run."""
    a, b, c = _replica("a"), _replica("b"), _replica("c")
    views.by_replica = {"a": {H[0]}, "b": set(), "c": set()}
    views.tier_by_replica = {"a": {H[1], H[2]}, "b": set(H), "c": {H[1], H[2], H[3]}}
    router = _router({"a": 0, "b": 0, "c": 0})
    router.tier_weight = 0.75
    ranked, decision = router._by_cached_prefix([a, b, c], H)
    # a: 1 + 0.75 x 2; b: 0.75 x 4; c: its tier's run starts past H[0], which nothing holds.
    assert ranked == [[b], [a, c]]
    assert (decision.reason, decision.matched) == ("tier_match", {"a": 2.5, "b": 3.0, "c": 0.0})
    views.by_replica["a"] = {H[0], H[1]}
    views.tier_by_replica["a"] = {H[1], H[2], H[3]}
    ranked, decision = router._by_cached_prefix([a, b, c], H)
    assert ranked == [[a], [b, c]] and decision.reason == "prefix_match"  # 2 + 0.75 x 2
    router.tier_weight = 0.0  # pools only
    ranked, decision = router._by_cached_prefix([b, c], H)
    assert ranked == [] and decision.reason == "no_match"
    assert RoutingDecision("tier_match", {"a": 2.5, "b": 3.0}).for_replica("a") == (
        "load_fallback",
        2.5,
    )


def test_the_load_is_the_generation_calls_routed_and_not_ended(views: KVViews) -> None:
    """A call counts on its replica from the router's choice (before the event loop hears of
    it) to the end of its attempt; a choice that reaches the loop after the attempt ended is
    not left counted; a replica's other calls (subscriptions, probes) never count."""
    import asyncio

    from pagedray.cluster.migration import Placements

    watch = SimpleNamespace(hold=lambda *_: None, release=lambda *_: None)

    async def attempts() -> None:
        request = GenerateRequest("r", [1], SamplingParams())
        placements = Placements(request, watch, lambda _: None)  # type: ignore[arg-type]
        assert request.on_routed is not None
        placements.start_attempt()
        request.on_routed("a")  # the router's thread
        assert replica_watch.generating("a") == 1
        await asyncio.sleep(0)
        placements.end_attempt()
        assert replica_watch.generating("a") == 0
        request.on_routed("b")  # routed as the attempt ended
        assert replica_watch.generating("b") == 1
        await asyncio.sleep(0)
        assert replica_watch.generating("b") == 0

    asyncio.run(attempts())
    a, b = _replica("a"), _replica("b")
    views.by_replica = {"a": {H[0]}, "b": set()}
    assert _router({"a": 9}, threshold=4)._by_cached_prefix([a, b], H)[0] == [[b], [a]]


def test_the_decision_is_told_for_the_replica_that_took_the_call() -> None:
    matched = {"a": 3, "b": 1}
    assert RoutingDecision("prefix_match", matched).for_replica("a") == ("prefix_match", 3)
    # Serve went to the second rank (the best were full): a fallback, not a match.
    assert RoutingDecision("prefix_match", matched).for_replica("b") == ("load_fallback", 1)
    assert RoutingDecision("load_fallback", matched).for_replica("b") == ("load_fallback", 1)
    assert RoutingDecision("no_match", {"a": 0}).for_replica("new") == ("no_match", 0)
    assert RoutingDecision("load_only").for_replica("a") == ("load_only", None)


def test_a_routed_call_is_counted_once_and_its_decision_never_sent(views: KVViews) -> None:
    """The decision rides on the request from ranking to the replica that takes it, and neither
    it nor the routing hashes are pickled with the request."""
    recorded: list[tuple[str, str, int | None]] = []
    router = _router({"a": 0, "b": 0})
    router.metrics = SimpleNamespace(record=lambda *call: recorded.append(call))  # type: ignore[assignment]
    views.by_replica = {"a": {H[0], H[1]}, "b": {H[0]}}
    request = GenerateRequest("r", [1], SamplingParams(), routing_hashes=H)
    pending = SimpleNamespace(args=[request], kwargs={})
    _, decision = router._by_cached_prefix([_replica("a"), _replica("b")], H)
    engine_router._keep_decision(pending, decision)  # type: ignore[arg-type]
    router._record_decision(pending, "b")  # type: ignore[arg-type]
    router._record_decision(pending, "b")  # type: ignore[arg-type]  # no second count
    assert recorded == [("b", "load_fallback", 1)]
    assert request.routing_decision is None
    engine_router._keep_decision(pending, decision)  # type: ignore[arg-type]
    sent = pickle.loads(pickle.dumps(request))
    assert sent.routing_hashes is None and sent.routing_decision is None
    assert (sent.request_id, sent.prompt_token_ids) == ("r", [1])
    assert request.routing_hashes == H and request.routing_decision is decision


def test_a_request_moving_away_is_never_sent_back_to_a_replica_that_failed_it(
    views: KVViews,
) -> None:
    """Replicas that failed a request are out of its choice (none left: no choice, the router
    waits); the sender hears which replica the router took; neither travels with the request."""
    import asyncio
    import collections

    views.by_replica = {"a": {H[0], H[1]}, "b": set()}
    router = _router({"a": 0, "b": 0})
    router.metrics = None
    told: list[str] = []
    request = GenerateRequest("r", [1], SamplingParams(), routing_hashes=H, on_routed=told.append)
    request.failed_replica_ids.add("a")
    context = SimpleNamespace(should_backoff=False)
    pending = SimpleNamespace(args=[request], kwargs={}, routing_context=context)
    replica_id = collections.namedtuple("replica_id", "unique_id")  # hashable, as Serve's
    replicas = [SimpleNamespace(replica_id=replica_id(name)) for name in "ab"]
    router.apply_locality_routing = lambda pending: []  # type: ignore[method-assign]
    ranked = asyncio.run(router.choose_replicas(replicas, pending))  # type: ignore[arg-type]
    assert [[r.replica_id.unique_id for r in rank] for rank in ranked] == [["b"]]
    request.failed_replica_ids.add("b")
    assert asyncio.run(router.choose_replicas(replicas, pending)) == []  # type: ignore[arg-type]
    assert pending.routing_context.should_backoff  # Serve's router waits, never spins
    router._record_decision(pending, "b")  # type: ignore[arg-type]
    assert told == ["b"]
    sent = pickle.loads(pickle.dumps(request))
    assert sent.failed_replica_ids == set() and sent.on_routed is None


def test_a_request_sent_away_from_its_prefix_pulls_it_from_the_holder(views: KVViews) -> None:
    """Taken by a replica that holds fewer of its leading blocks (pool and node tier together)
    by at least `pull_min_blocks` than the best pool, a request carries where to pull them."""
    a, b = _replica("a"), _replica("b")
    views.by_replica = {"a": set(H), "b": {H[0]}}
    views.tier_by_replica = {"a": set(), "b": {H[1]}}
    router = _router({"a": 9, "b": 0}, threshold=4)
    router.tier_weight = 0.75
    _, decision = router._by_cached_prefix([a, b], H)
    assert decision.reason == "load_fallback"
    assert (decision.pooled, decision.tiered) == ({"a": 4, "b": 1}, {"a": 0, "b": 1})
    assert decision.pull_for("b", min_blocks=2) == KVPull("a", 4, 2)  # has 2 of 4
    assert decision.pull_for("b", min_blocks=3) is None
    assert decision.pull_for("a", min_blocks=1) is None  # the holder itself
    assert decision.pull_for("b", min_blocks=0) is None  # pulls off
    assert RoutingDecision("load_only").pull_for("b", min_blocks=1) is None
    request = GenerateRequest("r", [1], SamplingParams(), routing_hashes=H)
    pending = SimpleNamespace(args=[request], kwargs={})
    router.pull_min_blocks = 2
    engine_router._keep_decision(pending, decision)  # type: ignore[arg-type]
    router._record_decision(pending, "b")  # type: ignore[arg-type]
    assert pickle.loads(pickle.dumps(request)).pull_from == KVPull("a", 4, 2)  # it travels
    engine_router._keep_decision(pending, RoutingDecision("load_only"))  # type: ignore[arg-type]
    router._record_decision(pending, "a")  # type: ignore[arg-type]
    assert request.pull_from is None, "sent again: no pull left from the last routing"
    engine_router._keep_decision(pending, None)  # type: ignore[arg-type]
    request.pull_from = KVPull("a", 4, 2)
    router._record_decision(pending, "b")  # type: ignore[arg-type]
    assert request.pull_from is None


def test_blocks_on_a_nodes_disk_count_after_its_host_tiers_at_their_weight(
    views: KVViews,
) -> None:
    a, b = _replica("a"), _replica("b")
    views.by_replica = {"a": {H[0]}, "b": set()}
    views.tier_by_replica = {"a": {H[1]}, "b": set()}
    views.disk_by_replica = {"a": {H[2], H[3]}, "b": set(H)}
    router = _router({"a": 0, "b": 0})
    router.tier_weight, router.disk_weight = 0.75, 0.25
    ranked, decision = router._by_cached_prefix([a, b], H)
    # a: 1 + 0.75 + 0.25 x 2 = 2.25; b: its disk holds every block, 0.25 x 4 = 1.0.
    assert ranked == [[a], [b]] and decision.matched == {"a": 2.25, "b": 1.0}
    assert decision.tiered == {"a": 3, "b": 4}
    router.disk_weight = 0.0
    assert router._by_cached_prefix([a, b], H)[1].matched == {"a": 1.75, "b": 0.0}
