"""Front-end bookkeeping per request: tokens, logprobs, usage, timing and, given a tokenizer,
text and stop strings.

The engine core reports token ids per sequence; this turns them into per-choice deltas and
`RequestOutput`s. With a tokenizer (the offline `LLM`) the deltas carry text, and sequences whose
stop string appeared are reported so the engine frees them within the same step. Without one
(the serving engine replica) it handles token ids only: the ingress makes the text.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from pagedray.engine.choice_text import ChoiceText
from pagedray.scheduler.messages import RequestError
from pagedray.scheduler.outputs import CompletionOutput, EngineCoreOutput, RequestOutput
from pagedray.scheduler.request import child_req_id
from pagedray.scheduler.sampling_params import SamplingParams


@dataclass
class ChoiceDelta:
    """What one step added to one choice: the unit a streaming response sends."""

    request_id: str
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None
    stop_reason: str | int | None
    # With prompt_logprobs: on a choice's first delta, per prompt token (None for the first),
    # and each prompt token's rank among the vocabulary (1: the most likely).
    prompt_logprobs: list[dict[int, float] | None] | None = None
    prompt_ranks: list[int | None] | None = None


@dataclass
class _Choice:
    text: ChoiceText | None  # None: token ids only
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    sent_prompt_logprobs: bool = False


class RequestState:
    """One client request and its n choices."""

    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        tokenizer: Any,
        stream_text: bool = True,
        at_end: bool = False,
    ) -> None:
        """`tokenizer` None: token ids only, no text. `at_end`: its reader takes one output, at
        the end, so a choice's delta is made only as it ends, and holds all of the choice."""
        self.request_id = request_id
        self.at_end = at_end
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.choices = [
            _Choice(
                None
                if tokenizer is None
                else ChoiceText(tokenizer, prompt_token_ids, params, stream_text),
                logprobs=[] if params.logprobs is not None else None,
            )
            for _ in range(params.n)
        ]
        self.arrival_time = time.time()
        self.first_token_time: float | None = None
        self.finish_time: float | None = None
        self.num_cached_tokens = 0
        self.prompt_logprobs: list[dict[int, float] | None] | None = None
        self.prompt_ranks: list[int | None] | None = None
        self.error: RequestError | None = None  # set when the engine ended it with an error

    @property
    def finished(self) -> bool:
        return all(choice.finish_reason is not None for choice in self.choices)

    def seq_id(self, index: int) -> str:
        return self.request_id if self.params.n == 1 else child_req_id(self.request_id, index)

    def to_output(self) -> RequestOutput:
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=[
                CompletionOutput(
                    index=i,
                    text=c.text.text if c.text is not None else "",
                    token_ids=list(c.token_ids),
                    finish_reason=c.finish_reason,
                    logprobs=c.logprobs,
                    stop_reason=c.stop_reason,
                )
                for i, c in enumerate(self.choices)
            ],
            finished=self.finished,
            num_cached_tokens=self.num_cached_tokens,
            prompt_logprobs=self.prompt_logprobs,
            error=self.error.message if self.error is not None else None,
            metrics=self.timing(),
        )

    def timing(self) -> dict[str, float]:
        """When it arrived, sampled its first token and finished (time.time(); 0.0: not yet)."""
        return {
            "arrival_time": self.arrival_time,
            "first_token_time": self.first_token_time or 0.0,
            "finish_time": self.finish_time or 0.0,
        }


class OutputProcessor:
    """All live requests' front-end state."""

    def __init__(self, tokenizer: Any, stream_text: bool = True) -> None:
        """`tokenizer` None: token ids only (the ingress makes the text). `stream_text=False`
        (the offline `LLM`): text is decoded once, when a choice ends, unless stop strings must
        be searched as tokens arrive."""
        self.tokenizer = tokenizer
        self.stream_text = stream_text
        self.requests: dict[str, RequestState] = {}

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        at_end: bool = False,
    ) -> RequestState:
        """`at_end`: see `RequestState`."""
        state = RequestState(
            request_id, prompt, prompt_token_ids, params, self.tokenizer, self.stream_text, at_end
        )
        self.requests[request_id] = state
        return state

    @property
    def finds_stop_strings(self) -> bool:
        """Whether `process` may end a sequence on a stop string: only with text to look in."""
        return self.tokenizer is not None

    def abort(self, request_id: str) -> None:
        self.requests.pop(request_id, None)

    def advanced(self, outputs: list[EngineCoreOutput]) -> list[str]:
        """The live requests that a step's `outputs` (before `process`) give tokens, each once.
        NOTE: from the engine's outputs, not the deltas: a request read at the end has none."""
        advanced = (out.req_id for out in outputs if out.new_token_ids)
        return list(dict.fromkeys(rid for rid in advanced if rid in self.requests))

    def process(self, outputs: list[EngineCoreOutput]) -> tuple[list[ChoiceDelta], list[str]]:
        """Apply one step's outputs. Returns the deltas and the sequence ids a stop string ended."""
        deltas: list[ChoiceDelta] = []
        stopped: list[str] = []
        now = time.time()
        for out in outputs:
            state = self.requests.get(out.req_id)
            if state is None:
                continue
            state.first_token_time = state.first_token_time or now
            state.num_cached_tokens = out.num_cached_tokens
            if out.prompt_logprobs is not None and state.prompt_logprobs is None:
                state.prompt_logprobs = [
                    None if entry is None else dict(zip(entry[0], entry[1]))
                    for entry in out.prompt_logprobs
                ]
                state.prompt_ranks = [
                    None if entry is None else entry[2] for entry in out.prompt_logprobs
                ]
            if out.error is not None:
                deltas.append(self._fail(state, out.error))
                state.finish_time = now
                continue
            choice = state.choices[out.choice_index]
            if choice.finish_reason is not None:
                continue
            if self._update_choice(state, choice, out):
                stopped.append(state.seq_id(out.choice_index))
            if not state.at_end:
                deltas.append(self._delta(state, out.choice_index, len(out.new_token_ids)))
            elif choice.finish_reason is not None:
                deltas.append(self._delta(state, out.choice_index, len(choice.token_ids)))
            if state.finished:
                state.finish_time = now
        return deltas, stopped

    @staticmethod
    def _fail(state: RequestState, error: RequestError) -> ChoiceDelta:
        """End every unfinished choice with "error"; one delta carries it to the stream."""
        state.error = error
        for choice in state.choices:
            choice.finish_reason = choice.finish_reason or "error"
        return ChoiceDelta(state.request_id, 0, "", [], None, "error", None)

    @staticmethod
    def _update_choice(state: RequestState, choice: _Choice, out: EngineCoreOutput) -> bool:
        """Returns True when a stop string ended the choice (the engine must be told)."""
        choice.token_ids.extend(out.new_token_ids)
        if choice.logprobs is not None and out.new_logprobs:
            for ids, logprobs, _rank in out.new_logprobs:
                choice.logprobs.append(dict(zip(ids, logprobs)))
        text = choice.text
        if text is not None and text.push(out.new_token_ids):
            choice.finish_reason, choice.stop_reason = text.finish_reason, text.stop_reason
            return True
        if out.finish_reason is not None:
            choice.finish_reason = out.finish_reason
            last = choice.token_ids[-1] if choice.token_ids else None
            stop_token = last if out.finish_reason == "stop" else None
            if stop_token is not None and stop_token in state.params.stop_token_ids:
                choice.stop_reason = stop_token
            if text is not None:
                text.finish(out.finish_reason, stop_token)
        return False

    def _delta(self, state: RequestState, index: int, num_tokens: int) -> ChoiceDelta:
        """Choice `index`'s delta of its last `num_tokens` tokens."""
        choice = state.choices[index]
        text = choice.text.take_new_text() if choice.text is not None else ""
        logprobs = None
        if choice.logprobs is not None:
            logprobs = choice.logprobs[len(choice.logprobs) - num_tokens :]
        prompt_logprobs = prompt_ranks = None
        if state.prompt_logprobs is not None and not choice.sent_prompt_logprobs:
            prompt_logprobs, prompt_ranks = state.prompt_logprobs, state.prompt_ranks
            choice.sent_prompt_logprobs = True
        return ChoiceDelta(
            request_id=state.request_id,
            index=index,
            text=text,
            token_ids=choice.token_ids[len(choice.token_ids) - num_tokens :],
            logprobs=logprobs,
            finish_reason=choice.finish_reason,
            stop_reason=choice.stop_reason,
            prompt_logprobs=prompt_logprobs,
            prompt_ranks=prompt_ranks,
        )


def deltas_by_request(deltas: list[ChoiceDelta]) -> dict[str, list[ChoiceDelta]]:
    """A step's deltas grouped by request, in order."""
    by_request: dict[str, list[ChoiceDelta]] = {}
    for delta in deltas:
        by_request.setdefault(delta.request_id, []).append(delta)
    return by_request
