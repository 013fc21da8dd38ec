"""An agentic multi-turn trace against the cluster's KV memory: pagedray with its host tier,
pagedray without, and vLLM's CPU build given the same KV memory, one after the other.

The trace is synthesized, seeded, from the published shape of coding-agent sessions scaled to
this machine: every session starts from one shared system prompt, each turn resends the whole
history (the previous turns' inputs and outputs) plus a new input, and the client thinks a while
between turns. Two pagedray engine replicas serve it, their pools together about a quarter of the
trace's working set, so most of a session's history is evicted between its turns; vLLM gets the
same number of KV tokens in its one pool. Each request is a streamed /v1/completions of text
(greedy, EOS ignored) through the `openai` client, as an agent's harness sends it.

It prints, per system: prompt tokens computed (prompt tokens less those the server reports
cached) against the trace's achievable minimum (every token of a prompt that an earlier prompt or
answer already held counted as reusable), the hit rate against the achievable ceiling, TTFT p50
and p90 of first turns and of later turns, and output tok/s. Then a restart: a fresh server, on
the tier the first run filled, answers the next turn of the session idle longest (warm), against
a fresh server without a tier (cold): first-request TTFT each.

    .venv/bin/python benchmarks/agentic_trace.py              # 16 sessions x 6 turns
    .venv/bin/python benchmarks/agentic_trace.py --quick      # 6 sessions x 4 turns
    .venv/bin/python benchmarks/agentic_trace.py --no-vllm    # pagedray's two rows only
    .venv/bin/python benchmarks/agentic_trace.py --saturated  # no think time: server-bound
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import functools
import os
import random
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import openai

# NOTE: run as a script, this directory is on sys.path.
from http_throughput import Server
from vllm_offline import add_vllm_args, vllm_env
from vllm_peer import warm_up
from vllm_peer_tools import VllmServer

from pagedray.tools.default_model import default_model_path
from pagedray.workers.host_kv_buffer import TIER_DIR_ENV

BLOCK = 16  # pagedray's tokens per KV block; vLLM's CPU blocks hold 128
TIER_GIB = 1.0  # pagedray's host tier: far more than the trace's working set
MAX_MODEL_LEN = 2048  # the default model's, given to both servers


@dataclass(frozen=True)
class Shape:
    """The trace's shape, in tokens (texts are sized by word, about a token each)."""

    sessions: int
    turns: int
    system: int  # the shared system prompt
    first_input: int
    later_input: tuple[int, int]  # added by each later turn, drawn in this range
    output: tuple[int, int]  # max_tokens of each answer, drawn in this range
    think_s: tuple[float, float]  # the client's pause between an answer and its next turn
    stagger_s: float  # between two sessions' starts


FULL = Shape(16, 6, 448, 224, (80, 144), (32, 48), (0.5, 2.0), 0.4)
QUICK = Shape(6, 4, 384, 192, (64, 128), (24, 32), (0.3, 1.0), 0.3)


@dataclass
class Turn:
    session: int
    index: int
    prompt: str
    max_tokens: int
    ttft_s: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    answer: str = ""
    sent_at: float = 0.0  # perf_counter seconds


@dataclass
class Result:
    system: str
    turns: list[Turn]
    wall_s: float
    minimum: int  # prompt tokens the trace could not avoid computing
    probe: Turn | None = None  # the next turn of the session idle longest (restart probe)
    finished_order: list[int] = field(default_factory=list)


class Trace:
    """The sessions' texts, drawn once: every system is sent exactly the same inputs."""

    def __init__(self, shape: Shape, tokenizer, seed: int) -> None:
        self.shape, self.tokenizer = shape, tokenizer
        rng = random.Random(seed)
        words = sorted(
            {
                text.strip()
                for text in tokenizer.convert_ids_to_tokens(range(tokenizer.vocab_size))
                if text and text.strip("▁Ġ").isalpha() and 3 <= len(text.strip("▁Ġ")) <= 8
            }
        )
        words = [w.strip("▁Ġ") for w in words]

        def text(num_words: int) -> str:
            return " ".join(rng.choice(words) for _ in range(num_words))

        self.system = text(shape.system)
        self.inputs = [
            [text(shape.first_input)]
            + [text(rng.randint(*shape.later_input)) for _ in range(shape.turns)]
            for _ in range(shape.sessions)
        ]
        self.max_tokens = [
            [rng.randint(*shape.output) for _ in range(shape.turns + 1)]
            for _ in range(shape.sessions)
        ]
        self.think_s = [
            [rng.uniform(*shape.think_s) for _ in range(shape.turns)] for _ in range(shape.sessions)
        ]

    def first_prompt(self, session: int) -> str:
        return f"{self.system}\n\nUser: {self.inputs[session][0]}\n\nAssistant:"

    def next_prompt(self, turn: Turn) -> str:
        follow = self.inputs[turn.session][turn.index + 1]
        return f"{turn.prompt}{turn.answer}\n\nUser: {follow}\n\nAssistant:"

    def fits(self, prompt: str, max_tokens: int) -> bool:
        """Whether a turn stays within the context every system serves (`MAX_MODEL_LEN`)."""
        return len(self.tokenizer.encode(prompt)) + max_tokens <= MAX_MODEL_LEN

    def minimum(self, turns: list[Turn]) -> int:
        """Prompt tokens no cache could have spared: of each prompt, those past its longest
        common prefix with any prompt or prompt + answer sent before it."""
        encode = self.tokenizer.encode
        seen: list[list[int]] = []
        total = 0
        for turn in sorted(turns, key=lambda t: t.sent_at):
            ids = encode(turn.prompt)
            reused = max((_common_prefix(ids, earlier) for earlier in seen), default=0)
            total += max(1, len(ids) - reused)
            seen += [ids, encode(turn.prompt + turn.answer)]
        return total


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


async def send(client: openai.AsyncOpenAI, model: str, turn: Turn) -> None:
    turn.sent_at = time.perf_counter()
    stream = await client.completions.create(
        model=model,
        prompt=turn.prompt,
        max_tokens=turn.max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    parts = []
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            if not parts:
                turn.ttft_s = time.perf_counter() - turn.sent_at
            parts.append(chunk.choices[0].text)
        if chunk.usage is not None:
            turn.prompt_tokens = chunk.usage.prompt_tokens
            turn.output_tokens = chunk.usage.completion_tokens
            details = chunk.usage.prompt_tokens_details
            turn.cached_tokens = (details.cached_tokens or 0) if details else 0
    turn.answer = "".join(parts)


async def run_trace(url: str, trace: Trace, system: str) -> Result:
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=600)
    turns: list[Turn] = []
    finished: list[int] = []
    async with client:
        model = (await client.models.list()).data[0].id

        async def session(index: int) -> None:
            await asyncio.sleep(index * trace.shape.stagger_s)
            turn = Turn(index, 0, trace.first_prompt(index), trace.max_tokens[index][0])
            for step in range(trace.shape.turns):
                await send(client, model, turn)
                turns.append(turn)
                follow = trace.next_prompt(turn)
                max_tokens = trace.max_tokens[index][step + 1]
                if step + 1 == trace.shape.turns or not trace.fits(follow, max_tokens):
                    break  # a session ends where its context would outgrow the model's
                await asyncio.sleep(trace.think_s[index][step])
                turn = Turn(index, step + 1, follow, max_tokens)
            finished.append(index)

        start = time.perf_counter()
        await asyncio.gather(*(session(i) for i in range(trace.shape.sessions)))
        wall_s = time.perf_counter() - start
    return Result(system, turns, wall_s, trace.minimum(turns), finished_order=finished)


async def first_request_ttft(url: str, turn: Turn) -> Turn:
    """`turn` sent alone to a server that has answered one unrelated request."""
    warm_up(url)
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=600)
    async with client:
        model = (await client.models.list()).data[0].id
        probe = Turn(turn.session, turn.index, turn.prompt, turn.max_tokens)
        await send(client, model, probe)
    return probe


def probe_turn(trace: Trace, result: Result) -> Turn:
    """The next turn of the session whose last answer came first: the one idle longest, whose
    history the pools most likely evicted."""
    session = result.finished_order[0]
    last = max((t for t in result.turns if t.session == session), key=lambda t: t.index)
    # A short next input and answer, so that it fits where the session's next turn may not.
    words = " ".join(trace.inputs[session][last.index + 1].split()[:16])
    prompt = f"{last.prompt}{last.answer}\n\nUser: {words}\n\nAssistant:"
    return Turn(session, last.index + 1, prompt, 8)


def pagedray_server(args: argparse.Namespace, path: str, log_dir: Path, tier_gib: float) -> Server:
    write_through = ("--kv-offloading-write-through",) if tier_gib and args.write_through else ()
    flags = (
        *write_through,
        "--num-replicas", "2",
        "--num-kv-blocks", str(args.blocks_per_replica),
        "--kv-offloading-size", str(tier_gib),
        "--max-model-len", str(MAX_MODEL_LEN),
    )  # fmt: skip
    return Server(path, args.server_threads, 1, log_dir, 1, flags)


def vllm_server(args: argparse.Namespace, path: str, log_dir: Path) -> VllmServer:
    total_tokens = 2 * args.blocks_per_replica * BLOCK
    flags = (
        "--num-gpu-blocks-override", str(max(16, total_tokens // 128)),
        "--enable-prompt-tokens-details",
        "--max-model-len", str(MAX_MODEL_LEN),
    )  # fmt: skip
    return VllmServer(vllm_env(args), path, log_dir, flags)


def served(make, trace: Trace, system: str, timeout_s: float, probe: Turn | None = None):
    """Start a server, run the trace through it (or only `probe`, as its first request), stop."""
    log_dir = Path(tempfile.mkdtemp(prefix="agentic_trace_"))
    server = make(log_dir)
    try:
        server.wait_healthy(timeout_s)
        if probe is not None:
            return asyncio.run(first_request_ttft(server.url, probe))
        warm_up(server.url)
        result = asyncio.run(run_trace(server.url, trace, system))
        print(f"{system}: {result.wall_s:.1f} s", flush=True)
        return result
    except BaseException:
        print(f"{system} failed; its log stays at {server.log_path}", flush=True)
        raise
    finally:
        server.stop()


def quantile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def report(results: list[Result], warm: Turn | None, cold: Turn | None) -> None:
    print(
        "\n| system | prompt tokens computed (x min) | hit rate (ceiling) "
        "| TTFT first p50/p90 ms | TTFT later p50/p90 ms | output tok/s |\n"
        "|---|---|---|---|---|---|"
    )
    for r in results:
        print(f"{r.system}: {len(r.turns)} turns")
    for r in results:
        prompt = sum(t.prompt_tokens for t in r.turns)
        computed = prompt - sum(t.cached_tokens for t in r.turns)
        first = [t.ttft_s * 1000 for t in r.turns if t.index == 0]
        later = [t.ttft_s * 1000 for t in r.turns if t.index > 0]
        out = sum(t.output_tokens for t in r.turns) / r.wall_s
        print(
            f"| {r.system} | {computed:,} ({computed / r.minimum:.2f}x of {r.minimum:,}) | "
            f"{1 - computed / prompt:.1%} ({1 - r.minimum / prompt:.1%}) | "
            f"{quantile(first, 0.5):.0f} / {quantile(first, 0.9):.0f} | "
            f"{quantile(later, 0.5):.0f} / {quantile(later, 0.9):.0f} | {out:.0f} |"
        )
    by_name = {r.system: r for r in results}
    tiers, off = by_name.get("pagedray, host tier"), by_name.get("pagedray, no tier")
    if tiers and off:
        later = [statistics.median(t.ttft_s for t in r.turns if t.index > 0) for r in (off, tiers)]
        print(f"later-turn TTFT p50, no tier / host tier: {later[0] / later[1]:.2f}x")
    if "vLLM" in by_name and tiers:
        ratio = sum(t.output_tokens for t in tiers.turns) / tiers.wall_s
        ratio /= sum(t.output_tokens for t in by_name["vLLM"].turns) / by_name["vLLM"].wall_s
        print(f"output tok/s, pagedray with tier / vLLM: {ratio:.2f}x")
    if warm and cold:
        print(
            f"restart, first request (a later turn of {warm.prompt_tokens} prompt tokens): "
            f"warm {warm.ttft_s * 1000:.0f} ms ({warm.cached_tokens} cached), cold "
            f"{cold.ttft_s * 1000:.0f} ms ({cold.cached_tokens} cached): "
            f"{cold.ttft_s / warm.ttft_s:.1f}x"
        )


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--model", default=None, help="checkpoint directory (default: the built default model)")
    add("--quick", action="store_true", help="a smaller trace, a smoke run")
    add(
        "--write-through",
        action="store_true",
        help="pagedray's tier saves every block as computed (off: evicted blocks, the default)",
    )
    add(
        "--saturated",
        action="store_true",
        help="no think time and every session at once: the servers' throughput, not the clients'",
    )
    add("--seed", type=int, default=0)
    add("--no-vllm", action="store_true", help="skip vLLM's row")
    add("--server-threads", type=int, default=1, help="pagedray: torch threads per replica")
    add("--blocks-per-replica", type=int, default=0, help="default: a quarter of the working set")
    add("--startup-timeout", type=float, default=300.0)
    add_vllm_args(parser)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    from transformers import AutoTokenizer

    path = args.model or str(default_model_path())
    shape = QUICK if args.quick else FULL
    if args.saturated:
        shape = dataclasses.replace(shape, think_s=(0.0, 0.0), stagger_s=0.0)
    trace = Trace(shape, AutoTokenizer.from_pretrained(path), args.seed)
    if not args.blocks_per_replica:
        longest = len(trace.tokenizer.encode(trace.first_prompt(0))) + shape.turns * (
            shape.later_input[1] + shape.output[1] + 8
        )
        longest = min(longest, MAX_MODEL_LEN)
        working_set = shape.system + shape.sessions * (longest - shape.system)
        args.blocks_per_replica = max(-(-MAX_MODEL_LEN // BLOCK), working_set // 4 // 2 // BLOCK)
    print(
        f"{time.strftime('%Y-%m-%d %H:%M')}; {path}; {shape.sessions} sessions x {shape.turns} "
        f"turns (fewer where a context would pass {MAX_MODEL_LEN} tokens)"
        f"{', saturated (no think time)' if args.saturated else ''}; 2 replicas x "
        f"{args.blocks_per_replica} blocks of {BLOCK} tokens"
    )
    if not args.no_vllm:
        vllm_env(args).check()  # before anything runs: exits with a message if it is missing
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    tier_dir = tempfile.mkdtemp(prefix="agentic_tier_", dir=shm)
    os.environ[TIER_DIR_ENV] = tier_dir  # the servers' tier files: this run's alone

    def pagedray(tier_gib: float, name: str, probe: Turn | None = None):
        make = functools.partial(pagedray_server, args, path, tier_gib=tier_gib)
        return served(make, trace, name, args.startup_timeout, probe)

    try:
        results = [pagedray(TIER_GIB, "pagedray, host tier")]
        probe = probe_turn(trace, results[0])
        warm = pagedray(TIER_GIB, "restart, warm", probe)
        cold = pagedray(0, "restart, cold", probe)
        results.append(pagedray(0, "pagedray, no tier"))
        if not args.no_vllm:
            make_vllm = functools.partial(vllm_server, args, path)
            results.append(served(make_vllm, trace, "vLLM", args.startup_timeout))
    finally:
        shutil.rmtree(tier_dir, ignore_errors=True)
    report(results, warm, cold)


if __name__ == "__main__":
    main()
