"""The ingress's text (`RequestText`) against the offline output processor's, and the one
stream coalescer.

The serving engine sends token ids in chunks of any size (`--stream-interval`, a reader that
fell behind); whatever the chunking, the ingress must make the text, stop-string cut, token
count and finish that `OutputProcessor` makes token by token offline.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from pagedray.engine.output_processor import ChoiceDelta, OutputProcessor
from pagedray.engine.request_text import RequestText
from pagedray.engine.step_outputs import StreamCoalescer
from pagedray.engine.wire import RequestStepOutput
from pagedray.scheduler.outputs import EngineCoreOutput
from pagedray.scheduler.sampling_params import SamplingParams

PROMPT = [5, 6, 7]


@pytest.fixture(scope="module")
def tokenizer(tiny_llama: str) -> Any:
    return AutoTokenizer.from_pretrained(tiny_llama)


def _offline(tokenizer: Any, tokens: list[int], params: SamplingParams, finish: str):
    """Text, kept tokens, finish and stop reason as the offline path makes them."""
    processor = OutputProcessor(tokenizer)
    state = processor.add_request("r", None, PROMPT, params)
    for i, token in enumerate(tokens):
        last = i == len(tokens) - 1
        out = EngineCoreOutput("r", 0, [token], None, finish if last else None)
        _, stopped = processor.process([out])
        if stopped:
            break
    choice = state.to_output().outputs[0]
    return choice.text, len(choice.token_ids), choice.finish_reason, choice.stop_reason


def _ingress(tokenizer: Any, tokens: list[int], params: SamplingParams, finish: str, cuts):
    """The same through `RequestText`, the tokens arriving in chunks split at `cuts`."""
    text = RequestText(tokenizer, PROMPT, params)
    bounds = [0, *sorted(set(c for c in cuts if 0 < c < len(tokens))), len(tokens)]
    parts: list[str] = []
    finish_reason = stop_reason = None
    for start, end in zip(bounds, bounds[1:]):
        last = end == len(tokens)
        chunk = tokens[start:end]
        delta = ChoiceDelta("r", 0, "", chunk, None, finish if last else None, None)
        applied = text.apply(delta)
        if applied is None:
            break
        parts.append(applied.text)
        finish_reason, stop_reason = applied.finish_reason, applied.stop_reason
        if text.finished:
            break
    return "".join(parts), text.num_completion_tokens, finish_reason, stop_reason


FIXTURE_OK = [HealthCheck.function_scoped_fixture]  # the tokenizer is read-only


@settings(max_examples=60, deadline=None, suppress_health_check=FIXTURE_OK)
@given(
    tokens=st.lists(st.integers(3, 500), min_size=1, max_size=24),
    cuts=st.lists(st.integers(0, 24), max_size=6),
    stop_at=st.one_of(st.none(), st.tuples(st.integers(0, 200), st.integers(1, 3))),
    include_stop=st.booleans(),
    finish=st.sampled_from(["length", "stop"]),
)
def test_chunked_tokens_make_the_offline_text(
    tokenizer: Any,
    tokens: list[int],
    cuts: list[int],
    stop_at: Any,
    include_stop: bool,
    finish: str,
) -> None:
    stop: list[str] = []
    if stop_at is not None:  # a stop string cut from the text itself, so it is found
        full = tokenizer.decode(tokens)
        start = stop_at[0] % max(1, len(full))
        stop = [full[start : start + stop_at[1]]] if full[start : start + stop_at[1]] else []
    params = SamplingParams(max_tokens=64, stop=stop, include_stop_str_in_output=include_stop)
    assert _ingress(tokenizer, tokens, params, finish, cuts) == _offline(
        tokenizer, tokens, params, finish
    )


def test_tokens_after_a_stop_string_are_dropped(tokenizer: Any) -> None:
    tokens = tokenizer.encode("one two three four", add_special_tokens=False)
    params = SamplingParams(max_tokens=64, stop=["two"])
    text = RequestText(tokenizer, PROMPT, params)
    delta = text.apply(ChoiceDelta("r", 0, "", tokens, [{t: -1.0} for t in tokens], None, None))
    assert delta is not None and text.finished
    assert (delta.text, delta.finish_reason, delta.stop_reason) == ("one ", "stop", "two")
    kept = text.num_completion_tokens
    assert delta.token_ids == tokens[:kept] and len(delta.logprobs) == kept < len(tokens)
    assert text.apply(ChoiceDelta("r", 0, "", tokens[:1], None, None, None)) is None


def _output(num_tokens: int, finished: bool = False) -> RequestStepOutput:
    delta = ChoiceDelta("r", 0, "x" * num_tokens, [1] * num_tokens, None, None, None)
    return RequestStepOutput("r", [delta], finished)


@pytest.mark.parametrize("interval", [None, 1, 3])
def test_the_coalescer_sends_the_first_token_then_every_interval(interval: int | None) -> None:
    coalescer = StreamCoalescer(interval)
    sent: list[int] = []
    for step in range(7):
        coalescer.add(_output(1, finished=step == 6))
        if coalescer.ready():
            sent.append(len(coalescer.take().deltas[0].token_ids))
    assert sum(sent) == 7
    expected = {None: [7], 1: [1] * 7, 3: [1, 3, 3]}[interval]
    assert sent == expected
