"""A request resumed from its output so far (`output_token_ids`: what reached the client before
its engine was lost) continues with exactly the tokens it would have produced uninterrupted:
greedy, seeded sampling under penalties and `min_tokens`, and structured outputs, whose grammar
replays the resumed output first (a reasoning model's too, whose grammar holds after its
thinking). A real tiny engine, in-process."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from pagedray.engine.async_engine import AsyncEngine
from pagedray.engine.config import EngineConfig
from pagedray.engine.engine_factory import build_engine
from pagedray.engine.output_processor import OutputProcessor
from pagedray.scheduler.request_failure import RequestRefused
from pagedray.scheduler.sampling_params import SamplingParams
from pagedray.scheduler.structured_outputs import StructuredOutputsParams

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
THINK_END = 511  # the tiny vocabulary's last reserved id
CASES = {
    "greedy": SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
    "seeded with penalties": SamplingParams(
        temperature=0.9,
        top_p=0.95,
        seed=11,
        max_tokens=24,
        min_tokens=20,
        presence_penalty=0.5,
        frequency_penalty=0.3,
        repetition_penalty=1.2,
    ),
    "structured": SamplingParams(
        temperature=0.8,
        seed=5,
        max_tokens=40,
        structured_outputs=StructuredOutputsParams(json=SCHEMA),
    ),
    # A reasoning model's: free until the token that ends its thinking (here a reserved id,
    # biased to come after a few tokens), then held to the grammar.
    "thinking, then structured": SamplingParams(
        temperature=0.8,
        seed=5,
        max_tokens=60,
        logit_bias={THINK_END: 12},
        structured_outputs=StructuredOutputsParams(json=SCHEMA),
    ),
    # And one whose thinking budget forces the end of its thinking after 3 tokens.
    "thinking budget": SamplingParams(
        temperature=0.8, seed=9, max_tokens=24, ignore_eos=True, thinking_token_budget=3
    ),
}


def _engine(model: str) -> tuple[AsyncEngine, Any]:
    # No prefix caching: a resumed request computes its whole context again, as on an engine
    # that never saw it.
    config = EngineConfig(model=model, num_kv_blocks=64, num_threads=1, enable_prefix_caching=False)
    engine, _executor, tokenizer, _validator = build_engine(config)
    return AsyncEngine(engine, OutputProcessor(tokenizer), stuck_after_s=5.0), tokenizer


async def _tokens(
    engine: AsyncEngine,
    request_id: str,
    prompt: list[int],
    params: SamplingParams,
    output: list[int] | None = None,
) -> list[int]:
    gate = THINK_END if params.logit_bias or params.thinking_token_budget else None
    stream = engine.add_request(
        request_id, prompt, params, output_token_ids=output, thinking_end_token_id=gate
    )
    return [t async for out in stream for d in out.deltas for t in d.token_ids]


@pytest.mark.parametrize("case", list(CASES))
def test_a_resumed_request_continues_token_exact(tiny_llama: str, case: str) -> None:
    params = CASES[case]

    async def run() -> None:
        engine, tokenizer = _engine(tiny_llama)
        prompt = tokenizer.encode("a request that moves between engines")
        whole = await _tokens(engine, "whole", prompt, params)
        assert len(whole) > 8
        # NOTE: not after the last token but one: a grammar's last token and the EOS that ends
        # its output leave in one output, so no client holds one without the other.
        # Across the end of a thinking too: the resumed output's replay opens the grammar.
        thinks = params.logit_bias or params.thinking_token_budget
        gate = [whole.index(THINK_END), whole.index(THINK_END) + 1] if thinks else []
        if params.thinking_token_budget:
            assert whole.index(THINK_END) == params.thinking_token_budget  # forced there
        assert all(1 < cut < len(whole) - 2 for cut in gate)
        for cut in (1, 7, len(whole) - 2, *gate):
            resumed = await _tokens(engine, f"resumed-{cut}", prompt, params, whole[:cut])
            assert resumed == whole[cut:], cut
        await engine.shutdown()

    asyncio.run(run())


@pytest.mark.usefixtures("exact_attention")
def test_a_sampled_stream_resumed_at_any_token_goes_on_with_the_same_tokens(
    tiny_llama: str,
) -> None:
    """Temperature 1 and a seed, as most sampled streams that move are: the resumed context is
    computed as one prefill where the first engine computed it a decode step at a time, and the
    logits must be the same bits for every draw to land on the same token (the CPU backend's
    exact rows, the default; with `PAGEDRAY_EXACT_ATTENTION=0` about one stream in 17-30 departs
    on the default model)."""
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=40, ignore_eos=True)

    async def run() -> None:
        engine, tokenizer = _engine(tiny_llama)
        for number in range(3):
            prompt = tokenizer.encode(f"stream number {number} moves " * (number + 1))
            whole = await _tokens(engine, f"whole-{number}", prompt, params)
            for cut in range(1, len(whole) - 1, 3):
                resumed = await _tokens(engine, f"r-{number}-{cut}", prompt, params, whole[:cut])
                assert resumed == whole[cut:], (number, cut)
        await engine.shutdown()

    asyncio.run(run())


def test_only_a_request_of_one_choice_resumes(tiny_llama: str) -> None:
    async def run() -> None:
        engine, tokenizer = _engine(tiny_llama)
        params = SamplingParams(n=2, max_tokens=8, seed=3)
        with pytest.raises(RequestRefused, match="one choice"):
            await _tokens(engine, "two", tokenizer.encode("hello"), params, [5, 6])
        await engine.shutdown()

    asyncio.run(run())
