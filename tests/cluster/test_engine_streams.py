"""The ingress's engine streams through the Serve engine client (cluster/serve_engine_client.py)
and its output channels, against a stand-in engine handle."""

from __future__ import annotations

import asyncio
from typing import Any, Generator

import pytest
from transformers import AutoTokenizer

from pagedray.cluster import migration
from pagedray.cluster.engine_control import EngineControl
from pagedray.cluster.serve_engine_client import ServeEngineClient
from pagedray.engine.output_processor import ChoiceDelta
from pagedray.engine.wire import GenerateRequest, RequestStepOutput
from pagedray.openai.engine_streams import EngineStreams
from pagedray.scheduler.sampling_params import SamplingParams


class _StandInEngine:
    """A handle whose unary generate call is routed to replica "r1" (its router names it, as
    `EngineRequestRouter` does) and then runs until cancelled, and whose subscriptions never
    deliver: outputs are handed in by the test."""

    def __init__(self, num_failing_calls: int = 0) -> None:
        """The first `num_failing_calls` generate calls go to replica "r0", which dies."""
        self.cancelled: list[str] = []
        self.num_failing_calls = num_failing_calls

    def options(self, stream: bool) -> _StandInEngine:
        return self

    @property
    def generate(self) -> _StandInEngine:
        return self

    @property
    def subscribe(self) -> _StandInEngine:
        return self

    def remote(self, *args: Any, **kwargs: Any) -> _Call:
        request = args[0]
        if not isinstance(request, GenerateRequest):
            return _Call(self, "subscription")
        dies = self.num_failing_calls > 0
        self.num_failing_calls -= 1
        if request.on_routed is not None:
            request.on_routed("r0" if dies else "r1")
        return _Call(self, request.request_id, dies)


class _Call:
    """A call that never ends by itself: awaited (a request's) or read (a subscription's)."""

    def __init__(self, engine: _StandInEngine, request_id: str, dies: bool = False) -> None:
        self.engine, self.request_id, self.dies = engine, request_id, dies
        self.forever = asyncio.Event()

    def __await__(self) -> Generator[Any, None, RequestStepOutput]:
        if self.dies:
            yield from asyncio.sleep(0).__await__()
            raise RuntimeError("ActorDiedError: the replica's process exited")
        yield from self.forever.wait().__await__()
        return RequestStepOutput(self.request_id, finished=True, replica_id="r1")

    def __aiter__(self) -> _Call:
        return self

    async def __anext__(self) -> Any:
        await self.forever.wait()
        raise StopAsyncIteration

    def cancel(self) -> None:
        self.engine.cancelled.append(self.request_id)


async def _opening(streams: EngineStreams) -> asyncio.Task[Any]:
    """`streams.open()` under way: its calls sent (and routed), waiting for a first output."""
    opening = asyncio.create_task(streams.open())
    for _ in range(3):
        await asyncio.sleep(0)
    return opening


def test_a_stop_string_in_outputs_queued_before_the_stream_is_read_ends_it(
    tiny_llama: str,
) -> None:
    """The channel may deliver before `merged()` first runs; a stop string found then cancels
    a call whose pump never started, and the stream must still end."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    token_ids = tokenizer.encode("hello world again", add_special_tokens=False)
    params = SamplingParams(max_tokens=16, stop=["world"])
    request = GenerateRequest("cmpl-1", [1, 2], params, stream_interval=1)
    engine = _StandInEngine()

    async def run() -> list[RequestStepOutput]:
        client = _client(engine)
        streams = EngineStreams(client, [request], tokenizer)
        opening = await _opening(streams)
        assert request.channel_id == client.subscriber.channel_id
        delta = ChoiceDelta("cmpl-1", 0, "", token_ids, None, None, None)
        client.subscriber._deliver([RequestStepOutput("cmpl-1", [delta])], "r1")  # a batch
        assert await opening is None
        return [output async for _, output in streams.merged()]

    outputs = asyncio.run(asyncio.wait_for(run(), 10.0))
    text = "".join(d.text for output in outputs for d in output.deltas)
    assert outputs[-1].finished and text == "hello "
    assert "cmpl-1" in engine.cancelled  # the engine request is aborted


def _client(engine: _StandInEngine) -> ServeEngineClient:
    return ServeEngineClient(engine, EngineControl(engine, max_model_len=64))  # type: ignore[arg-type]


def _streamed_request(request_id: str, max_tokens: int) -> GenerateRequest:
    return GenerateRequest(
        request_id, [1, 2], SamplingParams(max_tokens=max_tokens), stream_interval=1
    )


def _token_output(request_id: str, token_id: int, finish: str | None) -> RequestStepOutput:
    delta = ChoiceDelta(request_id, 0, "", [token_id], None, finish, None)
    return RequestStepOutput(request_id, [delta], finished=finish is not None)


def test_outputs_queued_behind_a_slow_reader_leave_as_one_with_the_same_text(
    tiny_llama: str,
) -> None:
    """Steps the reader fell behind on are joined into one output (one chunk to write), as
    vLLM's RequestOutputCollector does; a reader that keeps up gets one output a step. Either
    way the text is the tokens' text, and nothing is lost or doubled."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    token_ids = tokenizer.encode("the quick brown fox jumps over", add_special_tokens=False)
    engine = _StandInEngine()

    async def read(request_id: str, behind: bool) -> list[RequestStepOutput]:
        client = _client(engine)
        subscriber = client.subscriber
        streams = EngineStreams(client, [_streamed_request(request_id, len(token_ids))], tokenizer)
        opening = await _opening(streams)
        steps = [
            _token_output(request_id, token, "length" if i == len(token_ids) - 1 else None)
            for i, token in enumerate(token_ids)
        ]
        # Every step's output lands before the reader first runs, or only the first does.
        for step in steps if behind else steps[:1]:
            subscriber._deliver([step], "r1")
        assert await opening is None
        # NOTE: read until the finished output only: the stand-in's call never ends by itself.
        outputs: list[RequestStepOutput] = []
        merged = streams.merged()
        while not outputs or not outputs[-1].finished:
            if not behind and outputs:  # one step, then the reader takes it
                subscriber._deliver([steps[len(outputs)]], "r1")
            outputs.append((await anext(merged))[1])
        await merged.aclose()
        return outputs

    kept_up = asyncio.run(asyncio.wait_for(read("cmpl-up", behind=False), 10.0))
    fell_behind = asyncio.run(asyncio.wait_for(read("cmpl-behind", behind=True), 10.0))
    assert len(kept_up) == len(token_ids) and len(fell_behind) == 1
    expected = tokenizer.decode(token_ids)
    for outputs in (kept_up, fell_behind):
        assert "".join(d.text for output in outputs for d in output.deltas) == expected
        assert [t for output in outputs for d in output.deltas for t in d.token_ids] == token_ids
        assert outputs[-1].finished and outputs[-1].usage is not None
        assert outputs[-1].usage["completion_tokens"] == len(token_ids)


def test_a_stream_whose_replica_dies_before_its_first_output_goes_to_another(
    tiny_llama: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first replica dies before the stream's first output: the request is sent again, its
    outputs come from the replica chosen then, and the client sees one whole stream."""
    monkeypatch.setattr(migration, "MIGRATION_PAUSE_S", 0.001)
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    token_ids = tokenizer.encode("hello world again", add_special_tokens=False)
    engine = _StandInEngine(num_failing_calls=1)

    async def run() -> list[RequestStepOutput]:
        client = _client(engine)
        streams = EngineStreams(client, [_streamed_request("cmpl-m", len(token_ids))], tokenizer)
        opening = await _opening(streams)
        for _ in range(20):  # the failed call, the pause, the call sent again
            await asyncio.sleep(0.002)
        assert client.subscriber._replica_of == {"cmpl-m": "r1"}
        # A late batch from the replica that died is not the stream's any more.
        client.subscriber._deliver([_token_output("cmpl-m", 999, "length")], "r0")
        for i, token in enumerate(token_ids):
            last = i == len(token_ids) - 1
            step = _token_output("cmpl-m", token, "length" if last else None)
            client.subscriber._deliver([step], "r1")
        assert await opening is None
        return [output async for _, output in streams.merged()]

    outputs = asyncio.run(asyncio.wait_for(run(), 10.0))
    assert [t for output in outputs for d in output.deltas for t in d.token_ids] == token_ids
    assert outputs[-1].finished and all(output.error is None for output in outputs)
