"""Turns one step's last-position logits into next tokens, with vLLM's sampling semantics.

Greedy batches without penalties or biases take a single batched argmax (the common case, every
step); the general path applies logit_bias, allowed_token_ids and bad_words, min_tokens masking,
penalties, temperature and top-k/top-p/min-p as per-row tensors over the whole batch, so per-row
Python work stays limited to building those tensors.

A row that cannot be sampled (its penalties or temperature drive its probabilities to NaN or
inf, or anything raises while sampling it) fails alone: it is reported in `SampledRow.error`
and every other row of the batch is sampled as usual, so one request's parameters can never
stop the engine.

A seeded row draws from a generator keyed by (seed, output position), not from one that advances
with every draw: the token at a position then depends only on the seed and that position's
probabilities, so a request preempted and recomputed, or resumed on another worker, draws
exactly what it would have drawn uninterrupted.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from itertools import chain

import torch

from pagedray.scheduler.messages import RequestError, TokenLogprobs
from pagedray.scheduler.request_failure import FailureKind, RequestFailure
from pagedray.scheduler.sampling_params import SamplingParams
from pagedray.workers.inverse_cdf import inverse_cdf
from pagedray.workers.kept_buffer import KeptBuffer
from pagedray.workers.row_argmax import row_argmax
from pagedray.workers.top_k_top_p import apply_top_k_top_p_


@dataclass
class SamplingRow:
    """One sequence to sample for this step."""

    params: SamplingParams
    seed: int | None  # the request's seed; None: the sampler's default generator
    prompt_token_ids: list[int]  # token ids
    output_token_ids: list[int]  # token ids generated so far
    num_samples: int = 1  # params.n at the step an n > 1 prompt forks, else 1
    allowed_index: torch.Tensor | None = None  # params.allowed_token_ids, made once a request


@dataclass
class SampledRow:
    """What one row sampled."""

    token_ids: list[int]  # num_samples token ids; empty when the row failed
    logprobs: list[TokenLogprobs] | None  # one per sampled token when params.logprobs is not None
    error: RequestError | None = None  # set when this row alone could not be sampled


# Every token masked: what a client is told (its own parameters left nothing to sample).
NOTHING_ALLOWED_ERROR = RequestFailure(
    FailureKind.INVALID,
    "sampling failed: this request's allowed_token_ids, bad_words, min_tokens, structured "
    "output or thinking_token_budget (which forces </think>) left no token to sample",
)
NON_FINITE_ERROR = RequestFailure(
    FailureKind.INVALID,
    "sampling failed: this request's parameters (temperature, penalties, logit_bias) made the "
    "next-token probabilities NaN or infinite",
)
INTERNAL_ERROR = RequestFailure(
    FailureKind.INTERNAL, "sampling failed for this request (internal error)"
)

# Rows of one inverse_cdf call: as many as keep their running sums (float32) within 4 MiB.
CUMSUM_CACHE_FLOATS = 1 << 20
logger = logging.getLogger(__name__)


def has_penalties(params: SamplingParams) -> bool:
    return (
        params.repetition_penalty != 1.0
        or params.presence_penalty != 0.0
        or params.frequency_penalty != 0.0
    )


def apply_logit_bias(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """Adds each row's logit_bias to its logits, in place (ids were checked against the vocab)."""
    row_idx: list[int] = []
    token_idx: list[int] = []
    biases: list[float] = []
    for i, row in enumerate(rows):
        for token_id, bias in (row.params.logit_bias or {}).items():
            row_idx.append(i)
            token_idx.append(token_id)
            biases.append(bias)
    if row_idx:
        device = logits.device
        index = (torch.tensor(row_idx, device=device), torch.tensor(token_idx, device=device))
        values = torch.tensor(biases, dtype=logits.dtype, device=device)
        logits.index_put_(index, values, accumulate=True)


def apply_allowed_and_bad_words(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """Masks with -inf, in place, each row's tokens outside its allowed_token_ids and the last
    token of each bad word whose other tokens end the row's output (vLLM's rules)."""
    for i, row in enumerate(rows):
        params = row.params
        if params.allowed_token_ids is not None:
            allowed = row.allowed_index
            if allowed is None:
                allowed = torch.tensor(params.allowed_token_ids, dtype=torch.long)
            allowed = allowed.to(logits.device, non_blocking=True)
            kept = logits[i].index_select(0, allowed)
            logits[i].fill_(float("-inf"))
            logits[i].index_copy_(0, allowed, kept)
        output = row.output_token_ids
        for word in params.bad_words_token_ids or ():
            start = len(word) - 1
            if start <= len(output) and output[len(output) - start :] == word[:start]:
                logits[i, word[-1]] = float("-inf")


def _masked_out(
    logits: torch.Tensor, rows: list[SamplingRow], eos_token_ids: tuple[int, ...]
) -> set[int]:
    """The rows whose own masks (allowed_token_ids, bad_words, min_tokens) left no token, read
    only where a row has such a mask (a grammar always allows a token)."""
    masked = [
        i
        for i, row in enumerate(rows)
        if row.params.allowed_token_ids is not None
        or row.params.bad_words_token_ids
        or _banned_token_ids(row, eos_token_ids)
    ]
    if not masked:
        return set()
    tops = logits.index_select(0, torch.tensor(masked, device=logits.device)).amax(dim=1)
    return {i for i, top in zip(masked, tops.tolist()) if top == float("-inf")}


def apply_min_tokens(
    logits: torch.Tensor, rows: list[SamplingRow], eos_token_ids: tuple[int, ...]
) -> None:
    """Masks EOS and stop tokens with -inf, in place, for rows still short of min_tokens."""
    vocab_size = logits.shape[1]
    row_idx: list[int] = []
    token_idx: list[int] = []
    for i, row in enumerate(rows):
        for token_id in _banned_token_ids(row, eos_token_ids):
            # NOTE: user stop ids beyond the vocabulary can never be sampled; skip, don't crash.
            if token_id < vocab_size:
                row_idx.append(i)
                token_idx.append(token_id)
    if row_idx:
        device = logits.device
        index = (torch.tensor(row_idx, device=device), torch.tensor(token_idx, device=device))
        logits.index_put_(index, torch.tensor(float("-inf"), device=device))


def apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """Applies repetition (HF), then frequency and presence (OpenAI) penalties, in place.

    Only the logits of tokens a row has seen change, so only those are read and written: at 64
    rows of a 152k vocabulary the dense way (counts, masks and penalised copies of the whole
    batch) took 140-280 ms a step, more than the model's.

    Args:
        logits: [num_rows, vocab_size] float32, one row per entry of `rows`.
        rows: the rows; those without penalties are left untouched.
    """
    penalized = [i for i, row in enumerate(rows) if has_penalties(row.params)]
    if not penalized:
        return
    sub_rows = [rows[i] for i in penalized]
    device, vocab_size = logits.device, logits.shape[1]
    # Each (row, token) as one key, row * vocab_size + token, rows numbered among `penalized`
    # (every id is below vocab_size: the ingress checks prompts, the model emits no other).
    output_keys, output_counts = _row_token_keys(
        [r.output_token_ids for r in sub_rows], vocab_size, device
    ).unique(return_counts=True)  # [num_output_keys]: sorted
    repetition = [r.params.repetition_penalty for r in sub_rows]
    keys = output_keys
    repeats = any(p != 1.0 for p in repetition)
    if repeats:  # HF semantics: over prompt and output tokens
        prompt_keys = _row_token_keys([r.prompt_token_ids for r in sub_rows], vocab_size, device)
        keys = torch.cat([output_keys, prompt_keys]).unique()  # [num_keys]: sorted
    counts = torch.zeros(len(keys), dtype=logits.dtype, device=device)  # [num_keys]
    counts[torch.searchsorted(keys, output_keys)] = output_counts.to(logits.dtype)
    local_rows = keys // vocab_size  # [num_keys]
    index = (torch.tensor(penalized, device=device)[local_rows], keys % vocab_size)
    values = logits[index]  # [num_keys]
    if repeats:
        # Shrink positive logits, grow negative ones (a row at 1.0 divides by one: unchanged).
        penalty = torch.tensor(repetition, device=device)[local_rows]  # [num_keys]
        values = torch.where(values > 0, values / penalty, values * penalty)
    frequency = torch.tensor([r.params.frequency_penalty for r in sub_rows], device=device)
    presence = torch.tensor([r.params.presence_penalty for r in sub_rows], device=device)
    values = values - frequency[local_rows] * counts - presence[local_rows] * (counts > 0)
    logits.index_put_(index, values)


def _row_token_keys(
    token_lists: list[list[int]], vocab_size: int, device: torch.device
) -> torch.Tensor:
    """[total tokens] int64: row * vocab_size + token for each token of each row's list."""
    lengths = torch.tensor([len(tokens) for tokens in token_lists], device=device)
    row_idx = torch.repeat_interleave(torch.arange(len(token_lists), device=device), lengths)
    token_idx = torch.tensor(
        list(chain.from_iterable(token_lists)), dtype=torch.long, device=device
    )
    return row_idx * vocab_size + token_idx


class Sampler:
    """Samples next tokens for a batch of rows; holds no per-request state."""

    def __init__(self, eos_token_ids: tuple[int, ...], default_generator: torch.Generator):
        self.eos_token_ids = eos_token_ids
        self.default_generator = default_generator
        self._scratch = KeptBuffer()  # the copy of the logits a step's draw overwrites

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> list[SampledRow]:
        """Samples `row.num_samples` tokens per row.

        Args:
            logits: [num_rows, vocab_size] float32, the last position of each row.
            rows: one per logits row, same order.
        Returns:
            One `SampledRow` per row, with logprobs (from the raw logits) where asked, or with
            `error` set for a row that could not be sampled.
        """
        assert logits.shape[0] == len(rows), (logits.shape, len(rows))
        try:
            return self._sample_rows(logits, rows)
        except Exception:
            if len(rows) == 1:
                logger.exception("sampling failed for one request")
                return [SampledRow([], None, INTERNAL_ERROR)]
        # Something in the batch raised: sample each row alone so that only its owner fails.
        return [self(logits[i : i + 1], [row])[0] for i, row in enumerate(rows)]

    def _sample_rows(self, logits: torch.Tensor, rows: list[SamplingRow]) -> list[SampledRow]:
        samples: list[list[int] | None]
        masked_out: set[int] = set()  # rows whose own parameters masked every token
        if all(self._is_plain_greedy(row) for row in rows):
            argmax = row_argmax(logits).tolist()  # [num_rows]
            samples = [[token_id] * row.num_samples for token_id, row in zip(argmax, rows)]
        else:
            samples, masked_out = self._sample(logits, rows)
        logprobs = _compute_logprobs(logits, rows, samples)
        return [
            SampledRow(s, lp)
            if s is not None
            else SampledRow(
                [], None, NOTHING_ALLOWED_ERROR if i in masked_out else NON_FINITE_ERROR
            )
            for i, (s, lp) in enumerate(zip(samples, logprobs))
        ]

    def _is_plain_greedy(self, row: SamplingRow) -> bool:
        params = row.params
        return (
            params.greedy
            and not params.logit_bias
            and params.allowed_token_ids is None
            and not params.bad_words_token_ids
            and not has_penalties(params)
            and not _banned_token_ids(row, self.eos_token_ids)
        )

    def _sample(
        self, logits: torch.Tensor, rows: list[SamplingRow]
    ) -> tuple[list[list[int] | None], set[int]]:
        """Token ids per row, None for a row that cannot be sampled: its probabilities are not
        finite, or (the rows returned apart) its own masks left no token at all (a greedy
        argmax over nothing would give token 0)."""
        # A kept copy that the draw overwrites in place: the raw logits stay intact for logprobs.
        scratch = self._scratch.rows(logits.shape[0], logits.shape[1], logits.dtype, logits.device)
        logits = scratch.copy_(logits)
        apply_logit_bias(logits, rows)
        apply_allowed_and_bad_words(logits, rows)
        apply_min_tokens(logits, rows, self.eos_token_ids)
        apply_penalties(logits, rows)
        masked_out = _masked_out(logits, rows, self.eos_token_ids)
        samples: list[list[int] | None] = [None for _ in rows]
        greedy = [i for i, row in enumerate(rows) if row.params.greedy]
        if greedy:
            greedy_logits = logits  # [num_greedy, vocab_size]
            if len(greedy) < len(rows):
                index = torch.tensor(greedy, device=logits.device)
                greedy_logits = logits.index_select(0, index)
            argmax = row_argmax(greedy_logits)  # [num_greedy]
            # A row holding a NaN has its first NaN as its argmax: its pick tells.
            picked = greedy_logits.gather(1, argmax.unsqueeze(1)).squeeze(1)  # [num_greedy]
            valid = (~picked.isnan()).tolist()
            for i, token_id, ok in zip(greedy, argmax.tolist(), valid):
                samples[i] = [token_id] * rows[i].num_samples if ok else None
        random = [i for i, row in enumerate(rows) if not row.params.greedy]
        if random:
            random_logits = logits
            if len(random) < len(rows):
                random_logits = logits.index_select(0, torch.tensor(random, device=logits.device))
            drawn = self._sample_random(random_logits, [rows[i] for i in random])
            for i, token_ids in zip(random, drawn):
                samples[i] = token_ids
        for i in masked_out:
            samples[i] = None
        return samples, masked_out

    def _sample_random(
        self, logits: torch.Tensor, rows: list[SamplingRow]
    ) -> list[list[int] | None]:
        # logits: [num_random, vocab_size], penalties applied; overwritten with the draw's weights
        device = logits.device
        params = [row.params for row in rows]
        temperature = torch.tensor([p.temperature for p in params], device=device)
        logits.div_(temperature.unsqueeze(1))
        vocab_size = logits.shape[1]
        if any(0 < p.top_k < vocab_size or p.top_p < 1.0 for p in params):
            # NOTE: a top_k past the vocabulary keeps every token, like 0.
            top_k = torch.tensor([min(p.top_k, vocab_size) for p in params], device=device)
            top_p = torch.tensor([p.top_p for p in params], device=device)
            apply_top_k_top_p_(logits, top_k, top_p)
        # Softmax's numerators, exp(logit - the row's largest), in place: the draw needs no
        # normalised weights (inverse_cdf scales its points by each row's total), and at 64 rows
        # of a 152k vocabulary each fresh tensor (the division, the softmax, its isfinite) cost
        # 11-22 ms of page faults (see KeptBuffer): the whole draw took 84 ms, 15 now.
        weights = logits.sub_(logits.amax(dim=-1, keepdim=True)).exp_()  # [num_random, vocab]
        if any(p.min_p > 0.0 for p in params):
            # The largest weight is exp(0) = 1: min_p times the top token's probability is min_p
            # itself in these units.
            min_p = torch.tensor([p.min_p for p in params], device=device).unsqueeze(1)
            weights.masked_fill_(weights < min_p, 0.0)
        # A row with a NaN or an infinity (an infinite logit, or a temperature that overflows
        # them) or with every token masked cannot be drawn from; its total shows either.
        total = weights.sum(dim=-1)  # [num_random]
        valid = total.isfinite() & (total > 0)
        if bool(valid.all()):
            return list(self._draw(weights, rows))
        weights.masked_fill_(~valid.unsqueeze(1), 1.0)  # drawn, then discarded
        drawn = self._draw(weights, rows)
        return [token_ids if ok else None for token_ids, ok in zip(drawn, valid.tolist())]

    def _draw(self, probs: torch.Tensor, rows: list[SamplingRow]) -> list[list[int]]:
        # probs: [num_random, vocab_size] nonnegative weights
        samples: list[list[int]] = [[] for _ in rows]
        groups: dict[int, list[int]] = {}  # num_samples -> positions in rows
        for i, row in enumerate(rows):
            groups.setdefault(row.num_samples, []).append(i)
        for num_samples, positions in groups.items():
            uniform = torch.empty(len(positions), num_samples, device=probs.device)
            unseeded = [k for k, i in enumerate(positions) if rows[i].seed is None]
            if unseeded:
                uniform[unseeded] = torch.rand(
                    len(unseeded),
                    num_samples,
                    generator=self.default_generator,
                    device=probs.device,
                )
            for k, i in enumerate(positions):
                # A seeded row's numbers come from its own generator, keyed by its seed and its
                # position: its tokens depend on nothing else in the batch (inverse_cdf sums
                # each row alone, in the same order whatever rows share its call).
                if rows[i].seed is not None:
                    generator = _draw_generator(rows[i], probs)
                    uniform[k] = torch.rand(num_samples, generator=generator, device=probs.device)
            group = probs
            if len(positions) < len(rows):
                group = probs.index_select(0, torch.tensor(positions, device=probs.device))
            # NOTE: on a CPU in slices whose running sums stay in the caches: at 64 rows of a
            # 152k vocabulary one call took 20 ms, slices of 6 rows 6.3 (at 8k and 32k: the
            # same). A GPU takes the batch in one call.
            step = len(positions)
            if probs.device.type == "cpu":
                step = max(1, CUMSUM_CACHE_FLOATS // group.shape[-1])
            for start in range(0, len(positions), step):
                drawn = inverse_cdf(group[start : start + step], uniform[start : start + step])
                for i, token_ids in zip(positions[start : start + step], drawn):
                    samples[i] = token_ids
        return samples


def _draw_generator(row: SamplingRow, probs: torch.Tensor) -> torch.Generator:
    """The generator for `row`'s draw at its next output position, on the device of `probs`."""
    position = len(row.output_token_ids)
    assert row.seed is not None
    return torch.Generator(device=probs.device).manual_seed(_mix64(row.seed, position))


def _mix64(seed: int, position: int) -> int:
    """splitmix64 of (seed, position): nearby seeds and positions give unrelated streams."""
    mask = (1 << 64) - 1
    x = (seed * 0x9E3779B97F4A7C15 + position * 0xD1B54A32D192ED03 + 1) & mask
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & mask
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & mask
    return (x ^ (x >> 31)) & ((1 << 63) - 1)


def _banned_token_ids(row: SamplingRow, eos_token_ids: tuple[int, ...]) -> list[int]:
    """Token ids masked this step because the row has not reached min_tokens."""
    params = row.params
    if len(row.output_token_ids) >= params.min_tokens:
        return []
    banned = list(params.stop_token_ids)
    if not params.ignore_eos:
        banned.extend(eos_token_ids)
    return banned


def _compute_logprobs(
    logits: torch.Tensor, rows: list[SamplingRow], samples: list[list[int] | None]
) -> list[list[TokenLogprobs] | None]:
    """Logprobs of the sampled tokens and the top-k, from the raw logits (vLLM V1's default)."""
    result: list[list[TokenLogprobs] | None] = [None] * len(rows)
    wanted = [i for i, row in enumerate(rows) if row.params.logprobs is not None and samples[i]]
    if not wanted:
        return result
    logprobs = logits.index_select(0, torch.tensor(wanted, device=logits.device))
    # one entry per sampled token: a forking row contributes num_samples entries
    owner = [j for j, i in enumerate(wanted) for _ in samples[i] or ()]
    tokens = [t for i in wanted for t in samples[i] or ()]
    num_top = [rows[wanted[j]].params.logprobs or 0 for j in owner]
    for j, entry in zip(owner, token_logprobs(logprobs, owner, tokens, num_top)):
        row_logprobs = result[wanted[j]]
        if row_logprobs is None:
            row_logprobs = result[wanted[j]] = []
        row_logprobs.append(entry)
    return result


def token_logprobs(
    logits: torch.Tensor,  # [num_rows, vocab_size], raw
    owner: list[int],  # per entry: its row of `logits`
    token_ids: list[int],  # per entry: the token whose logprob and rank are wanted
    num_top: list[int],  # per entry: how many of the most likely tokens to add
) -> list[TokenLogprobs]:
    """Per entry: ([token, top ids...], [its logprob, top logprobs...], its rank) under its row.

    Shared by sampled tokens (several entries per row when a prompt forks) and prompt tokens.
    """
    device = logits.device
    logprobs = logits.float().log_softmax(dim=-1)  # [num_rows, vocab_size]
    owner_idx = torch.tensor(owner, device=device)
    tokens = torch.tensor(token_ids, device=device)
    entry_logprobs = logprobs[owner_idx, tokens]  # [num_entries]
    per_entry = logprobs if owner == list(range(len(logprobs))) else logprobs[owner_idx]
    # rank 1 = most likely; ties with the token do not push it down
    ranks = (per_entry > entry_logprobs.unsqueeze(1)).sum(dim=-1) + 1  # [num_entries]
    top_ids_list: list[list[int]] = [[] for _ in range(len(logprobs))]
    top_logprobs_list: list[list[float]] = [[] for _ in range(len(logprobs))]
    # NOTE: at most the whole vocabulary: a model with fewer tokens than the top asked for
    # (validation caps it at the server's max_logprobs, not at the vocabulary) gives them all.
    max_k = min(max(num_top, default=0), logprobs.shape[-1])
    if max_k > 0:
        top_logprobs, top_ids = logprobs.topk(max_k, dim=-1)  # [num_rows, max_k]
        top_logprobs_list, top_ids_list = top_logprobs.tolist(), top_ids.tolist()
    entries = zip(owner, token_ids, entry_logprobs.tolist(), ranks.tolist(), num_top)
    return [
        ([token_id] + top_ids_list[j][:k], [token_logprob] + top_logprobs_list[j][:k], rank)
        for j, token_id, token_logprob, rank, k in entries
    ]
