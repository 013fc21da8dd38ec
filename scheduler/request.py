"""A sequence the scheduler schedules: its tokens, progress through the KV cache, and status.

`n > 1` prompts are one `Request` until their prefill completes; then they fork into n child
requests that share the prompt's blocks (see `KVCacheManager.fork`).
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from pagedray.scheduler.grammar import RequestGrammar
from pagedray.scheduler.messages import TokenLogprobs
from pagedray.scheduler.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # waiting again, its blocks freed; it will be recomputed
    FINISHED_STOPPED = "stop"  # EOS, a stop token id or a stop string
    FINISHED_LENGTH = "length"  # max_tokens or max_model_len
    FINISHED_ABORTED = "abort"  # the client went away or asked to cancel
    FINISHED_ERROR = "error"  # failed alone in a step (e.g. non-finite probabilities)
    FINISHED_FORKED = "forked"  # an n > 1 prompt that handed its blocks to its children

    @property
    def is_finished(self) -> bool:
        return self.name.startswith("FINISHED")

    @property
    def finish_reason(self) -> str | None:
        return (
            self.value if self.is_finished and self is not RequestStatus.FINISHED_FORKED else None
        )


@dataclass
class EngineRequest:
    """What a front end submits: a tokenized prompt and how to sample it."""

    req_id: str
    prompt_token_ids: list[int]  # token ids
    sampling_params: SamplingParams
    arrival_time: float = 0.0  # seconds, time.time(); 0 = now
    priority: int = 0  # lower runs first under the "priority" policy
    cache_salt: str | None = None  # per-tenant isolation of the prefix cache
    lora_name: str | None = None  # the LoRA adapter it runs with (None: the base model)
    # Its output so far, when it resumes here after another engine lost it (n = 1): computed
    # again as context, never sent again, sampled on from the next position.
    output_token_ids: list[int] = field(default_factory=list)
    # A reasoning model's output that starts inside its thinking: the token that ends the
    # thinking, after which a structured output's grammar holds (vLLM's default) and before
    # which `thinking_token_budget` counts; None: the output does not start thinking.
    thinking_end_token_id: int | None = None
    thinking_start_token_id: int | None = None  # `<think>`: not a thinking token where it leads


class Request:
    """Scheduler-side state of one sequence."""

    def __init__(
        self,
        engine_request: EngineRequest,
        parent_req_id: str | None = None,
        choice_index: int = 0,
    ) -> None:
        self.req_id = engine_request.req_id
        self.prompt_token_ids = list(engine_request.prompt_token_ids)
        self.sampling_params = engine_request.sampling_params
        self.arrival_time = engine_request.arrival_time or time.time()
        self.priority = engine_request.priority
        self.cache_salt = engine_request.cache_salt
        self.lora_name = engine_request.lora_name
        self.lora_id: str | None = None  # its adapter's id in the slot table (LoRASlots)
        self.lora_slot: int | None = None  # its adapter's slot while it runs (LoRASlots)
        self.num_slot_waits = 0  # steps it was passed over: no slot could take its adapter
        # What its blocks are hashed with besides its tokens: the adapter's key (set when the
        # scheduler takes it; its name and files' identity); None: the base model.
        self.lora_key: str | None = None
        self.parent_req_id = parent_req_id  # set on forked children
        self.choice_index = choice_index  # which of the parent's n outputs this is
        self.output_token_ids: list[int] = list(engine_request.output_token_ids)
        self.all_token_ids: list[int] = self.prompt_token_ids + self.output_token_ids
        # A resumed output not yet replayed through the request's grammar (at its admission).
        self.unreplayed_token_ids: list[int] = list(engine_request.output_token_ids)
        self.thinking_end_token_id = engine_request.thinking_end_token_id
        self.thinking_start_token_id = engine_request.thinking_start_token_id
        # While the output thinks (the end token not sampled yet): how many more thinking tokens
        # its `thinking_token_budget` allows (None: no budget, or no thinking left to count).
        # As vLLM's, the prompt's thinking since its last `<think>` (a prefill's) is spent.
        self.thinking_left: int | None = None
        self.output_thinking_seen = False  # a first output token was counted (or skipped)
        budget = self.sampling_params.thinking_token_budget
        # A forked child takes its parent's count (fork_child), not the prompt's again.
        if self.thinking_end_token_id is not None and budget is not None and parent_req_id is None:
            self.thinking_left = max(budget - self._thinking_in_prompt(), 0)
            self.count_thinking(self.output_token_ids)
        self.num_computed_tokens = 0  # tokens whose KV is in the cache
        self.num_cached_tokens = -1  # prefix-cache hit at first admission; -1 = not yet admitted
        self.num_preemptions = 0
        # Per prompt position (None at 0: nothing precedes it), filled as prefill chunks run;
        # only for requests with prompt_logprobs. A recompute after preemption rewrites the same
        # positions with the same values.
        self.prompt_logprobs: list[TokenLogprobs | None] | None = None
        if self.sampling_params.prompt_logprobs is not None:
            self.prompt_logprobs = [None] * len(self.prompt_token_ids)
        self.status = RequestStatus.WAITING
        # With structured outputs: the matcher of this sequence's output (the scheduler's).
        self.grammar: RequestGrammar | None = None
        self.scheduled_time: float | None = None  # first admission, for queue-time metrics

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def store_prompt_logprobs(self, first_position: int, entries: list[TokenLogprobs]) -> None:
        if self.prompt_logprobs is not None:
            self.prompt_logprobs[first_position : first_position + len(entries)] = entries

    def append_output_token_ids(self, token_ids: list[int]) -> None:
        self.output_token_ids.extend(token_ids)
        self.all_token_ids.extend(token_ids)
        if self.thinking_left is not None:  # a thinking with a budget: most requests have none
            self.count_thinking(token_ids)

    def count_thinking(self, token_ids: list[int]) -> None:
        """Spend the thinking budget on output tokens, until the one that ends the thinking (a
        leading `<think>`, the model opening it, is no thinking token)."""
        for token_id in token_ids:
            if self.thinking_left is None:
                return
            leading, self.output_thinking_seen = not self.output_thinking_seen, True
            if token_id == self.thinking_end_token_id:
                self.thinking_left = None
            elif not (leading and token_id == self.thinking_start_token_id):
                self.thinking_left = max(self.thinking_left - 1, 0)

    def _thinking_in_prompt(self) -> int:
        """Thinking tokens the prompt holds already: those after its last `<think>`, unless a
        `</think>` closed it."""
        for back, token_id in enumerate(reversed(self.prompt_token_ids)):
            if token_id == self.thinking_end_token_id:
                return 0
            if token_id == self.thinking_start_token_id:
                return back
        return 0

    def fork_child(self, choice_index: int) -> Request:
        """A child sequence that continues this prompt; it shares the prompt's computed KV."""
        params = self.sampling_params.clone(
            n=1, seed=child_seed(self.sampling_params.seed, choice_index)
        )
        child = Request(
            EngineRequest(
                req_id=child_req_id(self.req_id, choice_index),
                prompt_token_ids=self.prompt_token_ids,
                sampling_params=params,
                arrival_time=self.arrival_time,
                priority=self.priority,
                cache_salt=self.cache_salt,
                lora_name=self.lora_name,
                thinking_end_token_id=self.thinking_end_token_id,
                thinking_start_token_id=self.thinking_start_token_id,
            ),
            parent_req_id=self.req_id,
            choice_index=choice_index,
        )
        child.lora_id, child.lora_key = self.lora_id, self.lora_key
        child.thinking_left = self.thinking_left
        child.output_thinking_seen = self.output_thinking_seen
        child.num_computed_tokens = self.num_computed_tokens
        child.num_cached_tokens = self.num_cached_tokens
        child.scheduled_time = self.scheduled_time
        return child

    def __repr__(self) -> str:
        return (
            f"Request({self.req_id!r}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, {self.status.value})"
        )


def child_req_id(req_id: str, choice_index: int) -> str:
    """The scheduler's id for output `choice_index` of a forked n > 1 request."""
    return f"{req_id}#{choice_index}"


def child_seed(seed: int | None, choice_index: int) -> int | None:
    """A distinct, reproducible seed per child so seeded n > 1 requests repeat exactly (and a
    choice resumed alone, cluster/serve_engine_client.py, goes on as its child would)."""
    if seed is None:
        return None
    return (seed * 1_000_003 + choice_index + 1) % (2**63)
