"""What the workers hold of each sequence, so the scheduler sends them deltas, not state.

A sequence goes out in full (`NewRequestData`) the first time it is scheduled and whenever its
block table was rewritten; after that, only its new tokens and new blocks (`CachedRequestData`).
A sequence the workers knew and that is finished, preempted or forked is listed once in the next
plan's `finished_req_ids`, so their persistent batch drops it.
"""

from __future__ import annotations

from typing import Callable

from pagedray.scheduler.kv_cache_manager import Allocation
from pagedray.scheduler.messages import CachedRequestData, NewRequestData
from pagedray.scheduler.request import Request


class WorkerView:
    """Tokens sent per sequence, and the sequences to drop in the next plan."""

    def __init__(self, block_ids_of: Callable[[str], list[int]]) -> None:
        """`block_ids_of(req_id)` is the sequence's whole block table, read only when sent whole."""
        self._block_ids_of = block_ids_of
        # How many of each sequence's tokens the workers hold; absent = workers do not know it.
        self.num_tokens_sent: dict[str, int] = {}
        self._finished: list[str] = []

    def emit(
        self,
        req: Request,
        allocation: Allocation,
        new_reqs: list[NewRequestData],
        cached: CachedRequestData,
    ) -> None:
        """Describe a scheduled sequence: in full the first time, then as a diff."""
        sent = self.num_tokens_sent.get(req.req_id)
        if sent is None or allocation.replaced:
            if sent is not None:
                self._finished.append(req.req_id)  # table rewritten: resend whole
            new_reqs.append(
                NewRequestData(
                    req_id=req.req_id,
                    prompt_token_ids=req.prompt_token_ids,
                    output_token_ids=list(req.output_token_ids),
                    sampling_params=req.sampling_params,
                    block_ids=self._block_ids_of(req.req_id),
                    num_computed_tokens=req.num_computed_tokens,
                    lora_slot=req.lora_slot,
                )
            )
        else:
            cached.req_ids.append(req.req_id)
            cached.new_token_ids.append(req.all_token_ids[sent:])
            cached.new_block_ids.append(allocation.new_block_ids)
            cached.num_computed_tokens.append(req.num_computed_tokens)
        self.num_tokens_sent[req.req_id] = req.num_tokens

    def forget(self, req_id: str) -> None:
        """The workers must drop `req_id` (if they hold it) at the next plan."""
        if self.num_tokens_sent.pop(req_id, None) is not None:
            self._finished.append(req_id)

    def take_finished(self) -> list[str]:
        """The sequences to drop, once: the next plan carries them."""
        finished, self._finished = self._finished, []
        return finished
