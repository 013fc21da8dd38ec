"""The ingress's edge, piece by piece: strict JSON bodies, the guard middleware (API key, body
limit, last-resort 500) on a plain Starlette app, and engine failures as opaque errors. The same
behaviour through Ray Serve over HTTP: tests/cluster/test_ingress_limits.py."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any, Iterator

import pytest
from fastapi import FastAPI, Request
from fastapi.testclient import TestClient
from transformers import AutoTokenizer

from pagedray.cluster import migration, replica_watch
from pagedray.cluster.engine_control import EngineControl
from pagedray.cluster.serve_engine_client import ServeEngineClient
from pagedray.engine.output_processor import ChoiceDelta
from pagedray.engine.wire import GenerateRequest, RequestStepOutput
from pagedray.openai.engine_streams import EngineStreams
from pagedray.openai.ingress_guard import GuardSettings, IngressGuard, api_key_digest
from pagedray.openai.request_body import MAX_JSON_DEPTH, BodyError, parse_json_body
from pagedray.openai.serving import engine_error_response
from pagedray.scheduler.request_failure import FailureKind, RequestFailure
from pagedray.scheduler.sampling_params import SamplingParams

KEY = "sk-unit"
LIMIT = 1024


# ---- strict JSON ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "raw, param, message",
    [
        (b'{"prompt": "caf\xe9"}', "body", "body: invalid UTF-8 at byte 15"),
        (b'{"prompt": ', "body", "body: invalid JSON"),
        (b"[" * 100_000 + b"]" * 100_000, "body", "body: JSON nested deeper than"),
        (b'{"a": ' * 65 + b"1" + b"}" * 65, "body", "body: JSON nested deeper than"),
        (b'{"prompt": "\\ud800"}', "prompt", "prompt: contains a lone surrogate"),
        (
            b'{"messages": [{"role": "user", "content": "x\\udfff"}]}',
            "messages",
            "messages.0.content: contains a lone surrogate",
        ),
        (b'{"logit_bias": {"\\ud800": 1}}', "logit_bias", "logit_bias.\\ud800: contains"),
        (b'"\\ud800"', "body", "body: contains a lone surrogate"),
    ],
)
def test_bodies_a_route_must_not_see(raw: bytes, param: str, message: str) -> None:
    with pytest.raises(BodyError) as caught:
        parse_json_body(raw)
    assert str(caught.value).startswith(message) and caught.value.param == param


def test_ordinary_bodies_parse() -> None:
    nested = b'{"a": ' * (MAX_JSON_DEPTH - 1) + b"1" + b"}" * (MAX_JSON_DEPTH - 1)
    assert parse_json_body(nested)["a"]["a"]
    body = '{"prompt": "Zürich \\ud83d\\ude00", "n": 2, "stop": ["a"]}'.encode()
    assert parse_json_body(body) == {"prompt": "Zürich 😀", "n": 2, "stop": ["a"]}
    assert len(parse_json_body(json.dumps({"prompt": list(range(100_000))}).encode())["prompt"])


# ---- the guard on a plain app ----------------------------------------------------------------


@pytest.fixture
def client() -> Iterator[TestClient]:
    app = FastAPI()
    settings = GuardSettings(api_key_digest(KEY), LIMIT)
    app.add_middleware(IngressGuard, settings_of=lambda: settings, routes=app.router.routes)

    @app.post("/echo")
    async def echo(raw: Request) -> dict[str, int]:
        return {"size": len(await raw.body())}

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/boom")
    async def boom() -> None:
        raise RuntimeError("secret detail /etc/passwd")

    with TestClient(app, raise_server_exceptions=True) as test_client:
        yield test_client


AUTH = {"Authorization": f"Bearer {KEY}"}


def _error(response: Any, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status
    return error


def test_every_path_but_health_needs_the_key(client: TestClient) -> None:
    assert client.get("/health").json() == {"status": "ok"}
    for path in ("/boom", "/docs", "/openapi.json", "/redoc", "/nowhere"):
        response = client.get(path)
        assert _error(response, 401)["type"] == "AuthenticationError"
        assert response.headers["www-authenticate"] == "Bearer"
    _error(client.post("/echo", content=b"{}", headers={"Authorization": "Bearer sk-wrong"}), 401)
    _error(client.post("/echo", content=b"{}", headers={"Authorization": KEY}), 401)
    assert client.post("/echo", content=b"{}", headers=AUTH).json() == {"size": 2}
    assert client.get("/docs", headers=AUTH).status_code == 200


def test_body_limit_from_content_length_and_while_reading(client: TestClient) -> None:
    assert client.post("/echo", content=b"x" * LIMIT, headers=AUTH).json() == {"size": LIMIT}
    error = _error(client.post("/echo", content=b"x" * (LIMIT + 1), headers=AUTH), 413)
    assert error["param"] == "body" and str(LIMIT) in error["message"]

    def chunks() -> Iterator[bytes]:  # no Content-Length: chunked transfer
        for _ in range(10):
            yield b"x" * 200

    _error(client.post("/echo", content=chunks(), headers=AUTH), 413)
    headers = {**AUTH, "Content-Length": "lots"}
    assert _error(client.post("/echo", content=b"{}", headers=headers), 400)["param"] == "body"


def test_unhandled_exception_is_an_opaque_500(
    client: TestClient, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.ERROR, logger="pagedray"):
        response = client.get("/boom", headers=AUTH)
    error = _error(response, 500)
    assert error["message"].startswith("internal error (request req-")
    assert "secret" not in response.text and "Traceback" not in response.text
    request_id = error["message"].removeprefix("internal error (request ").removesuffix(")")
    logged = "\n".join(f"{r.getMessage()}\n{r.exc_text}" for r in caplog.records)
    assert request_id in logged and "secret detail" in logged and "Traceback" in logged


# ---- engine failures ----------------------------------------------------------------------


def test_engine_errors_set_retry_after() -> None:
    busy = RequestFailure(FailureKind.OVERLOADED, "waiting queue is full")
    assert engine_error_response(busy).status_code == 503
    assert engine_error_response(busy).headers["retry-after"] == "1"
    later = RequestFailure(FailureKind.OVERLOADED, "waiting queue is full", retry_after_s=7)
    assert engine_error_response(later).headers["retry-after"] == "7"
    bad = RequestFailure(FailureKind.TOO_LONG, "prompt: too long", param="prompt")
    assert engine_error_response(bad).status_code == 400
    assert "retry-after" not in engine_error_response(bad).headers
    timed_out = RequestFailure(FailureKind.TIMEOUT, "past its deadline", retry_after_s=3)
    assert engine_error_response(timed_out).status_code == 504
    assert engine_error_response(timed_out).headers["retry-after"] == "3"


def test_every_failure_kind_has_a_status() -> None:
    """The table from failure to HTTP is total: a kind added without a status fails here."""
    for kind in FailureKind:
        response = engine_error_response(RequestFailure(kind, "m"))
        assert 400 <= response.status_code < 600
        body = json.loads(response.body)
        assert body["error"]["message"] == "m" and body["error"]["code"] == response.status_code


class _FakeHandle:
    """A DeploymentHandle whose unary `generate` calls answer `answers` in turn, the last again
    and again (an exception is raised); the output channel brings nothing. Its router names a
    replica for each call, as `EngineRequestRouter` does, unless none is `live`."""

    def __init__(self, *answers: Any, live: bool = True, wedged: frozenset[str] = frozenset()):
        """`wedged`: replicas (r1, r2... one per call) that never answer, nor their probes."""
        self.answers = list(answers)
        self.generate = self
        self.num_calls = 0
        self.live = live
        self.wedged = wedged

    def options(self, stream: bool) -> _FakeHandle:
        return self

    @property
    def subscribe(self) -> _FakeHandle:
        return self

    @property
    def liveness(self) -> _FakeLiveness:
        return _FakeLiveness(self.wedged)

    def remote(self, request: Any, **kwargs: Any) -> Any:
        if not isinstance(request, GenerateRequest):  # a subscription to an output channel
            return _NeverDelivers()
        self.num_calls += 1
        replica_id = f"r{self.num_calls}"
        if self.live and request.on_routed is not None:
            request.on_routed(replica_id)
        answer = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
        return _FakeResponse(_HANGS if replica_id in self.wedged else answer)


class _FakeLiveness:
    """A replica's answer to the ingress's probe: it makes progress, unless `wedged`."""

    def __init__(self, wedged: frozenset[str]) -> None:
        self.wedged = wedged

    def remote(self, replica_id: str) -> _FakeResponse:
        return _FakeResponse(_HANGS if replica_id in self.wedged else None)


_HANGS = object()  # a call that is never answered


class _NeverDelivers:
    """A subscription whose channel brings nothing."""

    def __aiter__(self) -> _NeverDelivers:
        return self

    async def __anext__(self) -> Any:
        await asyncio.Event().wait()

    def cancel(self) -> None:
        pass


class _FakeResponse:
    """A DeploymentResponse: awaited, it returns its answer or raises it."""

    def __init__(self, answer: Any) -> None:
        self.answer = answer

    def __await__(self) -> Iterator[Any]:
        yield from asyncio.sleep(0).__await__()
        if self.answer is _HANGS:
            yield from asyncio.Event().wait().__await__()
        if isinstance(self.answer, BaseException):
            raise self.answer
        return self.answer

    def cancel(self) -> None:
        pass


PARAMS = SamplingParams(max_tokens=4)


def _merged_errors(
    answer: Any, caplog: pytest.LogCaptureFixture, unary: bool
) -> list[RequestFailure]:
    """The errors a client would see of a request whose call answers `answer`: the refusal at
    admission, or those in the stream; with `unary`, of a request that wants one output at the
    end (its answer), else of a streamed one (its outputs would come through the channel).
    Without migrations: their own test follows."""
    outputs = _outputs(_FakeHandle(answer), caplog, unary, migration_limit=0)
    return [output.error for output in outputs if output.error is not None]


def _outputs(
    handle: _FakeHandle,
    caplog: pytest.LogCaptureFixture,
    unary: bool,
    migration_limit: int,
    tokenizer: Any = None,
    prompt: tuple[int, ...] = (1,),
    migration_max_seq_len: int | None = None,
    migrations: list[str] | None = None,
) -> list[RequestStepOutput]:
    """What a client's request through `handle` gets: its refusal, or its outputs (their text
    made by `tokenizer`); each move's reason is appended to `migrations`."""
    stream_interval = None if unary else 1

    async def run() -> list[RequestStepOutput]:
        request = GenerateRequest("cmpl-7", list(prompt), PARAMS, stream_interval=stream_interval)
        control = EngineControl(handle, max_model_len=64)  # type: ignore[arg-type]
        client = ServeEngineClient(
            handle,  # type: ignore[arg-type]
            control,
            migration_limit,
            on_migration=lambda reason, seconds: migrations.append(reason),
            migration_max_seq_len=migration_max_seq_len,
        )
        streams = EngineStreams(client, [request], tokenizer)
        refused = await streams.open()
        if refused is not None:
            return [RequestStepOutput("cmpl-7", error=refused)]
        return [out async for _, out in streams.merged()]

    migrations = [] if migrations is None else migrations
    with caplog.at_level(logging.WARNING, logger="pagedray"):
        outputs = asyncio.run(run())
    # Each call after the first is a move, counted once the router placed it.
    assert len(migrations) == (handle.num_calls - 1 if handle.live else 0)
    return outputs


@pytest.mark.parametrize("unary", [False, True], ids=["streamed", "unary"])
def test_a_request_its_engine_failed_before_any_output_is_sent_again(
    caplog: pytest.LogCaptureFixture,
    unary: bool,
    monkeypatch: pytest.MonkeyPatch,
    tiny_llama: str,
) -> None:
    """A replica that died, or an engine that aborted the request from outside, before any of
    its output reached the client: the request goes again (up to the limit), and the client
    sees only the answer; past the limit it sees the failure; its own failures are final."""
    monkeypatch.setattr(migration, "MIGRATION_PAUSE_S", 0.001)
    monkeypatch.setattr(migration, "MIGRATION_ROUTE_S", 0.05)
    died = RuntimeError("ActorDiedError: worker pid=1234 at 10.0.0.7 exited")
    aborted = RequestStepOutput("cmpl-7", error=RequestFailure(FailureKind.ABORTED, "aborted"))
    delta = ChoiceDelta("cmpl-7", 0, "", [5], None, "length", None)
    answer = RequestStepOutput("cmpl-7", [delta], finished=True)
    if unary:
        handle = _FakeHandle(died, aborted, answer)
        tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
        outputs = _outputs(handle, caplog, unary, migration_limit=2, tokenizer=tokenizer)
        assert handle.num_calls == 3 and [o.error for o in outputs] == [None]
        assert outputs[-1].finished and outputs[-1].deltas[0].token_ids == [5]
        assert "sending it again" in caplog.text
    handle = _FakeHandle(died, died, answer)
    outputs = _outputs(handle, caplog, unary, migration_limit=1)
    assert handle.num_calls == 2
    assert [o.error for o in outputs] == [
        RequestFailure(FailureKind.DEAD, "engine unavailable (request cmpl-7)")
    ]
    timed_out = RequestStepOutput("cmpl-7", error=RequestFailure(FailureKind.TIMEOUT, "late"))
    handle = _FakeHandle(timed_out, answer)
    outputs = _outputs(handle, caplog, unary, migration_limit=3)
    assert handle.num_calls == 1 and outputs[-1].error == timed_out.error
    # No live replica to move to (the only one died; the router places nothing): the failure
    # is the answer.
    handle = _FakeHandle(died, answer, live=False)
    outputs = _outputs(handle, caplog, unary, migration_limit=3)
    assert handle.num_calls == 2 and outputs[-1].error is not None
    assert outputs[-1].error.kind is FailureKind.DEAD and "no live engine replica" in caplog.text


@pytest.mark.parametrize("unary", [False, True], ids=["streamed", "unary"])
def test_a_request_longer_than_migration_max_seq_len_does_not_move(
    caplog: pytest.LogCaptureFixture, unary: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(migration, "MIGRATION_PAUSE_S", 0.001)
    died = RuntimeError("ActorDiedError: the replica exited")
    # The second engine's answer: a failure of the request's own, final (the fake's channel
    # brings no output for a stream).
    late = RequestStepOutput("cmpl-7", error=RequestFailure(FailureKind.TIMEOUT, "late"))
    handle = _FakeHandle(died, late)
    outputs = _outputs(handle, caplog, unary, 3, prompt=(1, 2, 3), migration_max_seq_len=2)
    assert handle.num_calls == 1 and outputs[-1].error is not None
    assert outputs[-1].error.kind is FailureKind.DEAD
    assert "past --migration-max-seq-len" in caplog.text
    handle = _FakeHandle(died, late)
    outputs = _outputs(handle, caplog, unary, 3, prompt=(1, 2, 3), migration_max_seq_len=3)
    assert handle.num_calls == 2 and outputs[-1].error == late.error


@pytest.mark.parametrize("unary", [False, True], ids=["streamed", "unary"])
def test_a_request_on_a_replica_that_stops_answering_moves(
    caplog: pytest.LogCaptureFixture, unary: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The replica holding the request answers neither the request nor the ingress's probe:
    the watch takes it out of routing and the request moves, counted as `stalled`."""
    monkeypatch.setattr(migration, "MIGRATION_PAUSE_S", 0.001)
    monkeypatch.setattr(replica_watch, "PROBE_PERIOD_S", 0.01)
    monkeypatch.setattr(replica_watch, "UNANSWERED_S", 0.05)
    monkeypatch.setattr(replica_watch, "UNHEALTHY_REPLICA_IDS", set())
    monkeypatch.setattr(replica_watch, "LIVE_REPLICA_IDS", frozenset({"r1", "r2"}))
    late = RequestStepOutput("cmpl-7", error=RequestFailure(FailureKind.TIMEOUT, "late"))
    handle = _FakeHandle(late, wedged=frozenset({"r1"}))
    migrations: list[str] = []
    outputs = _outputs(handle, caplog, unary, 3, migrations=migrations)
    assert handle.num_calls == 2 and outputs[-1].error == late.error  # the second replica's
    assert migrations == ["stalled"] and "r1 makes no progress" in caplog.text
    assert {"r1"} == replica_watch.UNHEALTHY_REPLICA_IDS  # out of routing until it answers


def test_a_stalled_replica_keeps_its_requests_until_another_replica_is_there(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With no other live replica a request has nowhere to go: a replica that stops answering
    is marked (and routed around once another comes) but keeps its requests until then."""
    monkeypatch.setattr(replica_watch, "PROBE_PERIOD_S", 0.01)
    monkeypatch.setattr(replica_watch, "UNANSWERED_S", 0.05)
    monkeypatch.setattr(replica_watch, "UNHEALTHY_REPLICA_IDS", set())
    monkeypatch.setattr(replica_watch, "LIVE_REPLICA_IDS", frozenset({"r1"}))

    async def run() -> list[str]:
        watch = replica_watch.ReplicaWatch(_FakeHandle(None, wedged=frozenset({"r1"})))
        failed: list[str] = []
        watch.hold("r1", "cmpl-7", failed.append)
        await asyncio.sleep(0.3)
        assert failed == [] and {"r1"} == replica_watch.UNHEALTHY_REPLICA_IDS
        replica_watch.set_live_replicas(frozenset({"r1", "r2"}))
        await asyncio.sleep(0.3)
        return failed

    failed = asyncio.run(run())
    assert len(failed) == 1 and "r1 makes no progress" in failed[0]


@pytest.mark.parametrize("unary", [False, True], ids=["streamed", "unary"])
def test_a_dead_replica_is_engine_unavailable(
    caplog: pytest.LogCaptureFixture, unary: bool
) -> None:
    died = RuntimeError("ActorDiedError: worker pid=1234 at 10.0.0.7 exited, traceback ...")
    errors = _merged_errors(died, caplog, unary)
    assert errors == [RequestFailure(FailureKind.DEAD, "engine unavailable (request cmpl-7)")]
    assert "cmpl-7" in caplog.text and "pid=1234" in caplog.text


@pytest.mark.parametrize("unary", [False, True], ids=["streamed", "unary"])
def test_an_internal_engine_error_keeps_only_the_request_id(
    caplog: pytest.LogCaptureFixture, unary: bool
) -> None:
    internal = RequestFailure(FailureKind.INTERNAL, "RuntimeError: CUDA error at sampler.py:88")
    failed = RequestStepOutput("", error=internal)
    errors = _merged_errors(failed, caplog, unary)
    assert errors == [RequestFailure(FailureKind.INTERNAL, "internal error (request cmpl-7)")]
    assert "sampler.py" in caplog.text
    # Refusals the client can act on keep their message.
    refused = RequestFailure(FailureKind.TOO_LONG, "prompt: too long", param="prompt")
    assert _merged_errors(RequestStepOutput("", error=refused), caplog, unary) == [refused]
