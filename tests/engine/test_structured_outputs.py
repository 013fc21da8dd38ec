"""Structured outputs through the offline `LLM` on a random-weight checkpoint, whose free text is
gibberish: every constrained output must still parse and validate, greedy and sampled, n > 1,
across preemption and prefix caching, mixed in batches with unconstrained requests."""

from __future__ import annotations

import json
import re
import threading
from typing import Any

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedray import LLM, SamplingParams
from pagedray.scheduler.structured_outputs import StructuredOutputsParams

PROMPTS = ["Give me a JSON object.", "Hello", {"prompt_token_ids": list(range(5, 45))}]

SCHEMAS: dict[str, dict[str, Any]] = {
    "nested": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer", "minimum": 1, "maximum": 9999},
                    "admin": {"type": "boolean"},
                },
                "required": ["id", "admin"],
                "additionalProperties": False,
            },
            "note": {"type": ["string", "null"], "maxLength": 8},
        },
        "required": ["user", "note"],
        "additionalProperties": False,
    },
    "arrays_enums": {
        "type": "object",
        "properties": {
            "colors": {
                "type": "array",
                "items": {"enum": ["red", "green", "blue"]},
                "minItems": 2,
                "maxItems": 4,
            },
            "size": {"type": "string", "enum": ["S", "M", "L"]},
        },
        "required": ["colors", "size"],
        "additionalProperties": False,
    },
    "bounded_numbers_patterns": {
        "type": "object",
        "properties": {
            "score": {"type": "integer", "minimum": -5, "maximum": 5},
            "ratio": {"type": "number", "minimum": 0, "maximum": 1},
            "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
        },
        "required": ["score", "ratio", "code"],
        "additionalProperties": False,
    },
    "array_of_objects": {
        "type": "array",
        "items": {
            "type": "object",
            "properties": {"k": {"type": "string", "maxLength": 4}, "v": {"type": "boolean"}},
            "required": ["k", "v"],
            "additionalProperties": False,
        },
        "minItems": 1,
        "maxItems": 3,
    },
}


@pytest.fixture(scope="module")
def llm(tiny_llama: str) -> LLM:
    return LLM(tiny_llama, dtype="float32", num_kv_blocks=256)


def _texts(llm: LLM, params: SamplingParams, prompts: list[Any] = PROMPTS) -> list[str]:
    outputs = llm.generate(prompts, params, use_tqdm=False)
    choices = [choice for output in outputs for choice in output.outputs]
    assert all(choice.finish_reason == "stop" for choice in choices), choices
    return [choice.text for choice in choices]


@pytest.mark.parametrize("name", sorted(SCHEMAS))
@pytest.mark.parametrize(
    "sampling",
    [
        {"temperature": 0.0},
        {"temperature": 1.0, "seed": 7},
        {"temperature": 0.9, "top_p": 0.9, "n": 3, "seed": 3},
    ],
    ids=["greedy", "sampled", "n3"],
)
def test_json_schema_output_validates(llm: LLM, name: str, sampling: dict[str, Any]) -> None:
    schema = SCHEMAS[name]
    params = SamplingParams(
        max_tokens=300, structured_outputs=StructuredOutputsParams(json=schema), **sampling
    )
    texts = _texts(llm, params)
    assert len(texts) == len(PROMPTS) * params.n
    for text in texts:
        jsonschema.validate(json.loads(text), schema)


def test_keys_follow_the_schema_order(llm: LLM) -> None:
    schema = SCHEMAS["bounded_numbers_patterns"]
    params = SamplingParams(temperature=0.0, max_tokens=300, structured_outputs={"json": schema})
    for text in _texts(llm, params):
        assert list(json.loads(text)) == ["score", "ratio", "code"]


def test_json_object_regex_choice_and_grammar(llm: LLM) -> None:
    sampled = {"temperature": 1.0, "seed": 11, "max_tokens": 120}
    for text in _texts(llm, SamplingParams(structured_outputs={"json_object": True}, **sampled)):
        assert isinstance(json.loads(text), dict)
    regex = r"[0-9]{3}-[a-z]{2,4}"
    for text in _texts(llm, SamplingParams(structured_outputs={"regex": regex}, **sampled)):
        assert re.fullmatch(regex, text), text
    choices = ["yes", "no", "maybe so"]
    for text in _texts(llm, SamplingParams(structured_outputs={"choice": choices}, **sampled)):
        assert text in choices
    lark = 'start: "(" NUM ("," NUM)* ")"\nNUM: /[0-9]{1,3}/'
    for text in _texts(llm, SamplingParams(structured_outputs={"grammar": lark}, **sampled)):
        assert re.fullmatch(r"\([0-9]{1,3}(,[0-9]{1,3})*\)", text), text
    gbnf = 'root ::= "ab" digit digit\ndigit ::= [0-9]'
    for text in _texts(llm, SamplingParams(structured_outputs={"grammar": gbnf}, **sampled)):
        assert re.fullmatch(r"ab[0-9]{2}", text), text


def test_constrained_and_free_requests_share_batches(llm: LLM) -> None:
    free = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    alone = _free_tokens(llm, free)
    schema = SCHEMAS["nested"]
    constrained = SamplingParams(
        temperature=0.0, max_tokens=300, structured_outputs={"json": schema}
    )
    mixed = llm.generate(PROMPTS + PROMPTS, [constrained] * 3 + [free] * 3, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mixed[3:]] == alone
    for output in mixed[:3]:
        jsonschema.validate(json.loads(output.outputs[0].text), schema)


def _free_tokens(llm: LLM, params: SamplingParams) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def test_preemption_and_prefix_caching_do_not_change_outputs(tiny_llama: str) -> None:
    """A pool too small for the batch preempts and recomputes; the matchers follow the kept
    output tokens, so seeded constrained outputs equal a roomy, uncached run's."""
    schema = SCHEMAS["array_of_objects"]
    params = SamplingParams(
        temperature=1.0, seed=5, n=2, max_tokens=200, structured_outputs={"json": schema}
    )
    prompts = [{"prompt_token_ids": list(range(3 + i, 40 + i))} for i in range(8)]
    roomy = LLM(tiny_llama, dtype="float32", num_kv_blocks=512, enable_prefix_caching=False)
    expected = [[c.token_ids for c in o.outputs] for o in roomy.generate(prompts, params)]
    tight = LLM(tiny_llama, dtype="float32", num_kv_blocks=24, block_size=16)
    got = [[c.token_ids for c in o.outputs] for o in tight.generate(prompts, params)]
    again = [[c.token_ids for c in o.outputs] for o in tight.generate(prompts, params)]
    assert tight.stats()["num_preemptions"] > 0
    assert tight.stats()["prefix_cache_hits"] > 0
    assert got == expected and again == expected


@pytest.mark.parametrize(
    ("constraint", "message"),
    [
        ({"json": {"type": "strin"}}, "structured_outputs.json: Invalid type"),
        ({"json": "{not json"}, "structured_outputs.json: not valid JSON"),
        ({"regex": "a(b"}, "structured_outputs.regex:"),
        ({"grammar": "start: undefined_rule"}, "structured_outputs.grammar:"),
        ({"choice": []}, "structured_outputs.choice:"),
        ({"regex": "a", "choice": ["a"]}, "give exactly one of"),
        ({"schema": {}}, "structured_outputs: fields must be among"),
    ],
)
def test_bad_constraint_is_refused_before_queueing(
    llm: LLM, constraint: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        llm.generate(["Hi"], SamplingParams(structured_outputs=constraint), use_tqdm=False)
    assert llm.stats()["num_running"] == 0 and llm.stats()["num_waiting"] == 0


_LEAF = st.sampled_from(
    [
        {"type": "boolean"},
        {"type": "null"},
        {"type": "integer", "minimum": -20, "maximum": 20},
        {"type": "string", "maxLength": 5},
        {"enum": ["a", "bb", 3, None]},
        {"type": "string", "pattern": "^[a-c]{1,3}$"},
    ]
)
_SCHEMA = st.recursive(
    _LEAF,
    lambda inner: st.one_of(
        st.builds(
            lambda items, lo, extra: {
                "type": "array",
                "items": items,
                "minItems": lo,
                "maxItems": lo + extra,
            },
            inner,
            st.integers(0, 2),
            st.integers(0, 2),
        ),
        st.dictionaries(st.sampled_from(["a", "b", "c", "d"]), inner, min_size=1, max_size=3).map(
            lambda props: {
                "type": "object",
                "properties": props,
                "required": sorted(props),
                "additionalProperties": False,
            }
        ),
    ),
    max_leaves=6,
)


@settings(
    max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(schema=_SCHEMA, seed=st.integers(0, 2**16))
def test_random_schemas_always_validate(llm: LLM, schema: dict[str, Any], seed: int) -> None:
    params = SamplingParams(
        temperature=1.0, seed=seed, max_tokens=400, structured_outputs={"json": schema}
    )
    for text in _texts(llm, params, PROMPTS[:1]):
        jsonschema.validate(json.loads(text), schema)


def test_a_schema_is_compiled_once(llm: LLM) -> None:
    schema = {
        "type": "object",
        "properties": {"once": {"type": "boolean"}},
        "required": ["once"],
        "additionalProperties": False,
    }
    structured = llm.engine.scheduler.structured
    assert structured is not None
    before = structured.stats.num_compiled
    params = SamplingParams(temperature=0.0, max_tokens=50, structured_outputs={"json": schema})
    for _ in range(3):
        _texts(llm, params)
    assert structured.stats.num_compiled == before + 1


def test_a_compiling_grammar_does_not_hold_up_the_queue(llm: LLM, monkeypatch) -> None:
    """Compiles run on their own thread: a request waits for its grammar while requests behind
    it are admitted and run."""
    structured = llm.engine.scheduler.structured
    assert structured is not None
    release = threading.Event()
    compile_grammar = structured._matcher

    def slow_compile(key: tuple[str, str]) -> Any:
        release.wait(timeout=30)
        return compile_grammar(key)

    monkeypatch.setattr(structured, "_matcher", slow_compile)
    timer = threading.Timer(1.0, release.set)
    timer.start()
    constrained = SamplingParams(temperature=0.0, max_tokens=60, structured_outputs={"regex": "z+"})
    free = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    slow, fast = llm.generate(["Hi", "Hello"], [constrained, free], use_tqdm=False)
    timer.join()
    assert re.fullmatch("z+", slow.outputs[0].text)
    assert fast.metrics["finish_time"] < slow.metrics["first_token_time"]


def test_a_grammar_that_fails_to_compile_fails_its_request_alone(llm: LLM, monkeypatch) -> None:
    structured = llm.engine.scheduler.structured
    assert structured is not None

    def failing_compile(key: tuple[str, str]) -> Any:
        raise ValueError("structured_outputs.regex: too complex for this tokenizer")

    monkeypatch.setattr(structured, "_matcher", failing_compile)
    constrained = SamplingParams(max_tokens=8, structured_outputs={"regex": "[a-z]+q"})
    free = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    failed, ok = llm.generate(["Hi", "Hello"], [constrained, free], use_tqdm=False)
    assert failed.outputs[0].finish_reason == "error"
    assert failed.error is not None and "too complex for this tokenizer" in failed.error
    assert ok.outputs[0].finish_reason == "length" and len(ok.outputs[0].token_ids) == 4
    assert llm.stats()["num_free_blocks"] == llm.stats()["num_kv_blocks"]  # nothing leaked


@pytest.mark.parametrize(
    "extra", [{"ignore_eos": True}, {"min_tokens": 50}], ids=["ignore_eos", "min_tokens"]
)
def test_a_complete_output_ends_whatever_eos_settings(llm: LLM, extra: dict[str, Any]) -> None:
    """Nothing but EOS fits a complete output: it ends there, not with an error."""
    params = SamplingParams(
        temperature=1.0,
        seed=2,
        max_tokens=100,
        structured_outputs={"choice": ["yes", "no"]},
        **extra,
    )
    assert all(text in ("yes", "no") for text in _texts(llm, params))


def test_a_rejected_token_ends_every_choice_and_nothing_else(llm: LLM, monkeypatch) -> None:
    """A token the grammar refuses (only a bug could sample one) ends its whole request, every
    choice of it, with an error; the engine and other requests go on, no block is kept."""
    from pagedray.scheduler.grammar import RequestGrammar

    accept = RequestGrammar.accept
    calls = {"n": 0}

    def flaky_accept(self: RequestGrammar, token_ids: list[int]) -> bool:
        calls["n"] += 1
        return accept(self, token_ids) and calls["n"] != 5

    monkeypatch.setattr(RequestGrammar, "accept", flaky_accept)
    constrained = SamplingParams(
        temperature=1.0, seed=1, n=3, max_tokens=40, structured_outputs={"regex": "[a-z]{30}"}
    )
    free = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    failed, ok = llm.generate(["Hi", "Hello"], [constrained, free], use_tqdm=False)
    assert failed.error is not None and "internal error" in failed.error
    assert all(choice.finish_reason == "error" for choice in failed.outputs)
    assert len(ok.outputs[0].token_ids) == 6
    stats = llm.stats()
    assert stats["num_running"] == stats["num_waiting"] == 0
    assert stats["num_free_blocks"] == stats["num_kv_blocks"]


def test_prepare_indexes_the_vocabulary_once_before_any_request(tiny_llama: str) -> None:
    """A server prepares before it serves: the first structured request reads no tokenizer."""
    llm = LLM(tiny_llama, max_model_len=256, num_kv_blocks=64)
    structured = llm.engine.scheduler.structured
    assert structured is not None
    reads: list[int] = []
    read = structured._tokenizer_json

    def counted() -> str:
        reads.append(1)
        return read()

    structured._tokenizer_json = counted
    structured.prepare()
    structured.prepare()
    assert len(reads) == 1
    params = SamplingParams(temperature=0.0, max_tokens=20, structured_outputs={"regex": "[ab]+"})
    (out,) = llm.generate(["Hi"], params, use_tqdm=False)
    assert re.fullmatch("[ab]+", out.outputs[0].text) and len(reads) == 1


def test_a_tokenizer_prepare_cannot_index_leaves_structured_requests_refused(
    tiny_llama: str, caplog: pytest.LogCaptureFixture
) -> None:
    """prepare() logs the reason and returns (the server still starts); each structured request
    is then refused with it, without reading the tokenizer again, and free requests run."""
    from pagedray.scheduler.request_failure import refusal

    llm = LLM(tiny_llama, max_model_len=256, num_kv_blocks=64)
    structured = llm.engine.scheduler.structured
    assert structured is not None

    reads: list[int] = []

    def no_backend() -> str:
        reads.append(1)
        raise refusal("structured_outputs", "the tokenizer has no `tokenizers` backend")

    structured._tokenizer_json = no_backend
    with caplog.at_level("WARNING"):
        structured.prepare()
    assert "structured outputs unavailable" in caplog.text
    constrained = SamplingParams(max_tokens=8, structured_outputs={"regex": "[a-z]+"})
    free = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    failed, ok = llm.generate(["Hi", "Hello"], [constrained, free], use_tqdm=False)
    assert failed.error is not None and "no `tokenizers` backend" in failed.error
    assert ok.outputs[0].finish_reason == "length" and len(ok.outputs[0].token_ids) == 4
    # The failure was kept: neither request read the tokenizer again.
    (again,) = llm.generate(["Hey"], constrained, use_tqdm=False)
    assert again.error is not None and "no `tokenizers` backend" in again.error
    assert len(reads) == 1


def test_a_reasoning_model_thinks_freely_then_holds_to_its_grammar(thinking_llama: str) -> None:
    """With `reasoning_parser`, as vLLM's `LLM`: a constrained output is free up to `</think>`
    (one token of this vocabulary) and validates after it, per choice; a prompt that closed
    its thinking holds to the grammar from the first token. (A bias makes the random model
    close its thinking after a few tokens.)"""
    llm = LLM(thinking_llama, dtype="float32", num_kv_blocks=64, reasoning_parser="deepseek_r1")
    end = llm.tokenizer.convert_tokens_to_ids("</think>")
    schema = SCHEMAS["nested"]
    params = SamplingParams(
        temperature=1.0,
        seed=0,
        n=2,
        max_tokens=120,
        logit_bias={end: 12},
        structured_outputs={"json": schema},
    )
    prompt = llm.tokenizer.encode("Think, then answer.")
    thought = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    closed = llm.generate([{"prompt_token_ids": [*prompt, end]}], params, use_tqdm=False)[0]
    llm.shutdown()
    for choice in thought.outputs:
        assert choice.finish_reason == "stop" and end in choice.token_ids
        thinking, answer = choice.token_ids[: choice.token_ids.index(end)], choice.text
        assert thinking, "the bias closes the thinking, not at once"
        jsonschema.validate(json.loads(answer[answer.index("</think>") + 8 :]), schema)
    for choice in closed.outputs:
        jsonschema.validate(json.loads(choice.text), schema)
