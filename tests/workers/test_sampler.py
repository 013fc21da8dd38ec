"""Sampler semantics on CPU: greedy paths, seeded reproducibility, filters, penalties, logprobs."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedray.scheduler.request_failure import FailureKind
from pagedray.scheduler.sampling_params import SamplingParams
from pagedray.workers.inverse_cdf import inverse_cdf, snap_to_weighted
from pagedray.workers.sampler import (
    Sampler,
    SamplingRow,
    apply_allowed_and_bad_words,
    apply_min_tokens,
    apply_penalties,
)

EOS = 7
VOCAB = 16


def make_sampler(seed: int = 0) -> Sampler:
    return Sampler(eos_token_ids=(EOS,), default_generator=torch.Generator().manual_seed(seed))


def row(
    seed: int | None = None,
    prompt: list[int] | None = None,
    output: list[int] | None = None,
    num_samples: int = 1,
    **params: object,
) -> SamplingRow:
    return SamplingRow(
        params=SamplingParams(seed=seed, **params),  # type: ignore[arg-type]
        seed=seed,
        prompt_token_ids=prompt if prompt is not None else [1, 2, 3],
        output_token_ids=output if output is not None else [],
        num_samples=num_samples,
    )


def random_logits(num_rows: int, vocab: int = VOCAB, seed: int = 0) -> torch.Tensor:
    return torch.randn(num_rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def tokens(sampled: list) -> list[list[int]]:
    return [s.token_ids for s in sampled]


def test_greedy_is_argmax() -> None:
    logits = random_logits(5)  # [5, VOCAB]
    out = make_sampler()(logits, [row(temperature=0.0) for _ in range(5)])
    assert tokens(out) == [[t] for t in logits.argmax(dim=-1).tolist()]
    assert all(s.logprobs is None for s in out)


def test_batch_greedy_fast_path_equals_per_row_and_general_path() -> None:
    logits = random_logits(8)
    original = logits.clone()
    sampler = make_sampler()
    batch = tokens(sampler(logits, [row(temperature=0.0) for _ in range(8)]))
    per_row = [sampler(logits[i : i + 1], [row(temperature=0.0)])[0].token_ids for i in range(8)]
    assert batch == per_row
    # A no-op penalty (no output tokens yet) forces the general path for the whole batch.
    rows = [row(temperature=0.0) for _ in range(7)] + [row(temperature=0.0, presence_penalty=1.0)]
    assert tokens(sampler(logits, rows)) == batch
    assert torch.equal(logits, original)  # the sampler never mutates its input


def test_seeded_rows_independent_of_batch_composition() -> None:
    logits = random_logits(4, vocab=64)
    target = logits[2:3]
    alone = make_sampler(0)(target, [row(seed=1234, num_samples=16, top_p=0.9)])
    others = [
        row(temperature=0.7, top_k=5),
        row(temperature=0.0),
        row(seed=1234, num_samples=16, top_p=0.9),
        row(temperature=1.3, min_p=0.1, num_samples=3),
    ]
    mixed = make_sampler(99)(logits, others)
    assert mixed[2].token_ids == alone[0].token_ids
    assert len(set(alone[0].token_ids)) > 1  # really sampled, not collapsed to one token
    other_seed = make_sampler(0)(target, [row(seed=4321, num_samples=16, top_p=0.9)])
    assert other_seed[0].token_ids != alone[0].token_ids


def test_seeded_draw_is_keyed_by_output_position() -> None:
    """Same seed and position: the same draw, whatever came before (a recomputed request);
    the next position: a fresh draw, not a repeat of the last."""
    logits = random_logits(1, vocab=64)
    sampler = make_sampler(0)
    first = sampler(logits, [row(seed=5, output=[1, 2], num_samples=32)])[0].token_ids
    sampler(logits, [row(seed=5, output=[9], num_samples=32)])  # unrelated draws in between
    again = sampler(logits, [row(seed=5, output=[3, 4], num_samples=32)])[0].token_ids
    assert again == first
    assert sampler(logits, [row(seed=5, output=[1, 2, 3], num_samples=32)])[0].token_ids != first


def test_top_k_1_and_tiny_top_p_are_greedy() -> None:
    logits = random_logits(6, seed=3)
    expected = [[t] * 4 for t in logits.argmax(dim=-1).tolist()]
    sampler = make_sampler()
    assert tokens(sampler(logits, [row(top_k=1, num_samples=4) for _ in range(6)])) == expected
    assert tokens(sampler(logits, [row(top_p=1e-6, num_samples=4) for _ in range(6)])) == expected


def test_top_p_keeps_smallest_set_reaching_p() -> None:
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    out = make_sampler()(logits, [row(seed=0, top_p=0.8, num_samples=2000)])
    assert set(out[0].token_ids) == {0, 1}  # 0.5 + 0.3 reaches 0.8


def test_min_p_drops_unlikely_tokens() -> None:
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    out = make_sampler()(probs.log(), [row(seed=0, min_p=0.5, num_samples=2000)])
    assert set(out[0].token_ids) == {0, 1}  # 0.15 and 0.05 are below 0.5 * 0.5


@pytest.mark.parametrize("temperature", [1.0, 2.0, 0.5])
def test_temperature_distribution(temperature: float) -> None:
    base = torch.tensor([0.1, 0.2, 0.3, 0.4])
    expected = base ** (1.0 / temperature)
    expected = expected / expected.sum()
    num = 20000
    out = make_sampler()(
        base.log().unsqueeze(0), [row(seed=7, temperature=temperature, num_samples=num)]
    )
    counts = torch.bincount(torch.tensor(out[0].token_ids), minlength=4).float()
    chi_square = (((counts - num * expected) ** 2) / (num * expected)).sum().item()
    assert chi_square < 25.0  # df = 3: p < 1e-4 for a correct sampler


def test_unseeded_rows_use_default_generator() -> None:
    logits = random_logits(3, vocab=64)
    rows = [row(num_samples=8) for _ in range(3)]
    first = tokens(make_sampler(5)(logits, rows))
    assert first == tokens(make_sampler(5)(logits, rows))
    assert first != tokens(make_sampler(6)(logits, rows))


def test_penalties_change_logits_exactly() -> None:
    raw = [2.0, -1.0, 0.5, 3.0, -2.0, 1.0]
    logits = torch.tensor([raw, raw])
    rows = [
        # prompt has 0 and 4; output has 1 twice and 2 once
        row(prompt=[0, 4], output=[1, 1, 2], repetition_penalty=2.0),
        row(prompt=[0, 4], output=[1, 1, 2], presence_penalty=0.5, frequency_penalty=0.25),
    ]
    apply_penalties(logits, rows)
    # HF repetition over prompt + output: positive / p, negative * p; 3 and 5 were never seen
    assert logits[0].tolist() == [1.0, -2.0, 0.25, 3.0, -4.0, 1.0]
    # OpenAI over output only: -= presence * seen + frequency * count
    assert logits[1].tolist() == [2.0, -1.0 - 0.5 - 0.5, 0.5 - 0.5 - 0.25, 3.0, -2.0, 1.0]


def _dense_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """The penalties over whole rows, the plain way: the reference the sparse update matches."""
    out = logits.clone()
    for i, r in enumerate(rows):
        params = r.params
        counts = torch.zeros(logits.shape[1])
        for token in r.output_token_ids:
            counts[token] += 1
        seen = counts > 0
        if params.repetition_penalty != 1.0:
            for token in r.prompt_token_ids:
                seen[token] = True
            penalty = torch.tensor(params.repetition_penalty)
            out[i] = torch.where(
                seen, torch.where(out[i] > 0, out[i] / penalty, out[i] * penalty), out[i]
            )
        out[i] = (
            out[i]
            - torch.tensor(params.frequency_penalty) * counts
            - torch.tensor(params.presence_penalty) * (counts > 0)
        )
    return out


@settings(max_examples=100, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.lists(st.integers(0, VOCAB - 1), max_size=8),  # prompt
            st.lists(st.integers(0, VOCAB - 1), max_size=8),  # output
            st.sampled_from([1.0, 0.5, 1.3]),  # repetition
            st.sampled_from([0.0, -1.5, 0.25]),  # frequency
            st.sampled_from([0.0, 2.0, -0.5]),  # presence
        ),
        min_size=1,
        max_size=5,
    ),
    st.integers(0, 2**31 - 1),
)
def test_sparse_penalties_equal_the_dense_reference(cases: list, seed: int) -> None:
    rows = [
        row(prompt=prompt, output=output, repetition_penalty=rep, frequency_penalty=freq,
            presence_penalty=pres)
        for prompt, output, rep, freq, pres in cases
    ]  # fmt: skip
    logits = random_logits(len(rows), seed=seed)
    expected = _dense_penalties(logits, rows)
    apply_penalties(logits, rows)
    assert torch.equal(logits, expected)


def test_rows_without_penalties_untouched() -> None:
    logits = random_logits(2)
    original = logits.clone()
    apply_penalties(logits, [row(output=[1, 2]), row(output=[3], frequency_penalty=1.0)])
    assert torch.equal(logits[0], original[0])
    assert logits[1, 3].item() == pytest.approx(original[1, 3].item() - 1.0)


def test_repetition_penalty_changes_greedy_choice() -> None:
    logits = torch.tensor([[0.0, 2.0, 1.5, 0.0]])
    sampler = make_sampler()
    assert tokens(sampler(logits, [row(temperature=0.0, output=[1])])) == [[1]]
    rows = [row(temperature=0.0, prompt=[0], output=[1], repetition_penalty=2.0)]
    assert tokens(sampler(logits, rows)) == [[2]]


def test_min_tokens_blocks_eos_and_stop_token_ids() -> None:
    logits = torch.zeros(1, VOCAB)
    logits[0, EOS] = 10.0
    logits[0, 3] = 9.0  # a stop token id
    logits[0, 5] = 8.0
    sampler = make_sampler()
    short = row(temperature=0.0, min_tokens=2, output=[1], stop_token_ids=[3])
    assert tokens(sampler(logits, [short])) == [[5]]
    done = row(temperature=0.0, min_tokens=2, output=[1, 1], stop_token_ids=[3])
    assert tokens(sampler(logits, [done])) == [[EOS]]
    sampled = row(seed=0, min_tokens=2, stop_token_ids=[3, 10_000], num_samples=500)
    assert not {EOS, 3} & set(sampler(torch.zeros(1, VOCAB), [sampled])[0].token_ids)


def test_ignore_eos_leaves_eos_unmasked() -> None:
    logits = torch.zeros(1, VOCAB)
    logits[0, EOS] = 10.0
    logits[0, 3] = 9.0
    rows = [row(temperature=0.0, min_tokens=4, ignore_eos=True, stop_token_ids=[3])]
    assert tokens(make_sampler()(logits, rows)) == [[EOS]]
    masked = logits.clone()
    apply_min_tokens(masked, rows, (EOS,))
    assert masked[0, EOS].item() == 10.0 and masked[0, 3].item() == -math.inf


def test_logprobs_come_from_raw_logits() -> None:
    logits = random_logits(3, seed=11)
    raw_logprobs = torch.log_softmax(logits, dim=-1)
    rows = [
        row(seed=3, logprobs=4, output=[0, 1, 2], repetition_penalty=1.5, temperature=0.8),
        row(temperature=0.0),
        row(temperature=0.0, logprobs=0),
    ]
    out = make_sampler()(logits, rows)
    assert out[1].logprobs is None
    ids, values, rank = out[0].logprobs[0]
    sampled = out[0].token_ids[0]
    assert ids[0] == sampled and len(ids) == len(values) == 5
    assert values[0] == pytest.approx(raw_logprobs[0, sampled].item(), abs=1e-6)
    assert rank == int((raw_logprobs[0] > raw_logprobs[0, sampled]).sum()) + 1
    expected_top = raw_logprobs[0].topk(4)
    assert ids[1:] == expected_top.indices.tolist()
    assert values[1:] == pytest.approx(expected_top.values.tolist(), abs=1e-6)
    assert values[1:] == sorted(values[1:], reverse=True)
    assert out[2].logprobs == [
        ([out[2].token_ids[0]], [pytest.approx(raw_logprobs[2].max().item(), abs=1e-6)], 1)
    ]


def test_draws_in_the_kept_scratch_change_nothing_across_steps() -> None:
    """The sampler draws in a copy of the logits it keeps from step to step: the caller's logits
    stay as they were, and one sampler's seeded draws over steps of growing, shrinking and mixed
    (greedy and random) batches equal a fresh sampler's for each step."""
    kept = make_sampler()
    for step, num_rows in enumerate([3, 6, 2, 6, 4, 7]):
        logits = random_logits(num_rows, seed=step)
        before = logits.clone()
        mixed = step % 2 == 0  # a greedy row among them; else every row drawn in the scratch
        rows = [
            row(seed=10 + i, output=[i, 0] * step, temperature=0.7 + 0.1 * i, min_p=0.02)
            if i != 1 or not mixed
            else row(temperature=0.0, repetition_penalty=1.3, output=[2] * step)
            for i in range(num_rows)
        ]
        assert tokens(kept(logits, rows)) == tokens(make_sampler()(logits.clone(), rows))
        assert torch.equal(logits, before)


def test_num_samples_returns_that_many_tokens() -> None:
    logits = random_logits(2, vocab=64, seed=5)
    rows = [row(seed=1, num_samples=4, logprobs=2), row(temperature=0.0, num_samples=4)]
    out = make_sampler()(logits, rows)
    assert len(out[0].token_ids) == 4 and len(out[0].logprobs) == 4
    assert [lp[0][0] for lp in out[0].logprobs] == out[0].token_ids
    assert out[1].token_ids == [int(logits[1].argmax())] * 4
    # the fast path repeats the argmax too
    fast = make_sampler()(logits, [row(temperature=0.0, num_samples=4, logprobs=1)] * 2)
    assert tokens(fast) == [[int(t)] * 4 for t in logits.argmax(dim=-1)]
    assert all(lp[2] == 1 for lp in fast[0].logprobs)


def test_logit_bias_is_added_before_everything_else() -> None:
    logits = random_logits(3, vocab=VOCAB, seed=4)
    top = logits.argmax(dim=-1).tolist()
    rows = [
        row(temperature=0.0, logit_bias={top[0]: -100.0}),  # the argmax banned
        row(seed=2, num_samples=64, logit_bias={5: 100.0}),  # one token all but certain
        row(temperature=0.0),  # untouched
    ]
    out = make_sampler()(logits, rows)
    expected_first = logits[0].clone()
    expected_first[top[0]] -= 100.0
    assert out[0].token_ids == [int(expected_first.argmax())]
    assert out[1].token_ids == [5] * 64
    assert out[2].token_ids == [top[2]]
    # A biased greedy batch leaves the argmax fast path.
    alone = make_sampler()(logits[:1], [row(temperature=0.0, logit_bias={top[0]: -100.0})])
    assert alone[0].token_ids == out[0].token_ids


def test_allowed_token_ids_keep_only_those_tokens() -> None:
    logits = random_logits(3, seed=5)
    allowed = [2, 9, 11]
    rows = [
        row(temperature=0.0, allowed_token_ids=allowed),
        row(seed=3, num_samples=200, allowed_token_ids=allowed),
        row(temperature=0.0),  # untouched
    ]
    out = make_sampler()(logits, rows)
    assert out[0].token_ids == [allowed[int(logits[0, allowed].argmax())]]
    assert set(out[1].token_ids) <= set(allowed) and len(set(out[1].token_ids)) > 1
    assert out[2].token_ids == [int(logits[2].argmax())]


@pytest.mark.parametrize(
    ("output", "words", "banned"),
    [
        ([], [[4]], {4}),  # a one-token word: always
        ([], [[2, 4]], set()),  # nothing written yet: the word cannot be at its last token
        ([1, 2], [[2, 4]], {4}),  # "2" just written: its "4" is banned
        ([2, 1], [[2, 4]], set()),  # written, but not last
        ([1, 2, 3], [[2, 3, 4], [3, 5], [9, 3, 6]], {4, 5}),  # two words match, one does not
        ([3], [[1, 2, 3, 4]], set()),  # longer than the output plus one
    ],
)
def test_bad_words_ban_a_word_s_last_token_after_the_rest_of_it(
    output: list[int], words: list[list[int]], banned: set[int]
) -> None:
    """vLLM's rule (v1/sample/ops/bad_words.py): a word's last token is banned where the
    output ends with the word's other tokens (a one-token word always); nothing else changes."""
    logits = torch.zeros(1, VOCAB)
    sampled = row(temperature=0.0, output=output)
    sampled.params.bad_words_token_ids = words
    apply_allowed_and_bad_words(logits, [sampled])
    assert {t for t in range(VOCAB) if logits[0, t] == -math.inf} == banned


def test_a_row_whose_own_masks_leave_nothing_fails_alone_and_says_why() -> None:
    """allowed_token_ids with every allowed token a bad word (greedy: an argmax over nothing
    would be token 0; sampled: no probabilities): that request fails, naming its parameters;
    its neighbours are sampled."""
    logits = random_logits(3, seed=6)
    dead_greedy = row(temperature=0.0, allowed_token_ids=[5])
    dead_greedy.params.bad_words_token_ids = [[5]]
    dead_sampled = row(seed=1, allowed_token_ids=[5, 6], min_tokens=1, stop_token_ids=[5, 6])
    out = make_sampler()(logits, [dead_greedy, row(temperature=0.0), dead_sampled])
    assert out[0].token_ids == [] and out[2].token_ids == []
    assert out[0].error is not None and "allowed_token_ids" in out[0].error.message
    assert out[2].error is not None and "allowed_token_ids" in out[2].error.message
    assert out[1].token_ids == [int(logits[1].argmax())]


# ---- fault isolation: one row's failure is its own -----------------------------------------


def test_non_finite_row_fails_alone() -> None:
    logits = random_logits(3)
    good = [row(seed=1, temperature=0.7), row(temperature=0.0, repetition_penalty=1.2)]
    bad = row(seed=2, temperature=1.0, prompt=list(range(VOCAB)))
    # Past what validation allows: every prompt logit divided by 1e-300 overflows to inf.
    bad.params.repetition_penalty = 1e-300
    rows = [good[0], bad, good[1]]
    out = make_sampler()(logits, rows)
    assert (
        out[1].token_ids == []
        and out[1].error is not None
        and out[1].error.kind is FailureKind.INVALID
    )
    alone = [make_sampler()(logits[i : i + 1], [rows[i]])[0] for i in (0, 2)]
    assert [out[0].token_ids, out[2].token_ids] == [a.token_ids for a in alone]
    assert out[0].error is None and out[2].error is None


def test_row_that_raises_fails_alone_with_logprobs_of_the_others() -> None:
    logits = random_logits(2)
    bad = row(seed=1, temperature=1.0, top_p=0.5)
    bad.params.temperature = 10**400  # too big for a float tensor: torch raises
    ok = row(seed=3, temperature=1.0, top_p=0.5, logprobs=2)
    out = make_sampler()(logits, [bad, ok])
    assert (
        out[0].error is not None
        and out[0].error.kind is FailureKind.INTERNAL
        and out[0].token_ids == []
    )
    assert out[1].error is None and len(out[1].token_ids) == 1
    assert out[1].logprobs is not None and len(out[1].logprobs[0][0]) == 3


@pytest.mark.parametrize("with_random_row", [False, True])
def test_a_greedy_row_with_a_nan_fails_alone(with_random_row: bool) -> None:
    """Greedy rows past the plain path (here a penalty), alone or beside a random row: the one
    whose logits hold a NaN fails, the others take their penalised argmax."""
    logits = random_logits(3)
    logits[1, 7] = float("nan")
    rows = [row(temperature=0.0, repetition_penalty=1.2) for _ in range(3)]
    if with_random_row:
        rows[2] = row(seed=3, temperature=0.7)
    out = make_sampler()(logits, rows)
    assert out[1].token_ids == [] and out[1].error is not None
    assert out[1].error.kind is FailureKind.INVALID
    alone = make_sampler()(logits[0:1], [rows[0]])[0]
    assert out[0].error is None and out[0].token_ids == alone.token_ids
    assert out[2].error is None and len(out[2].token_ids) == 1


def test_all_rows_banned_is_non_finite_not_a_crash() -> None:
    logits = torch.full((1, VOCAB), float("-inf"))
    out = make_sampler()(logits, [row(seed=1, temperature=1.0)])
    assert out[0].error is not None and out[0].error.kind is FailureKind.INVALID


_ANY_NUMBER = st.one_of(
    st.integers(min_value=1, max_value=4),  # in range for most fields
    st.floats(min_value=0.01, max_value=1.0),
    st.sampled_from([1e-300, 5e-324, 1e-6, 1e300, 2**31, 2**63, -1, 0]),  # at the limits
    st.floats(allow_nan=True, allow_infinity=True),
    st.floats(min_value=-3, max_value=3),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.integers(min_value=-3, max_value=40),
    st.booleans(),
    st.none(),
    st.text(max_size=3),
)
_FUZZED_FIELDS = (
    "n", "temperature", "top_p", "top_k", "min_p", "seed", "max_tokens", "min_tokens",
    "logprobs", "presence_penalty", "frequency_penalty", "repetition_penalty",
)  # fmt: skip


@settings(max_examples=300, deadline=None, derandomize=True)
@given(
    fields=st.dictionaries(st.sampled_from(_FUZZED_FIELDS), _ANY_NUMBER, max_size=6),
    bias=st.none() | st.dictionaries(st.integers(0, VOCAB - 1), _ANY_NUMBER, max_size=2),
    stop=st.none() | st.lists(st.text(max_size=3), max_size=2),
    output=st.lists(st.integers(0, VOCAB - 1), max_size=4),
)
def test_whatever_validation_accepts_the_sampler_samples(
    fields: dict, bias: dict | None, stop: list[str] | None, output: list[int]
) -> None:
    """The edge's contract: a `SamplingParams` that constructs can be sampled without raising
    and without a non-finite row, beside an ordinary row (the engine's step never fails)."""
    try:
        params = SamplingParams(**fields, logit_bias=bias, stop=stop)
    except ValueError:
        return
    sampled_row = SamplingRow(
        params, params.seed, [1, 2, 3], output[: params.min_tokens], num_samples=params.n
    )
    rows = [sampled_row, row(seed=5, temperature=1.0)]
    out = make_sampler()(random_logits(2), rows)
    assert [r.error for r in out] == [None, None]
    assert len(out[0].token_ids) == params.n and all(0 <= t < VOCAB for t in out[0].token_ids)


@settings(max_examples=200, deadline=None)
@given(
    weights=st.lists(
        st.one_of(st.just(0.0), st.floats(1e-30, 1e3)), min_size=1, max_size=40
    ).filter(lambda ws: any(w > 0 for w in ws)),
    uniform=st.one_of(st.floats(0.0, 1.0, exclude_max=True), st.just(1.0 - 2.0**-24), st.just(0.0)),
)
def test_inverse_cdf_never_draws_a_zero_weight_token(weights: list[float], uniform: float) -> None:
    table = torch.tensor([weights], dtype=torch.float32)
    [[token_id]] = inverse_cdf(table, torch.tensor([[uniform]]))
    assert 0 <= token_id < len(weights)
    assert weights[token_id] > 0


def test_inverse_cdf_draws_in_proportion_to_weights() -> None:
    # Unnormalised weights over a vocabulary with holes, as top-k, top-p or a grammar leave.
    generator = torch.Generator().manual_seed(0)
    weights = torch.rand(3, 1000, generator=generator) * (
        torch.rand(3, 1000, generator=generator) > 0.5
    )
    weights[:, :4] = torch.tensor([300.0, 200.0, 100.0, 50.0])  # most of the mass, countable
    num = 40000
    drawn = torch.tensor(inverse_cdf(weights, torch.rand(3, num, generator=generator)))
    for row in range(3):
        counts = torch.bincount(drawn[row], minlength=1000).float()
        assert counts[weights[row] == 0].sum() == 0
        expected = num * weights[row, :4] / weights[row].sum()
        chi_square = (((counts[:4] - expected) ** 2) / expected).sum().item()
        assert chi_square < 25.0  # df <= 4: p < 1e-4 for a correct draw


@settings(max_examples=200, deadline=None)
@given(
    weights=st.lists(st.sampled_from([0.0, 0.0, 1e-20, 0.5, 3.0]), min_size=1, max_size=30).filter(
        lambda ws: any(w > 0 for w in ws)
    ),
    data=st.data(),
)
def test_snapped_draws_land_on_weighted_tokens(weights: list[float], data: st.DataObject) -> None:
    # What a parallel scan's rounding can do: a draw on any token, or past the end.
    drawn = data.draw(st.lists(st.integers(0, len(weights)), min_size=1, max_size=8))
    table = torch.tensor([weights])
    [snapped] = snap_to_weighted(table, torch.tensor([drawn])).tolist()
    weighted = [i for i, w in enumerate(weights) if w > 0]
    for original, token_id in zip(drawn, snapped):
        assert weights[token_id] > 0
        before = [i for i in weighted if i <= original]
        assert token_id == (before[-1] if before else weighted[0])


def test_more_top_logprobs_than_the_vocabulary_gives_them_all() -> None:
    """Validation caps `logprobs` at the server's max_logprobs (20), not at the vocabulary: a
    model of 16 tokens asked for 17 answers with all 16 (it failed the request, caught in a
    fresh clone's run of the fuzz test above)."""
    params = SamplingParams(logprobs=17, temperature=0.0)
    out = make_sampler()(random_logits(1), [SamplingRow(params, None, [1, 2, 3], [])])
    assert out[0].error is None and out[0].logprobs is not None
    ids, values, rank = out[0].logprobs[0]
    assert len(ids) == len(values) == 1 + VOCAB and rank == 1
    assert values[1:] == sorted(values[1:], reverse=True)
