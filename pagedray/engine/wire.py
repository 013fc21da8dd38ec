"""The messages between the ingress and an engine, the one process boundary a request crosses
(vLLM V1's `EngineCoreRequest` / `EngineCoreOutputs`): a `GenerateRequest` in, a
`RequestStepOutput` per message out, and a refusal or failure as a typed `RequestFailure`
(scheduler/request_failure.py) inside an output, never an exception or an HTTP status.

Tokens in, tokens out: the text, the usage a client sees and the stop strings are the
ingress's (engine/request_text.py); nothing crosses that the other side would drop.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from pagedray.engine.output_processor import ChoiceDelta
from pagedray.scheduler.request_failure import RequestFailure
from pagedray.scheduler.sampling_params import SamplingParams


@dataclass(frozen=True)
class KVPull:
    """The replica whose pool holds more of a request's prefix than the one the router sent it
    to (that one was too loaded), how many leading blocks it holds, and from which block on
    the receiving engine lacks them (its pool and node tiers hold those before, as the router
    last saw them): it pulls those rather than computing them (scheduler/kv_transfer.py)."""

    replica_id: str
    num_blocks: int
    first_block: int = 0


@dataclass
class GenerateRequest:
    """One engine request: a validated, tokenized prompt and how to sample and stream it."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    priority: int = 0
    cache_salt: str | None = None
    # Tokens per message (vLLM's --stream-interval); None: one message, at the end.
    stream_interval: int | None = 1
    # Its output so far, when an engine lost it after some reached the client (n = 1): the
    # engine it moves to continues from there (scheduler/request.py's `EngineRequest`).
    output_token_ids: list[int] = field(default_factory=list)
    # A reasoning model's structured output holds only after this token, its `</think>`
    # (scheduler/request.py's `EngineRequest`); None: from the first token.
    thinking_end_token_id: int | None = None
    thinking_start_token_id: int | None = None
    lora_name: str | None = None  # the LoRA adapter it runs with (None: the base model)
    # Its key in block hashes (workers/lora_checkpoint.py's `adapter_key`), for the router's
    # and a KV pull's hashes; the engine hashes with the key it registered.
    lora_key: str | None = None
    # Serve: the output channel of the ingress replica that reads this request's outputs
    # (engine/output_channel.py); None: they come back on the request's own call.
    channel_id: str | None = None
    # Set by the router when it sends the request away from the replica holding its prefix.
    pull_from: KVPull | None = None
    # For the router in the sender's process only (cluster/engine_router.py): the prompt's
    # block hashes, the decision taken with them, whom to tell which replica it chose (called
    # on the router's thread), and the replicas that failed this request (it moves elsewhere).
    # Never pickled: the engine has no use for them.
    routing_hashes: list[bytes] | None = None
    routing_decision: Any = None
    on_routed: Callable[[str], None] | None = None
    failed_replica_ids: set[str] = field(default_factory=set)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["routing_hashes"] = state["routing_decision"] = state["on_routed"] = None
        state["failed_replica_ids"] = set()
        return state


@dataclass
class RequestStepOutput:
    """One message of an engine request's outputs: what its steps since the last one produced.

    The last message of a request is finished, or carries the refusal or failure that ended
    it; an in-process client's first is its acceptance (no deltas) or its refusal.
    """

    request_id: str
    deltas: list[ChoiceDelta] = field(default_factory=list)  # one per choice that advanced
    finished: bool = False  # every choice has a finish reason
    # Prompt, completion, total and cached tokens: set by the ingress on the last output, from
    # the text it made (a stop string may end a choice before its last token); never sent.
    usage: dict[str, int] | None = None
    error: RequestFailure | None = None  # set instead of deltas when the request failed
    num_cached_tokens: int = 0  # prompt tokens the prefix cache served (known after prefill)
    # On the end of a request whose outputs went through an output channel: the engine replica
    # that held it, whose channel the caller reads (`output_channel.py`).
    replica_id: str | None = None
