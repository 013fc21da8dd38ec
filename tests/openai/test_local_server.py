"""The OpenAI server over an in-process engine (openai/local_app.py), without Ray: the same routes
and middleware as the Serve ingress behind `LocalEngineClient`, driven over HTTP by the official
SDK. Token-exact with the offline API; refusals, stop strings and stored responses behave as
they do behind Serve (tests/cluster/test_openai_server.py), and every block comes back.
"""

from __future__ import annotations

import json
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterator

import openai
import pytest
from fastapi.testclient import TestClient

from pagedray import LLM, LoRARequest, SamplingParams
from pagedray.engine.config import EngineConfig
from pagedray.openai.ingress_guard import GuardSettings, api_key_digest
from pagedray.openai.local_app import local_openai_app
from pagedray.openai.server import OpenAIServer
from pagedray.workers.lora_checkpoint import make_lora_adapter

KEY = "sk-local"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPT = [5, 17, 33, 2, 9, 41, 7]


@pytest.fixture(scope="module")
def served(
    tiny_llama: str, tiny_lora: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[TestClient, OpenAIServer]]:
    # The resolver's folder holds the adapter as "a"; beside the folder lies one as "outside",
    # which a name that leaves the folder would reach.
    root = tmp_path_factory.mktemp("loras")
    for where in (root / "resolved" / "a", root / "outside"):
        shutil.copytree(tiny_lora, where)
    config = EngineConfig(
        model=tiny_llama,
        num_kv_blocks=64,
        max_num_seqs=8,
        served_model_name=["x"],
        enable_lora=True,
        lora_modules=[f"x-lora={tiny_lora}"],
        lora_resolver_dir=str(root / "resolved"),
        allow_runtime_lora_updating=True,
    )
    app = local_openai_app(config, guard=GuardSettings(api_key_digest(KEY)))
    with TestClient(app) as http:  # its lifespan stops the engine at the end
        yield http, app.state.server


@pytest.fixture(scope="module")
def sdk(served: tuple[TestClient, OpenAIServer]) -> openai.OpenAI:
    return openai.OpenAI(base_url="http://testserver/v1", api_key=KEY, http_client=served[0])


@pytest.fixture(scope="module")
def offline(tiny_llama: str) -> LLM:
    return LLM(tiny_llama, num_kv_blocks=64, max_num_seqs=8, enable_lora=True)


def _all_blocks_free(http: TestClient) -> bool:
    """Whether every block is back, once the engine has applied the aborts it was sent (before
    its next step: an aborted request's blocks are freed a moment after its stream ends)."""
    deadline = time.monotonic() + 30
    while True:
        (stats,) = http.get("/stats", headers=AUTH).json()["replicas"]
        free = stats["num_free_blocks"] == stats["num_kv_blocks"] and stats["num_requests"] == 0
        if free or time.monotonic() > deadline:
            return bool(free)
        time.sleep(0.05)


def test_completions_are_token_exact_with_offline(
    served: tuple[TestClient, OpenAIServer], sdk: openai.OpenAI, offline: LLM
) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    (expected,) = offline.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)
    whole = sdk.completions.create(
        model="x", prompt=PROMPT, max_tokens=8, temperature=0.0, extra_body={"ignore_eos": True}
    )
    assert whole.choices[0].text == expected.outputs[0].text
    assert whole.usage is not None and whole.usage.completion_tokens == 8
    assert whole.usage.prompt_tokens == len(PROMPT)
    chunks = sdk.completions.create(
        model="x",
        prompt=PROMPT,
        max_tokens=8,
        temperature=0.0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    assert (
        "".join(chunk.choices[0].text for chunk in chunks if chunk.choices) == whole.choices[0].text
    )
    assert _all_blocks_free(served[0])


def test_a_chat_streamed_says_what_it_says_whole(
    served: tuple[TestClient, OpenAIServer], sdk: openai.OpenAI
) -> None:
    messages: Any = [{"role": "user", "content": "Say something."}]
    whole = sdk.chat.completions.create(model="x", messages=messages, max_tokens=6, temperature=0)
    stream = sdk.chat.completions.create(
        model="x",
        messages=messages,
        max_tokens=6,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage is not None and whole.usage is not None
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert _all_blocks_free(served[0])


def test_a_stop_string_ends_the_request_and_frees_its_blocks(
    served: tuple[TestClient, OpenAIServer], sdk: openai.OpenAI
) -> None:
    free = sdk.completions.create(
        model="x", prompt=PROMPT, max_tokens=24, temperature=0.0, extra_body={"ignore_eos": True}
    )
    text = free.choices[0].text
    stop = next(text[i : i + 2] for i in range(4, len(text) - 2) if text[i : i + 2].strip())
    for stream in (False, True):
        answer = sdk.completions.create(
            model="x",
            prompt=PROMPT,
            max_tokens=24,
            temperature=0.0,
            stop=[stop],
            stream=stream,
            extra_body={"ignore_eos": True},
        )
        if stream:
            chunks = [c for c in answer if c.choices]  # type: ignore[union-attr]
            got = "".join(c.choices[0].text for c in chunks)
            finish = chunks[-1].choices[0].finish_reason
        else:
            got, finish = answer.choices[0].text, answer.choices[0].finish_reason  # type: ignore[union-attr]
        assert got == text[: text.index(stop)] and finish == "stop"
    assert _all_blocks_free(served[0])


def test_refusals_name_their_field_and_the_server_serves_on(
    served: tuple[TestClient, OpenAIServer], sdk: openai.OpenAI
) -> None:
    http, _ = served
    with pytest.raises(openai.BadRequestError) as too_long:
        sdk.completions.create(model="x", prompt=[3] * 2000, max_tokens=4)
    assert too_long.value.body["param"] in ("prompt", "max_tokens")  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as bad:
        sdk.completions.create(model="x", prompt="hi", max_tokens=4, temperature=-1)
    assert bad.value.body["param"] == "temperature"  # type: ignore[index]
    with pytest.raises(openai.NotFoundError):
        sdk.completions.create(model="nope", prompt="hi", max_tokens=4)
    assert http.post("/v1/completions", json={"prompt": "hi"}).status_code == 401  # no key
    assert http.get("/health").json() == {"status": "ok"}  # no key needed
    assert http.get("/metrics").status_code == 503  # Ray's metrics export serves them
    card = sdk.models.list().data[0]  # the base model, then its LoRA adapters
    assert card.id == sdk.models.retrieve(card.id).id == "x"
    assert sdk.completions.create(model="x", prompt="hi", max_tokens=2).choices[0].text is not None
    assert _all_blocks_free(http)


def test_a_stored_response_is_continued_retrieved_and_deleted(
    served: tuple[TestClient, OpenAIServer], sdk: openai.OpenAI
) -> None:
    first = sdk.responses.create(model="x", input="Hello", max_output_tokens=4, store=True)
    follow = sdk.responses.create(
        model="x", input="And then?", previous_response_id=first.id, max_output_tokens=4
    )
    assert follow.previous_response_id == first.id and follow.status in ("completed", "incomplete")
    assert follow.usage is not None and first.usage is not None
    assert follow.usage.input_tokens > first.usage.input_tokens  # the first turn came along
    assert sdk.responses.retrieve(first.id).id == first.id
    sdk.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        sdk.responses.retrieve(first.id)


def test_anthropic_messages_on_the_same_server(served: tuple[TestClient, OpenAIServer]) -> None:
    http, _ = served
    body = {"model": "x", "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]}
    answer = http.post("/v1/messages", json=body, headers={"x-api-key": KEY})
    assert answer.status_code == 200, answer.text
    assert answer.json()["type"] == "message" and answer.json()["usage"]["output_tokens"] <= 4
    refused = http.post("/v1/messages", json={**body, "max_tokens": -1}, headers={"x-api-key": KEY})
    assert refused.status_code == 400
    assert refused.json()["type"] == "error"  # Anthropic's shape


def test_force_include_usage_ends_every_stream_with_its_usage(
    served: tuple[TestClient, OpenAIServer], sdk: openai.OpenAI, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM's `--enable-force-include-usage`: a stream that asks no usage still ends with it."""
    messages: Any = [{"role": "user", "content": "Count."}]

    def streamed_usages() -> list[Any]:
        whole = {"max_tokens": 3, "stream": True, "extra_body": {"ignore_eos": True}}
        chat = sdk.chat.completions.create(model="x", messages=messages, **whole)
        text = sdk.completions.create(model="x", prompt=PROMPT, **whole)
        return [chunk.usage for chunk in [*chat, *text] if chunk.usage is not None]

    assert streamed_usages() == []
    server = served[1]
    forced = server.config.model_copy(update={"enable_force_include_usage": True})
    monkeypatch.setattr(server, "config", forced)
    usages = streamed_usages()
    assert [usage.completion_tokens for usage in usages] == [3, 3]
    assert usages[1].prompt_tokens == len(PROMPT)


def test_max_logprobs_caps_what_a_request_asks(
    served: tuple[TestClient, OpenAIServer], sdk: openai.OpenAI, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM's `--max-logprobs` (20 by default): more is a 400 naming the field the client sent;
    a server that allows more gives them."""
    messages: Any = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.BadRequestError) as chat:
        sdk.chat.completions.create(
            model="x", messages=messages, max_tokens=2, logprobs=True, top_logprobs=21
        )
    assert chat.value.body["param"] == "top_logprobs"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as text:
        sdk.completions.create(model="x", prompt="hi", max_tokens=2, logprobs=21)
    assert text.value.body["param"] == "logprobs"  # type: ignore[index]
    monkeypatch.setattr(served[1].validator, "max_logprobs", 30)
    wide = sdk.chat.completions.create(
        model="x", messages=messages, max_tokens=2, logprobs=True, top_logprobs=25
    )
    assert wide.choices[0].logprobs is not None and wide.choices[0].logprobs.content
    assert all(len(token.top_logprobs) == 25 for token in wide.choices[0].logprobs.content)


def test_a_client_request_id_names_the_answer_and_the_header_comes_back(
    served: tuple[TestClient, OpenAIServer], sdk: openai.OpenAI, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM's request ids: the X-Request-Id header, else the body's `request_id`, names a chat
    or completions answer; two requests in flight may send the same one (the engine's ids get
    a suffix); `--enable-request-id-headers` puts the header on every answer."""
    http = served[0]
    messages: Any = [{"role": "user", "content": "Count."}]
    short: Any = {"model": "x", "max_tokens": 3}
    chat = sdk.chat.completions.create(
        messages=messages, **short, extra_headers={"X-Request-Id": "trace-1"}
    )
    text = sdk.completions.create(prompt=PROMPT, **short, extra_body={"request_id": "job-7"})
    assert (chat.id, text.id) == ("chatcmpl-trace-1", "cmpl-job-7")
    # The body's, always the client's own, before a header (behind Serve, its proxy's).
    both = sdk.completions.create(
        prompt=PROMPT,
        **short,
        extra_body={"request_id": "mine"},
        extra_headers={"X-Request-Id": "p"},
    )
    assert both.id == "cmpl-mine"
    # The same id in four requests at once: each runs to its end.
    same: Any = {"extra_headers": {"X-Request-Id": "dup"}, "extra_body": {"ignore_eos": True}}
    with ThreadPoolExecutor(4) as pool:
        answers = list(
            pool.map(
                lambda _: sdk.chat.completions.create(messages=messages, **short, **same), range(4)
            )
        )
    assert [(a.id, a.choices[0].finish_reason) for a in answers] == [("chatcmpl-dup", "length")] * 4
    # Ids go into log lines: 256 visible ASCII characters at most, in the header or the body.
    for bad in ("x" * 257, "two words"):
        header = {"X-Request-Id": bad}
        refused = http.post(
            "/v1/chat/completions", json={"messages": messages}, headers=AUTH | header
        )
        assert refused.status_code == 400 and "X-Request-Id" in refused.json()["error"]["message"]
    forged = {"messages": messages, "request_id": "ok\nERROR forged line"}
    refused = http.post("/v1/chat/completions", json=forged, headers=AUTH)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "request_id"
    assert "X-Request-Id" not in http.get("/health").headers  # off by default
    server = served[1]
    on = server.config.model_copy(update={"enable_request_id_headers": True})
    monkeypatch.setattr(server, "config", on)
    echoed = http.get("/health", headers={"X-Request-Id": "probe-9"}).headers["X-Request-Id"]
    made = http.get("/v1/models", headers=AUTH).headers["X-Request-Id"]
    assert echoed == "probe-9" and len(made) == 32 and int(made, 16) >= 0


def test_return_token_ids_shows_the_prompt_and_each_choice_in_tokens(
    served: tuple[TestClient, OpenAIServer], sdk: openai.OpenAI
) -> None:
    """vLLM's `return_token_ids` (what RL and agent frameworks read): the prompt's token ids and
    each choice's, whole; streamed, the prompt's in the first chunk and each chunk's own, which
    join into the whole answer's. `return_tokens_as_token_ids` names logprobs' tokens by id.
    Without them, no answer carries the fields."""
    http = served[0]
    messages: Any = [{"role": "user", "content": "Count."}]
    asks: Any = {"model": "x", "max_tokens": 6, "temperature": 0.0}
    ids: Any = {"return_token_ids": True, "ignore_eos": True}
    chat: Any = sdk.chat.completions.create(messages=messages, **asks, extra_body=ids)
    text: Any = sdk.completions.create(prompt=[PROMPT, PROMPT], n=2, **asks, extra_body=ids)
    chunks: Any = list(
        sdk.chat.completions.create(messages=messages, **asks, stream=True, extra_body=ids)
    )
    text_chunks: Any = list(
        sdk.completions.create(prompt=PROMPT, **asks, stream=True, extra_body=ids)
    )
    named: Any = sdk.completions.create(
        prompt=PROMPT, **asks, logprobs=1, extra_body={**ids, "return_tokens_as_token_ids": True}
    )
    assert chat.prompt_token_ids and len(chat.choices[0].token_ids) == 6
    assert [choice.prompt_token_ids for choice in text.choices] == [PROMPT] * 4
    assert [len(choice.token_ids) for choice in text.choices] == [6] * 4
    assert chunks[0].prompt_token_ids == chat.prompt_token_ids
    assert all(getattr(chunk, "prompt_token_ids", None) is None for chunk in chunks[1:])
    streamed = [
        t for chunk in chunks for c in chunk.choices for t in getattr(c, "token_ids", None) or []
    ]
    assert streamed == chat.choices[0].token_ids
    assert text_chunks[0].choices[0].prompt_token_ids == PROMPT
    streamed = [
        t
        for chunk in text_chunks
        for c in chunk.choices
        for t in getattr(c, "token_ids", None) or []
    ]
    assert streamed == text.choices[0].token_ids
    tokens = named.choices[0].logprobs.tokens
    assert tokens == [f"token_id:{t}" for t in named.choices[0].token_ids]
    assert list(named.choices[0].logprobs.top_logprobs[0]) == [tokens[0]]
    plain = http.post("/v1/completions", json={"prompt": PROMPT, **asks}, headers=AUTH).json()
    assert "token_ids" not in plain["choices"][0] and "prompt_token_ids" not in plain["choices"][0]


def test_allowed_token_ids_bad_words_and_truncate_prompt_tokens(
    served: tuple[TestClient, OpenAIServer], sdk: openai.OpenAI
) -> None:
    """vLLM's `allowed_token_ids` (only those are sampled), `bad_words` (a word never comes
    out, at the text's start or mid-text) and `truncate_prompt_tokens` (the prompt cut to its
    last tokens, or its first with `truncation_side: "right"`; -1 to what max_model_len leaves
    room for), read back through `return_token_ids`."""
    asks: Any = {"model": "x", "temperature": 0.0}
    ids: Any = {"return_token_ids": True, "ignore_eos": True}

    def complete(prompt: Any = PROMPT, max_tokens: int = 12, **extra: Any) -> Any:
        body = {**ids, **extra}
        return sdk.completions.create(
            prompt=prompt, **asks, max_tokens=max_tokens, extra_body=body
        ).choices[0]

    free = complete()
    allowed = sorted({40, 41, 42} - set(free.token_ids))
    held = complete(allowed_token_ids=allowed)
    assert set(held.token_ids) <= set(allowed)
    word = served[1].tokenizer.decode(free.token_ids[:1]).strip()
    banned = complete(bad_words=[word])
    assert word not in banned.text.split() and banned.token_ids[0] != free.token_ids[0]
    for keep, side, kept in ((3, None, PROMPT[-3:]), (3, "right", PROMPT[:3]), (20, None, PROMPT)):
        cut = complete(truncate_prompt_tokens=keep, truncation_side=side)
        assert cut.prompt_token_ids == kept
        assert cut.token_ids == complete(kept).token_ids  # as if the client had sent them
    long_text = "the river " * 2000  # past max_model_len: refused unless cut
    with pytest.raises(openai.BadRequestError):
        complete(long_text)
    whole = complete(long_text, max_tokens=1, truncate_prompt_tokens=-1)
    assert len(whole.prompt_token_ids) == served[1].validator.max_model_len - 1
    for field, value in (("allowed_token_ids", [10**6]), ("truncate_prompt_tokens", 5000)):
        with pytest.raises(openai.BadRequestError) as refused:
            complete(**{field: value})
        assert refused.value.body["param"] == field  # type: ignore[index]


def test_ping_and_version_answer_without_the_key(served: tuple[TestClient, OpenAIServer]) -> None:
    """vLLM's `/ping` (SageMaker's health check, GET or POST) and `/version`, open as /health."""
    http = served[0]
    assert http.get("/ping").json() == http.post("/ping").json() == http.get("/health").json()
    version = http.get("/version").json()["version"]
    assert version and version[0].isdigit()
    # Open paths read no body: one past a few KB is refused before it is held.
    assert http.post("/ping", content=b"x" * 10_000).status_code == 413
    assert http.post("/ping", content=b"{}").status_code == 200


def test_prompt_logprobs_in_vllm_s_shape(
    served: tuple[TestClient, OpenAIServer], sdk: openai.OpenAI
) -> None:
    """vLLM's `prompt_logprobs`: per prompt token (None for the first), its logprob and rank and
    the top ones', keyed by token id, on chat and completions answers; the same numbers as an
    echo with logprobs (lm-eval's request); refused with a stream."""
    asks: Any = {"model": "x", "max_tokens": 1}
    text: Any = sdk.completions.create(prompt=PROMPT, **asks, extra_body={"prompt_logprobs": 2})
    echoed: Any = sdk.completions.create(prompt=PROMPT, **asks, echo=True, logprobs=2)
    chat: Any = sdk.chat.completions.create(
        messages=[{"role": "user", "content": "hi"}], **asks, extra_body={"prompt_logprobs": 0}
    )
    entries = text.choices[0].prompt_logprobs
    assert len(entries) == len(PROMPT) and entries[0] is None
    for token_id, entry, echo_logprob in zip(
        PROMPT[1:], entries[1:], echoed.choices[0].logprobs.token_logprobs[1:]
    ):
        own = entry[str(token_id)]
        assert own["logprob"] == pytest.approx(echo_logprob) and own["rank"] >= 1
        assert own["decoded_token"] == served[1].tokenizer.decode([token_id])
        # The top ones ranked 1..k by logprob (the prompt token among them at its own rank).
        by_logprob = sorted(entry.values(), key=lambda e: -e["logprob"])[:2]
        assert [e["rank"] for e in by_logprob] == [1, 2]
        assert len(entry) in (2, 3)  # its own and the top 2 (itself among them, or not)
    chat_entries = chat.prompt_logprobs
    assert chat_entries[0] is None and all(len(entry) == 1 for entry in chat_entries[1:])
    with pytest.raises(openai.BadRequestError) as refused:
        sdk.completions.create(
            prompt=PROMPT, **asks, stream=True, extra_body={"prompt_logprobs": 1}
        )
    assert refused.value.body["param"] == "prompt_logprobs"  # type: ignore[index]


def test_chat_echo_puts_the_continued_message_before_the_answer(sdk: openai.OpenAI) -> None:
    """vLLM's chat `echo`: a last assistant message (continued) starts each answer's content,
    whole and streamed; after a user message there is nothing to echo."""
    prefill: Any = [
        {"role": "user", "content": "Tell a story."},
        {"role": "assistant", "content": "Once upon"},
    ]
    body: Any = {"continue_final_message": True, "add_generation_prompt": False}
    asks: Any = {"model": "x", "max_tokens": 5, "temperature": 0.0, "n": 2}
    plain = sdk.chat.completions.create(messages=prefill, **asks, extra_body=body)
    echoed = sdk.chat.completions.create(
        messages=prefill, **asks, extra_body={**body, "echo": True}
    )
    streamed = ["", ""]
    for chunk in sdk.chat.completions.create(
        messages=prefill, **asks, stream=True, extra_body={**body, "echo": True}
    ):
        for choice in chunk.choices:
            streamed[choice.index] += choice.delta.content or ""
    assert [c.message.content for c in echoed.choices] == [
        "Once upon" + (c.message.content or "") for c in plain.choices
    ]
    assert streamed == [c.message.content for c in echoed.choices]
    user_only = sdk.chat.completions.create(messages=prefill[:1], **asks, extra_body={"echo": True})
    alone = sdk.chat.completions.create(messages=prefill[:1], **asks)
    assert [c.message.content for c in user_only.choices] == [
        c.message.content for c in alone.choices
    ]
    # Without a generation prompt the answer's role is the last message's own: it is echoed.
    no_prompt: Any = {"echo": True, "add_generation_prompt": False}
    raw = sdk.chat.completions.create(messages=prefill[:1], **asks, extra_body=no_prompt)
    assert all((c.message.content or "").startswith("Tell a story.") for c in raw.choices)


def test_a_completion_s_add_special_tokens(tiny_llama: str, tmp_path: Any) -> None:
    """vLLM's `add_special_tokens` on completions: a text prompt gets the tokenizer's BOS (as
    Llama's tokenizers add it) unless the request says false; token prompts are as sent."""
    model = tmp_path / "bos-llama"
    shutil.copytree(tiny_llama, model)
    tokenizer_file = model / "tokenizer.json"
    state = json.loads(tokenizer_file.read_text())
    state["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [
            {"SpecialToken": {"id": "<s>", "type_id": 0}},
            {"Sequence": {"id": "A", "type_id": 0}},
        ],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}},
    }
    tokenizer_file.write_text(json.dumps(state))
    config = EngineConfig(model=str(model), num_kv_blocks=32, served_model_name=["x"])
    with TestClient(local_openai_app(config)) as http:
        sdk = openai.OpenAI(base_url="http://testserver/v1", api_key="-", http_client=http)

        def prompt_ids(**extra: Any) -> list[int]:
            body = {"return_token_ids": True, **extra}
            answer: Any = sdk.completions.create(
                model="x", prompt="hello there", max_tokens=1, extra_body=body
            )
            return answer.choices[0].prompt_token_ids

        with_bos, without = prompt_ids(), prompt_ids(add_special_tokens=False)
    assert with_bos == [1, *without] and 1 not in without


def test_a_lora_adapter_is_a_model_clients_name(
    served: tuple[TestClient, OpenAIServer], sdk: openai.OpenAI, offline: LLM, tiny_lora: str
) -> None:
    """`--lora-modules` adapters are listed as models of their base, answer as themselves,
    token-exact with the offline `LoRARequest`, streamed as whole, beside the base model."""
    cards = {card.id: card for card in sdk.models.list().data}
    assert set(cards) >= {"x", "x-lora", "a"}  # "a": a folder of the resolver's
    assert cards["x-lora"].model_dump()["parent"] == "x"
    assert cards["x-lora"].model_dump()["root"] == tiny_lora
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    requests = [{"prompt_token_ids": PROMPT}] * 2
    base, adapted = offline.generate(
        requests, params, use_tqdm=False, lora_request=[None, LoRARequest("l", 1, tiny_lora)]
    )
    assert base.outputs[0].token_ids != adapted.outputs[0].token_ids
    extra = {"ignore_eos": True, "return_token_ids": True}
    with ThreadPoolExecutor(2) as pool:  # in one batch where they overlap
        answers = list(
            pool.map(
                lambda model: sdk.completions.create(
                    model=model, prompt=PROMPT, max_tokens=8, temperature=0.0, extra_body=extra
                ),
                ["x", "x-lora"],
            )
        )
    assert [a.model for a in answers] == ["x", "x-lora"]
    got = [a.choices[0].model_dump()["token_ids"] for a in answers]
    assert got == [base.outputs[0].token_ids, adapted.outputs[0].token_ids]
    messages: Any = [{"role": "user", "content": "Say something."}]
    chat = {"messages": messages, "max_tokens": 6, "temperature": 0}
    whole = sdk.chat.completions.create(model="x-lora", **chat)
    chunks = list(sdk.chat.completions.create(model="x-lora", stream=True, **chat))
    assert whole.model == "x-lora" and all(chunk.model == "x-lora" for chunk in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert text != sdk.chat.completions.create(model="x", **chat).choices[0].message.content
    with pytest.raises(openai.NotFoundError, match="'x-other' does not exist"):
        sdk.chat.completions.create(model="x-other", **chat)
    # A folder of --lora-resolver-dir is an adapter a request may name, loaded when first
    # named (vLLM's filesystem resolver); no name reaches outside the folder.
    resolved = sdk.chat.completions.create(model="a", **chat)
    assert resolved.model == "a" and resolved.choices[0].message.content == text
    resolved_dir = Path(served[1].config.lora_resolver_dir or "")
    outside = str(resolved_dir.parent / "outside")
    for leaving in ("../outside", "a/../../outside", outside, "./a"):
        with pytest.raises(openai.NotFoundError):
            sdk.chat.completions.create(model=leaving, **chat)
    broken = resolved_dir / "broken"  # a config without its weights
    broken.mkdir(exist_ok=True)
    shutil.copy(Path(tiny_lora) / "adapter_config.json", broken)
    with pytest.raises(openai.BadRequestError, match="'broken' is no LoRA adapter this model can"):
        sdk.chat.completions.create(model="broken", **chat)
    assert _all_blocks_free(served[0])


def test_lora_adapters_loaded_and_unloaded_at_run_time(
    served: tuple[TestClient, OpenAIServer], offline: LLM, tiny_llama: str, tmp_path: Any
) -> None:
    """vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter: an adapter loaded serves as a
    model (linked into the resolver's folder, which every engine reads), `load_inplace` points
    the name at new weights for the requests after, unloaded it is gone; a name already taken
    or an adapter that does not fit is refused, and so is unloading one the server started
    with."""
    http = served[0]
    first = make_lora_adapter(tiny_llama, tmp_path / "first", seed=21)
    second = make_lora_adapter(tiny_llama, tmp_path / "second", seed=22)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    want = [
        offline.generate(
            [{"prompt_token_ids": PROMPT}],
            params,
            use_tqdm=False,
            lora_request=LoRARequest(n, i, str(p)),
        )[0]
        .outputs[0]
        .token_ids
        for i, (n, p) in enumerate([("first", first), ("second", second)])
    ]

    def load(name: str, path: Any, **extra: Any) -> Any:
        body = {"lora_name": name, "lora_path": str(path), **extra}
        return http.post("/v1/load_lora_adapter", json=body, headers=AUTH)

    def tokens(model: str) -> Any:
        body = {"model": model, "prompt": PROMPT, "max_tokens": 6, "temperature": 0}
        answer = http.post(
            "/v1/completions",
            json={**body, "ignore_eos": True, "return_token_ids": True},
            headers=AUTH,
        )
        return (
            answer.json()["choices"][0]["token_ids"]
            if answer.status_code == 200
            else answer.status_code
        )

    answer = load("rl", first)
    assert answer.status_code == 200, answer.text
    assert answer.text == "Success: LoRA adapter 'rl' added successfully."
    assert want[0] != want[1] and tokens("rl") == want[0]
    listed = {card["id"]: card for card in http.get("/v1/models", headers=AUTH).json()["data"]}
    assert listed["rl"]["root"] == str(first.resolve()) and listed["rl"]["parent"] == "x"
    taken = load("rl", second).json()["error"]
    assert taken["message"].endswith("The lora adapter 'rl' has already been loaded.")
    assert taken["param"] == "lora_name"
    for taken in ("x", "x-lora", "a"):  # served, --lora-modules, a folder of the resolver's
        assert load(taken, second).status_code == 400
    assert load("../escape", second).status_code == 400
    refused = load("bad", tmp_path).json()["error"]
    assert (
        refused["message"].startswith("lora_path: ") and "adapter_config.json" in refused["message"]
    )
    assert load("rl", second, load_inplace=True).status_code == 200
    assert tokens("rl") == want[1]
    # An RL trainer's loop: new weights written into the same folder, loaded in place.
    make_lora_adapter(tiny_llama, second, seed=21)  # the first adapter's weights, anew
    assert load("rl", second, load_inplace=True).status_code == 200
    assert tokens("rl") == want[0]
    unload = {"lora_name": "rl"}
    answer = http.post("/v1/unload_lora_adapter", json=unload, headers=AUTH)
    assert answer.text == "Success: LoRA adapter 'rl' removed successfully."
    assert tokens("rl") == 404
    assert "rl" not in {card["id"] for card in http.get("/v1/models", headers=AUTH).json()["data"]}
    gone = http.post("/v1/unload_lora_adapter", json=unload, headers=AUTH)
    assert (
        gone.status_code == 404
        and gone.json()["error"]["message"] == "The lora adapter 'rl' cannot be found."
    )
    for kept in ("a", "x-lora"):  # a folder of the resolver's own, a --lora-modules adapter
        stays = http.post("/v1/unload_lora_adapter", json={"lora_name": kept}, headers=AUTH)
        assert stays.status_code == 400 and "was not loaded at run time" in stays.text
        assert isinstance(tokens(kept), list)
    assert _all_blocks_free(http)
