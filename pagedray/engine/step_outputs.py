"""How consecutive outputs of one request become one message: held back in the engine for
`--stream-interval` (`StreamCoalescer`), and joined where a reader fell behind (the engine's
request streams, the ingress's output channel reader).
"""

from __future__ import annotations

import dataclasses

from pagedray.engine.output_processor import ChoiceDelta
from pagedray.engine.wire import RequestStepOutput


class StreamCoalescer:
    """The one place a request's outputs are held back and merged (vLLM's `--stream-interval`).

    Every message through Serve costs the engine replica and the ingress CPU time, so a stream
    sends the first token at once, then a message per `interval` tokens (per choice), and the
    finish; `interval` None sends one message at the end (a client that does not stream).
    Whatever piled up while the reader was busy goes out as one message too.
    """

    def __init__(self, interval: int | None) -> None:
        self.interval = interval
        self._held: list[RequestStepOutput] = []
        self._held_tokens = 0
        self._sent_tokens = False

    def add(self, output: RequestStepOutput) -> None:
        self._held.append(output)
        # Tokens per choice: with n > 1 every choice advances each step.
        self._held_tokens += max((len(d.token_ids) for d in output.deltas), default=0)

    def ready(self) -> bool:
        """Whether what is held should go out now."""
        if not self._held:
            return False
        if self._held[-1].finished:
            return True
        if self.interval is None:
            return False
        return self._held_tokens >= self.interval or not self._sent_tokens

    def take(self) -> RequestStepOutput:
        """What is held, as one output."""
        held, self._held = self._held, []
        self._sent_tokens = self._sent_tokens or self._held_tokens > 0
        self._held_tokens = 0
        return merge_step_outputs(held)


def merge_step_outputs(outputs: list[RequestStepOutput]) -> RequestStepOutput:
    """Consecutive outputs of one request as one message, the last's status.

    Each choice's deltas fold into one (text, tokens and logprobs joined in order): a client
    then gets one chunk per choice for the whole span, as from vLLM's `--stream-interval`.
    A single output is returned as it is.
    """
    if len(outputs) == 1:
        return outputs[0]
    last = outputs[-1]
    by_choice: dict[int, list[ChoiceDelta]] = {}
    for output in outputs:
        for delta in output.deltas:
            by_choice.setdefault(delta.index, []).append(delta)
    return RequestStepOutput(
        last.request_id,
        [_join(deltas) for deltas in by_choice.values()],
        last.finished,
        last.usage,
        last.error,
        max(output.num_cached_tokens for output in outputs),
    )


def _join(deltas: list[ChoiceDelta]) -> ChoiceDelta:
    """One choice's consecutive deltas as one, the last's finish (in one pass: a span may be a
    whole completion's)."""
    if len(deltas) == 1:
        return deltas[0]
    logprobs = None
    if any(delta.logprobs is not None for delta in deltas):
        logprobs = [entry for delta in deltas for entry in delta.logprobs or ()]
    with_prompt = next((d for d in deltas if d.prompt_logprobs), None)
    return dataclasses.replace(
        deltas[-1],
        text="".join(delta.text for delta in deltas),
        token_ids=[token for delta in deltas for token in delta.token_ids],
        logprobs=logprobs,
        prompt_logprobs=with_prompt.prompt_logprobs if with_prompt is not None else None,
        prompt_ranks=with_prompt.prompt_ranks if with_prompt is not None else None,
    )
