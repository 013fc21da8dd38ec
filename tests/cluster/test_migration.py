"""What a request that may move carries from where it enters (cluster/migration.py): a sampled
request without a seed gets one, drawn anew for each request, so that a move goes on with the
draws it would have made; a greedy or seeded request, or one that may not move, is left as it
came. That a seeded request goes on token for token when it moves: test_engine_failover.py."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from pagedray.cluster.migration import MigrationPolicy, choice_request
from pagedray.engine.wire import GenerateRequest
from pagedray.scheduler.sampling_params import SamplingParams


def _request(**params: object) -> GenerateRequest:
    return GenerateRequest("r", [1, 2, 3], SamplingParams(max_tokens=8, **params))


@given(
    temperature=st.floats(min_value=0.0, max_value=2.0),
    seed=st.none() | st.integers(min_value=0, max_value=2**63 - 1),
    limit=st.integers(min_value=0, max_value=3),
    n=st.integers(min_value=1, max_value=3),
)
def test_only_a_sampled_unseeded_request_that_may_move_gets_a_seed(
    temperature: float, seed: int | None, limit: int, n: int
) -> None:
    request = _request(temperature=temperature, seed=seed, n=n)
    before = request.sampling_params
    MigrationPolicy(limit).seed_for_moving(request)
    after = request.sampling_params
    if limit > 0 and seed is None and not before.greedy:
        assert after.seed is not None and 0 <= after.seed < 2**63
        assert after.clone(seed=None) == before  # nothing else changed
    else:
        assert after == before


def test_each_request_gets_a_seed_of_its_own() -> None:
    seeds = set()
    for _ in range(64):
        request = _request(temperature=1.0)
        MigrationPolicy().seed_for_moving(request)
        seeds.add(request.sampling_params.seed)
    assert len(seeds) == 64  # as random as the unseeded draws they replace


def test_a_choice_that_moves_keeps_all_its_request_carries() -> None:
    """A choice of n > 1 that moves is its own request of one choice: its own seed and id, the
    output it had, the replicas that failed it, and all the rest of what its request carried
    (a reasoning model's grammar that holds after the thinking, among others); nothing the
    router set for the first attempt."""
    request = _request(temperature=1.0, seed=3, n=2, prompt_logprobs=1)
    request.priority, request.cache_salt, request.thinking_end_token_id = 5, "tenant", 42
    request.channel_id, request.routing_hashes = "ingress-1", [b"h"]
    request.failed_replica_ids = {"a"}
    choice = choice_request(request, 1, [7, 8])
    assert choice.request_id == "r-choice1" and choice.output_token_ids == [7, 8]
    assert choice.sampling_params.n == 1 and choice.sampling_params.prompt_logprobs is None
    assert choice.sampling_params.seed != request.sampling_params.seed
    assert (choice.priority, choice.cache_salt, choice.thinking_end_token_id) == (5, "tenant", 42)
    assert choice.channel_id is None and choice.routing_hashes is None
    assert (
        choice.failed_replica_ids == {"a"}
        and choice.failed_replica_ids is not request.failed_replica_ids
    )
