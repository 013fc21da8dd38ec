"""Structured outputs: what a JSON schema costs in output tokens/s, and how long grammars take
to compile, on the default model (offline `LLM`, one process).

The same prompts run twice per round: constrained to a JSON schema (greedy, each request stops
when its JSON is complete), then free with exactly the token counts the constrained run produced
(EOS ignored), so both runs compute the same tokens in the same batches and differ only by the
grammar work: matchers advanced per token, bitmasks filled per step and applied to the logits.
Rounds alternate the two after an untimed one; prefix caching is off, so no run reuses another's
prompts; medians are reported.

    .venv/bin/python benchmarks/structured_outputs.py            # 64 requests, 3 rounds
    .venv/bin/python benchmarks/structured_outputs.py --quick    # 16 requests, 1 round
"""

from __future__ import annotations

import argparse
import statistics
import time
import uuid
from typing import Any

from offline_throughput import benchmark_workload

from pagedray import LLM, SamplingParams
from pagedray.scheduler.structured_outputs import StructuredOutputsParams

# Bounded fields, so that a random-weight model's output ends (its free text never would).
RECORD = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 99999},
        "name": {"type": "string", "maxLength": 16},
        "tags": {
            "type": "array",
            "items": {"enum": ["red", "green", "blue", "cyan"]},
            "minItems": 1,
            "maxItems": 6,
        },
        "scores": {
            "type": "array",
            "items": {"type": "integer", "minimum": -100, "maximum": 100},
            "maxItems": 8,
        },
        "owner": {
            "type": "object",
            "properties": {
                "email": {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.com$"},
                "admin": {"type": "boolean"},
            },
            "required": ["email", "admin"],
            "additionalProperties": False,
        },
    },
    "required": ["id", "name", "tags", "scores", "owner"],
    "additionalProperties": False,
}
# Grammars whose compile time is reported: the record, and schemas as the tests use them.
COMPILED: dict[str, dict[str, Any]] = {
    "record": RECORD,
    "flat enum": {"enum": ["yes", "no", "maybe"]},
    "nested arrays": {
        "type": "array",
        "items": {"type": "array", "items": {"type": "number", "minimum": 0, "maximum": 1}},
        "maxItems": 4,
    },
    "many properties": {
        "type": "object",
        "properties": {f"field_{i}": {"type": "string", "maxLength": 8} for i in range(40)},
        "required": [f"field_{i}" for i in range(40)],
        "additionalProperties": False,
    },
}


def run_round(llm: LLM, prompts: list[dict[str, Any]], max_tokens: int) -> dict[str, float]:
    constrained = SamplingParams(
        temperature=0.0, max_tokens=max_tokens, structured_outputs={"json": RECORD}
    )
    start = time.perf_counter()
    outputs = llm.generate(prompts, constrained, use_tqdm=False)
    constrained_s = time.perf_counter() - start
    lengths = [len(out.outputs[0].token_ids) for out in outputs]
    free = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
    start = time.perf_counter()
    llm.generate(prompts, free, use_tqdm=False)
    free_s = time.perf_counter() - start
    num_tokens = sum(lengths)
    finished = sum(out.outputs[0].finish_reason == "stop" for out in outputs)
    return {
        "tokens": num_tokens,
        "constrained_tps": num_tokens / constrained_s,
        "free_tps": num_tokens / free_s,
        "complete_json": finished / len(outputs),
    }


def compile_times(llm: LLM, repeats: int) -> dict[str, float]:
    """Median seconds from submitting a schema never seen before to its matcher being ready."""
    manager = llm.engine.scheduler.structured
    assert manager is not None
    manager.start(StructuredOutputsParams(json={"type": "boolean"})).wait(30)  # the tokenizer
    medians = {}
    for name, schema in COMPILED.items():
        times = []
        for _ in range(repeats):
            # A fresh title changes the cache key, not the grammar: a cold compile each time.
            fresh = {**schema, "title": uuid.uuid4().hex}
            start = time.perf_counter()
            grammar = manager.start(StructuredOutputsParams(json=fresh))
            grammar.wait(60)
            times.append(time.perf_counter() - start)
            assert grammar.ready() and grammar.error is None, grammar.error
        medians[name] = statistics.median(times)
    return medians


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--quick", action="store_true", help="16 requests, 1 round")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.quick:
        args.num_requests, args.rounds = 16, 1
    path, workload = benchmark_workload(args.num_requests, quick=args.quick, seed=args.seed)
    # NOTE: prefix caching off: each run would otherwise reuse the prompts the run before it
    # computed, and the first of a round would pay for both.
    llm = LLM(path, dtype="float32", enable_prefix_caching=False)
    prompts = [{"prompt_token_ids": p} for p in workload.prompts]
    # Untimed: the first pass over new batch sizes builds oneDNN's primitives for them.
    run_round(llm, prompts, args.max_tokens)
    rounds = [run_round(llm, prompts, args.max_tokens) for _ in range(args.rounds)]
    stats = llm.stats()
    constrained = statistics.median(r["constrained_tps"] for r in rounds)
    free = statistics.median(r["free_tps"] for r in rounds)
    print(f"{args.num_requests} requests, {args.rounds} rounds, schema 'record', greedy, fp32")
    print(f"output tokens per round: {rounds[0]['tokens']:.0f}")
    print(f"complete JSON (finish stop): {min(r['complete_json'] for r in rounds):.0%}")
    print(f"free (same token counts):    {free:8.0f} tok/s")
    print(f"constrained (JSON schema):   {constrained:8.0f} tok/s")
    print(f"ratio constrained / free:    {constrained / free:8.2f}x   (target >= 0.80x)")
    print(
        f"grammars compiled {stats['num_grammars_compiled']:.0f}, cache hits "
        f"{stats['num_grammar_cache_hits']:.0f}"
    )
    print("cold compile time, median of 5 (submit to matcher ready):")
    for name, seconds in compile_times(llm, repeats=5).items():
        print(f"  {name:<16} {seconds * 1e3:8.2f} ms")
    llm.shutdown()


if __name__ == "__main__":
    main()
