"""Priority scheduling's preemption: with every seat taken, the waiting head preempts running
sequences of a worse (higher) priority value, newest first, as vLLM's priority scheduling does,
so a short urgent request need not wait for a batch of long ones to finish. The victims' blocks
keep their hashes, so their recompute is mostly a prefix-cache hit.
"""

from __future__ import annotations

from pagedray.scheduler.request import Request


def priority_victims(
    head: Request | None, running: list[Request], max_num_seqs: int
) -> list[Request]:
    """The running sequences `head` preempts, in the order to preempt them.

    `running` is in victim order (newest, or lowest priority, last).
    """
    if head is None:
        return []
    victims: list[Request] = []
    num_running_seqs = sum(num_seqs(req) for req in running)
    candidates = list(running)
    while (
        candidates
        and num_running_seqs + num_seqs(head) > max_num_seqs
        and head.priority < candidates[-1].priority
    ):
        victim = candidates.pop()
        num_running_seqs -= num_seqs(victim)
        victims.append(victim)
    return victims


def num_seqs(req: Request) -> int:
    """Sequences `req` stands for: an n > 1 prompt forks into n once its prefill completes."""
    return req.sampling_params.n if req.parent_req_id is None and not req.output_token_ids else 1
