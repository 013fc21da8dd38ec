"""Text for one engine request's streamed token ids, made where the client is (the ingress).

The serving engine streams token ids, logprobs and finish reasons; this turns each choice's
deltas into text, finds stop strings and says when every choice has ended, so the caller can stop
the request in the engine (vLLM V1's front end does the same). Tokens after a stop string are
dropped, so the text, the token ids, the logprobs and the usage all end where the stop string
did.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from pagedray.engine.choice_text import ChoiceText
from pagedray.engine.output_processor import ChoiceDelta
from pagedray.scheduler.sampling_params import SamplingParams


class RequestText:
    """The n choices of one engine request, as text."""

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.num_prompt_tokens = len(prompt_token_ids)
        self.choices = [ChoiceText(tokenizer, prompt_token_ids, params) for _ in range(params.n)]
        self.num_tokens = [0] * params.n  # kept tokens per choice: up to a stop string
        self.by_token = bool(params.stop)  # stop strings: push one token at a time

    @property
    def finished(self) -> bool:
        return all(choice.finish_reason is not None for choice in self.choices)

    @property
    def num_completion_tokens(self) -> int:
        return sum(self.num_tokens)

    def apply(self, delta: ChoiceDelta) -> ChoiceDelta | None:
        """The delta with its text; None for tokens of a choice that has ended already."""
        choice = self.choices[delta.index]
        if choice.finish_reason is not None:
            return None
        token_ids = delta.token_ids
        kept = len(token_ids)
        stopped = False
        if self.by_token:
            for i, token_id in enumerate(token_ids):
                if choice.push([token_id]):
                    kept, stopped = i + 1, True
                    break
        else:
            choice.push(token_ids)
        self.num_tokens[delta.index] += kept
        if not stopped and delta.finish_reason is not None:
            stop_token = token_ids[-1] if delta.finish_reason == "stop" and token_ids else None
            choice.finish(delta.finish_reason, stop_token)
        logprobs = delta.logprobs[:kept] if delta.logprobs is not None else None
        return dataclasses.replace(
            delta,
            text=choice.take_new_text(),
            token_ids=token_ids[:kept],
            logprobs=logprobs,
            finish_reason=choice.finish_reason,
            stop_reason=choice.stop_reason if stopped else delta.stop_reason,
        )
