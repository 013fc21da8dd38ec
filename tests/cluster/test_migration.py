"""What a request that may move carries from where it enters (cluster/migration.py): a sampled
request without a seed gets one, drawn anew for each request, so that a move goes on with the
draws it would have made; a greedy or seeded request, or one that may not move, is left as it
came. That a seeded request goes on token for token when it moves: test_engine_failover.py."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from pagedray.cluster.migration import MigrationPolicy
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
