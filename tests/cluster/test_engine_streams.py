"""The ingress's engine streams with output channels, against a stand-in engine handle."""

from __future__ import annotations

import asyncio
from typing import Any

from transformers import AutoTokenizer

from pagedray.engine.output_processor import ChoiceDelta
from pagedray.engine.step_outputs import RequestStepOutput
from pagedray.openai.engine_streams import EngineStreams
from pagedray.openai.output_subscriber import OutputSubscriber
from pagedray.scheduler.sampling_params import SamplingParams


class _StandInEngine:
    """A handle whose generate call accepts (on replica "r1") and then runs until cancelled,
    and whose subscriptions never deliver: outputs are handed in by the test."""

    def __init__(self) -> None:
        self.cancelled: list[str] = []

    def options(self, stream: bool) -> _StandInEngine:
        return self

    @property
    def generate(self) -> _StandInEngine:
        return self

    @property
    def subscribe(self) -> _StandInEngine:
        return self

    def remote(self, *args: Any, **kwargs: Any) -> _Call:
        request_id = args[0]["request_id"] if isinstance(args[0], dict) else "subscription"
        return _Call(self, request_id)


class _Call:
    def __init__(self, engine: _StandInEngine, request_id: str) -> None:
        self.engine, self.request_id = engine, request_id
        self.accepted = False
        self.forever = asyncio.Event()

    def __aiter__(self) -> _Call:
        return self

    async def __anext__(self) -> Any:
        if self.request_id != "subscription" and not self.accepted:
            self.accepted = True
            return RequestStepOutput(self.request_id, replica_id="r1")
        await self.forever.wait()
        raise StopAsyncIteration

    def cancel(self) -> None:
        self.engine.cancelled.append(self.request_id)


def test_a_stop_string_in_outputs_queued_before_the_stream_is_read_ends_it(
    tiny_llama: str,
) -> None:
    """The channel may deliver before `merged()` first runs; a stop string found then cancels
    a call whose pump never started, and the stream must still end."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    token_ids = tokenizer.encode("hello world again", add_special_tokens=False)
    params = SamplingParams(max_tokens=16, stop=["world"])
    request = {
        "request_id": "cmpl-1",
        "prompt_token_ids": [1, 2],
        "sampling_params": params,
        "stream_interval": 1,
    }
    engine = _StandInEngine()

    async def run() -> list[RequestStepOutput]:
        subscriber = OutputSubscriber(engine)
        streams = EngineStreams(engine, [request], tokenizer, subscriber)
        assert request["channel_id"] == subscriber.channel_id
        assert await streams.open() is None
        delta = ChoiceDelta("cmpl-1", 0, "", token_ids, None, None, None)
        subscriber._deliver([RequestStepOutput("cmpl-1", [delta])])  # as a channel batch
        return [output async for _, output in streams.merged()]

    outputs = asyncio.run(asyncio.wait_for(run(), 10.0))
    text = "".join(d.text for output in outputs for d in output.deltas)
    assert outputs[-1].finished and text == "hello "
    assert "cmpl-1" in engine.cancelled  # the engine request is aborted
