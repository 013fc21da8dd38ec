"""The only types that cross from the scheduler to the workers and back.

Small dataclasses of plain lists: a request's full data is sent once (`NewRequestData`), after
that only diffs (`CachedRequestData`). No tensors and no request objects cross a process boundary.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field

from pagedray.scheduler.request_failure import RequestFailure
from pagedray.scheduler.sampling_params import SamplingParams

# One sampled token's logprobs: (token ids, logprobs, rank of the sampled token).
# Index 0 of both lists is the sampled token; the rest are the top-k in descending order.
TokenLogprobs = tuple[list[int], list[float], int]
# Why one request failed in a step that went on for the rest of the batch (its parameters made
# sampling impossible, or an internal failure confined to it); the message names no internals.
RequestError = RequestFailure


@dataclass
class NewRequestData:
    """A sequence the workers have not seen (or forgot after preemption): sent once, in full."""

    req_id: str
    prompt_token_ids: list[int]  # token ids
    output_token_ids: list[int]  # tokens already generated: a resumed or forked sequence
    sampling_params: SamplingParams
    block_ids: list[int]  # the whole block table, logical block i -> physical block id
    num_computed_tokens: int  # tokens whose KV is already in the cache (prefix hit, fork)
    lora_slot: int | None = None  # the LoRA slot of its adapter (`lora_loads`); None: the base


@dataclass
class LoRALoad:
    """Load a LoRA adapter (a PEFT folder) into one of every rank's slots before the step."""

    slot: int
    adapter: str  # its id in the slot table (scheduler/lora_slots.py)
    name: str  # the name requests give it
    path: str
    key: str  # its name and files' identity when registered: a rank refuses a folder changed


@dataclass
class CachedRequestData:
    """Diffs for sequences the workers already hold; parallel lists indexed like `req_ids`."""

    req_ids: list[str] = field(default_factory=list)
    new_token_ids: list[list[int]] = field(default_factory=list)  # tokens sampled since last step
    new_block_ids: list[list[int]] = field(default_factory=list)  # block ids appended to the table
    num_computed_tokens: list[int] = field(default_factory=list)  # tokens with KV in the cache


@dataclass
class GrammarBitmask:
    """The tokens each constrained sequence may sample this step (structured outputs)."""

    req_ids: list[str]  # the sequences that sample this step under a grammar, one row each
    words_per_row: int  # int32 words per row: ceil(vocab_size / 32)
    # Rows of little-endian int32 words, bit (token_id % 32) of word (token_id // 32) set when
    # the token is allowed: len(req_ids) * words_per_row * 4 bytes.
    data: bytes


@dataclass
class SchedulerOutput:
    """One iteration's plan, identical for every tensor-parallel rank."""

    step_id: int
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]  # req_id -> tokens to compute this step (chunk, or 1)
    total_num_scheduled_tokens: int  # tokens
    blocks_to_copy: list[tuple[int, int]]  # copy-on-write (src block id, dst block id)
    finished_req_ids: list[str]  # sequences the workers drop: finished, aborted, preempted, forked
    # Set after scheduling when any row has a grammar. In-process (never pickled) it may be a
    # Future the scheduler fills while the forward pass runs; the model runner waits on it.
    grammar_bitmask: GrammarBitmask | Future[GrammarBitmask] | None = None
    # Whether a request in flight streams its tokens to a client: the serving path then works
    # every step, and a CPU rank leaves it the cores it reserves (workers/cpu_threads.py).
    streaming: bool = True
    # The node's host KV tier (scheduler/host_kv_tier.py). Run first, in this order, before the
    # copies: evicted blocks the tier lacks saved (pool block id, tier slot) before anything
    # overwrites them, then prefix hits found there loaded (tier slot, pool block id).
    blocks_to_save: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_load: list[tuple[int, int]] = field(default_factory=list)
    # The prefix hits the disk tier holds (below the host's), loaded after those.
    blocks_to_load_from_disk: list[tuple[int, int]] = field(default_factory=list)
    # Full blocks this step computes, saved (pool block id, tier slot) after the forward pass:
    # the tier holds what the pool holds, so neither an eviction nor a dead engine loses it.
    computed_blocks_to_save: list[tuple[int, int]] = field(default_factory=list)
    # Adapters put in a LoRA slot, loaded before the forward pass (scheduler/lora_slots.py).
    lora_loads: list[LoRALoad] = field(default_factory=list)


@dataclass
class ModelRunnerOutput:
    """What rank 0 returns after a step: the tokens sampled for sequences that reached their end."""

    step_id: int
    req_ids: list[str]  # sequences that sampled this step (prefill chunks mid-prompt do not)
    sampled_token_ids: list[list[int]]  # per req: one token, or n at the step a prompt forks
    logprobs: list[list[TokenLogprobs] | None]  # per req: one entry per sampled token, if asked
    # req -> (first prompt position, entries): logprobs of the prompt tokens at positions
    # first .. first + len(entries) - 1, for requests with prompt_logprobs whose prefill ran.
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprobs]]] = field(default_factory=dict)
    # req -> why it failed this step; it sampled nothing and the scheduler ends it.
    failed: dict[str, RequestError] = field(default_factory=dict)
    # Seconds this rank copied blocks between its pool and the tiers, by copy (`TIER_COPIES`);
    # only the copies the step had.
    tier_copy_seconds: dict[str, float] = field(default_factory=dict)
    # LoRA slots the plan loaded that some rank could not fill (the adapter's file gone or
    # unreadable there): the scheduler ends the requests waiting for them (none runs on one).
    lora_load_failures: list[int] = field(default_factory=list)


# The copies between a rank's pool and the tiers: evicted or computed blocks saved to the host
# tier, hits loaded from it, hits loaded from the disk tier.
TIER_COPIES = ("host_tier_save", "host_tier_load", "disk_tier_load")
