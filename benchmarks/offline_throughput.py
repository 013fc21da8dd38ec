"""Offline throughput: pagedray against transformers' continuous batching and static batching.

One seeded ShareGPT-like workload (lognormal prompt and output lengths, EOS ignored, greedy) runs
through each system in turn on the same prompts and per-request output lengths, in one process:

    .venv/bin/python benchmarks/offline_throughput.py            # 64 requests, several minutes
    .venv/bin/python benchmarks/offline_throughput.py --quick    # 16 short requests, a smoke run
"""

from __future__ import annotations

import argparse
import math
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch

from pagedray.tools.default_model import PRESET_ARCHS, default_model_path

SYSTEMS = ("pagedray", "continuous", "static")
# Requests whose greedy tokens are compared across systems: a loose check, not a test.
NUM_CHECKED = 4


@dataclass(frozen=True)
class LengthDist:
    """A lognormal length in tokens, rounded and clipped to [low, high]."""

    median: float
    sigma: float
    low: int
    high: int

    def sample(self, rng: np.random.Generator, num: int) -> list[int]:
        lengths = rng.lognormal(math.log(self.median), self.sigma, num)
        return np.clip(np.rint(lengths), self.low, self.high).astype(int).tolist()


# Roughly ShareGPT's shape (vLLM's benchmark: prompts ~200 tokens, outputs ~100-200), scaled
# to the ranges a 2-core CPU finishes in minutes.
FULL_PROMPT = LengthDist(median=180, sigma=0.9, low=20, high=1000)
FULL_OUTPUT = LengthDist(median=90, sigma=0.8, low=10, high=300)
QUICK_PROMPT = LengthDist(median=60, sigma=0.8, low=20, high=200)
QUICK_OUTPUT = LengthDist(median=20, sigma=0.6, low=10, high=50)


@dataclass
class Workload:
    """Prompts and their target output lengths, in arrival order."""

    prompts: list[list[int]]  # token ids per request
    output_lens: list[int]  # tokens each request must generate (EOS ignored)
    # NOTE: warm-up prompts are drawn separately so that they seed no prefix-cache hits.
    warmup_prompts: list[list[int]]  # token ids, a few short prompts run before timing
    warmup_output_lens: list[int]

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)


@dataclass
class Result:
    """One system's timed run."""

    name: str
    wall_s: float  # seconds, submission to the last result
    cpu_s: float  # process CPU seconds (all threads) over the same interval
    others_mean: float  # runnable tasks of other processes, sampled over the run
    others_max: int
    token_ids: list[list[int]]  # generated tokens per request, truncated to its target
    notes: list[str] = field(default_factory=list)


def make_workload(
    num_requests: int, prompt: LengthDist, output: LengthDist, vocab_ids: list[int], seed: int
) -> Workload:
    """Random prompts over ordinary (non-special) token ids; every draw comes from `seed`."""
    rng = np.random.default_rng(seed)
    prompt_lens = prompt.sample(rng, num_requests)
    output_lens = output.sample(rng, num_requests)
    vocab = np.asarray(vocab_ids)
    prompts = [rng.choice(vocab, size=n).tolist() for n in prompt_lens]
    warmup_prompts = [rng.choice(vocab, size=32).tolist() for _ in range(4)]
    return Workload(prompts, output_lens, warmup_prompts, [8] * len(warmup_prompts))


def benchmark_workload(
    num_requests: int, quick: bool, seed: int, preset: str = "small"
) -> tuple[str, Workload]:
    """A built model's path (by default the small one; a real-shape preset as its publisher
    ships it, in bfloat16) and the seeded workload every benchmark script runs."""
    from transformers import AutoTokenizer

    prompt_dist, output_dist = (QUICK_PROMPT, QUICK_OUTPUT) if quick else (FULL_PROMPT, FULL_OUTPUT)
    arch = PRESET_ARCHS.get(preset, "llama")
    stored = "float32" if preset in ("tiny", "small") else "bfloat16"
    path = str(default_model_path(arch, preset, stored))
    tokenizer = AutoTokenizer.from_pretrained(path)
    special = set(tokenizer.all_special_ids)
    vocab_ids = [i for i in range(len(tokenizer)) if i not in special]
    return path, make_workload(num_requests, prompt_dist, output_dist, vocab_ids, seed)


class RunQueueSampler:
    """Samples how many tasks of other processes were runnable, in a daemon thread (Linux).

    The 1-minute load average lags by about a minute, longer than some runs, and counts our own
    threads; this says how much other processes competed for the CPUs during the run itself.
    """

    def __init__(self, interval_s: float = 0.2) -> None:
        self.interval_s = interval_s
        self.samples: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> RunQueueSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                with open("/proc/stat") as stat:
                    line = next(ln for ln in stat if ln.startswith("procs_running"))
                own = sum(_is_running(task) for task in os.listdir("/proc/self/task"))
            except (OSError, StopIteration):
                return  # not Linux: report no samples
            # NOTE: this thread counts itself in both numbers, so it cancels out.
            self.samples.append(max(0, int(line.split()[1]) - own))


def _is_running(task: str) -> bool:
    try:
        with open(f"/proc/self/task/{task}/stat") as stat:
            # The state follows the parenthesised command name, which may contain spaces.
            return stat.read().rsplit(")", 1)[1].split()[0] == "R"
    except OSError:
        return False  # the thread exited meanwhile


def timed(name: str, run: Callable[[], list[list[int]]]) -> Result:
    """Runs `run` once, measuring wall and process CPU time and the CPU contention during it."""
    with RunQueueSampler() as sampler:
        wall_start, cpu_start = time.perf_counter(), time.process_time()
        token_ids = run()
        wall_s, cpu_s = time.perf_counter() - wall_start, time.process_time() - cpu_start
    samples = sampler.samples or [0]
    return Result(name, wall_s, cpu_s, sum(samples) / len(samples), max(samples), token_ids)


# ---- pagedray --------------------------------------------------------------------------------


def run_pagedray(
    path: str, workload: Workload, threads: int, device: str = "cpu", dtype: str = "float32"
) -> Result:
    from pagedray import LLM, SamplingParams

    llm = LLM(path, dtype=dtype, num_threads=threads, device=device)
    prompts = [{"prompt_token_ids": p} for p in workload.prompts]

    def generate(prompts: list[dict[str, Any]], output_lens: list[int]) -> list[list[int]]:
        params = [
            SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in output_lens
        ]
        outputs = llm.generate(prompts, params, use_tqdm=False)
        return [list(out.outputs[0].token_ids) for out in outputs]

    warmup = [{"prompt_token_ids": p} for p in workload.warmup_prompts]
    generate(warmup, workload.warmup_output_lens)  # not timed
    before = llm.stats()
    result = timed("pagedray", lambda: generate(prompts, workload.output_lens))
    after = llm.stats()
    result.notes.append(
        f"steps={after['num_steps'] - before['num_steps']} "
        f"preemptions={after['num_preemptions'] - before['num_preemptions']} "
        f"peak_running={after['peak_num_running']} "
        f"prefix_hits={after['prefix_cache_hits'] - before['prefix_cache_hits']}"
    )
    llm.shutdown()
    return result


# ---- transformers: continuous batching with its paged cache ----------------------------------


def run_continuous(
    path: str,
    workload: Workload,
    max_batch_tokens: int,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> Result:
    """`generate_batch`'s own manager, fed request by request so each keeps its output length."""
    from transformers import AutoModelForCausalLM, GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    # NOTE: on CPU continuous batching runs "sdpa" over its paged cache (flash needs CUDA; plain
    # "eager" becomes "paged|eager"); the manager would switch sdpa to flash if it were available.
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa")
    model = model.to(device)
    # eos_token_id=-1: negative ids are dropped from a request's EOS set, so EOS never stops one.
    generation_config = GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=0)
    page_size = 256  # transformers' default
    # Room for every request at once (as pagedray has), instead of 60% of host RAM by default;
    # a few spare blocks for the warm-up.
    num_blocks = 4 + sum(
        -(-(len(p) + n) // page_size) for p, n in zip(workload.prompts, workload.output_lens)
    )
    cb_config = ContinuousBatchingConfig(
        page_size=page_size,
        num_blocks=num_blocks,
        max_batch_tokens=max_batch_tokens,
        auto_switch_to_flash=False,
    )
    hints = WorkloadHints(
        max_prompt_length=max(len(p) for p in workload.prompts),
        max_generated_length=max(workload.output_lens),
        num_requests=len(workload.prompts),
    )

    with model.continuous_batching_context_manager(
        generation_config=generation_config,
        continuous_batching_config=cb_config,
        workload_hints=hints,
        block=True,
        timeout=60,
    ) as manager:

        def generate(prompts: list[list[int]], output_lens: list[int]) -> list[list[int]]:
            req_ids = [
                manager.add_request(p, max_new_tokens=n, eos_token_id=-1)
                for p, n in zip(prompts, output_lens)
            ]
            results: dict[str, list[int]] = {}
            while len(results) < len(req_ids):
                out = manager.get_result(timeout=1)
                if out is None:
                    if not manager.is_running():
                        raise RuntimeError("continuous batching loop stopped early")
                    continue
                if out.error is not None:
                    raise RuntimeError(f"{out.request_id}: {out.error}")
                if out.is_finished():
                    results[out.request_id] = list(out.generated_tokens)
            return [results[req_id] for req_id in req_ids]

        generate(workload.warmup_prompts, workload.warmup_output_lens)  # not timed
        result = timed("continuous", lambda: generate(workload.prompts, workload.output_lens))
        attn_implementation = model.config._attn_implementation  # restored when the manager stops
    result.notes.append(
        f"attn={attn_implementation} page_size={page_size} "
        f"num_blocks={num_blocks} max_batch_tokens={max_batch_tokens}"
    )
    return result


# ---- transformers: static batching with model.generate ---------------------------------------


def run_static(
    path: str,
    workload: Workload,
    batch_size: int,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> Result:
    """Batches of `batch_size` in arrival order, left-padded, each run to its longest target."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa")
    model = model.to(device).eval()
    pad_id = 0

    def generate_batch(prompts: list[list[int]], output_lens: list[int]) -> list[list[int]]:
        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
        attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, prompt in enumerate(prompts):
            input_ids[i, width - len(prompt) :] = torch.tensor(prompt)
            attention_mask[i, width - len(prompt) :] = 1
        num_new = max(output_lens)
        # min_new_tokens == max_new_tokens masks EOS until the end: EOS is ignored.
        config = GenerationConfig(
            do_sample=False,
            max_new_tokens=num_new,
            min_new_tokens=num_new,
            pad_token_id=pad_id,
            eos_token_id=model.config.eos_token_id,
        )
        with torch.inference_mode():
            out = model.generate(
                input_ids=input_ids.to(device),
                attention_mask=attention_mask.to(device),
                generation_config=config,
            )  # [batch, width + num_new]
        return [out[i, width : width + n].tolist() for i, n in enumerate(output_lens)]

    def generate(prompts: list[list[int]], output_lens: list[int]) -> list[list[int]]:
        token_ids: list[list[int]] = []
        for start in range(0, len(prompts), batch_size):
            end = start + batch_size
            token_ids.extend(generate_batch(prompts[start:end], output_lens[start:end]))
        return token_ids

    generate(workload.warmup_prompts, workload.warmup_output_lens)  # not timed
    result = timed("static", lambda: generate(workload.prompts, workload.output_lens))
    padded_out = sum(
        len(workload.output_lens[s : s + batch_size])
        * max(workload.output_lens[s : s + batch_size])
        for s in range(0, len(workload.prompts), batch_size)
    )
    result.notes.append(
        f"batch_size={batch_size} generated incl. padding={padded_out} "
        f"(useful {workload.num_output_tokens})"
    )
    return result


# ---- report ----------------------------------------------------------------------------------


def check_tokens(workload: Workload, results: dict[str, Result]) -> list[str]:
    """Lengths for every request, and greedy agreement with pagedray for the first few."""
    lines = []
    for result in results.values():
        bad = [
            i for i, (t, n) in enumerate(zip(result.token_ids, workload.output_lens)) if len(t) != n
        ]
        if bad:
            lines.append(f"  {result.name}: {len(bad)} requests with the wrong output length")
    reference = results.get("pagedray")
    if reference is None:
        return lines
    for name, result in results.items():
        if name == "pagedray":
            continue
        verdicts = []
        for i in range(min(NUM_CHECKED, len(workload.prompts))):
            ours, theirs = reference.token_ids[i], result.token_ids[i]
            if ours == theirs:
                verdicts.append("same")
            else:
                first = next((j for j, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
                verdicts.append(f"differs at token {first}")
        lines.append(f"  pagedray vs {name}, requests 0-{len(verdicts) - 1}: {verdicts}")
    return lines


def report(workload: Workload, results: dict[str, Result]) -> None:
    useful = workload.num_output_tokens
    total = workload.num_prompt_tokens + useful
    print()
    # Output tokens per CPU-second is steadier than per wall-second on a shared machine, but it
    # also counts threads spin-waiting at barriers.
    print(
        f"{'system':<12}{'wall s':>9}{'out tok/s':>11}{'total tok/s':>13}{'cpu s':>9}"
        f"{'out tok/cpu-s':>15}{'others runnable':>17}"
    )
    for r in results.values():
        load = f"{r.others_mean:.1f} (max {r.others_max})"
        print(
            f"{r.name:<12}{r.wall_s:>9.2f}{useful / r.wall_s:>11.1f}{total / r.wall_s:>13.1f}"
            f"{r.cpu_s:>9.1f}{useful / r.cpu_s:>15.1f}{load:>17}"
        )
    for r in results.values():
        for note in r.notes:
            print(f"  {r.name}: {note}")
    for r in results.values():
        if r.others_mean >= 0.5:
            print(
                f"WARNING: {r.name} shared {os.cpu_count()} CPUs with {r.others_mean:.1f} "
                "runnable tasks of other processes on average: its wall time is inflated, most "
                "with --threads > 1, where threads wait on each other at every op"
            )
    if "pagedray" in results:
        ours = results["pagedray"].wall_s
        for name, target in (("continuous", 2.0), ("static", 4.0)):
            if name in results:
                ratio = results[name].wall_s / ours
                verdict = "meets" if ratio >= target else "misses"
                print(
                    f"pagedray / {name}: {ratio:.2f}x throughput "
                    f"({verdict} the {target:.0f}x target)"
                )
    print("correctness (loose):")
    for line in check_tokens(workload, results) or ["  nothing to compare"]:
        print(line)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="16 short requests: a smoke run")
    parser.add_argument("--num-requests", type=int, default=None, help="default 64 (16 quick)")
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    parser.add_argument("--batch-size", type=int, default=16, help="static batching batch size")
    parser.add_argument(
        "--max-batch-tokens",
        type=int,
        default=2048,
        help="continuous batching token budget (pagedray's default)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seeds the workload")
    parser.add_argument(
        "--systems",
        default=",".join(SYSTEMS),
        help=f"comma-separated subset of {','.join(SYSTEMS)}",
    )
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = set(systems) - set(SYSTEMS)
    if unknown:
        raise SystemExit(f"--systems: unknown {sorted(unknown)}")
    num_requests = args.num_requests or (16 if args.quick else 64)
    path, workload = benchmark_workload(num_requests, args.quick, args.seed)

    print(f"model {path}, threads {args.threads}, {num_requests} requests, seed {args.seed}")
    print(
        f"prompt tokens {workload.num_prompt_tokens} "
        f"(min {min(map(len, workload.prompts))}, max {max(map(len, workload.prompts))}), "
        f"output tokens {workload.num_output_tokens} "
        f"(min {min(workload.output_lens)}, max {max(workload.output_lens)})"
    )
    print(
        f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())} "
        f"on {os.cpu_count()} CPUs"
    )

    runners: dict[str, Callable[[], Result]] = {
        "pagedray": lambda: run_pagedray(path, workload, args.threads),
        "continuous": lambda: run_continuous(path, workload, args.max_batch_tokens),
        "static": lambda: run_static(path, workload, args.batch_size),
    }
    results: dict[str, Result] = {}
    for name in systems:
        results[name] = runners[name]()
        r = results[name]
        print(
            f"{name}: {r.wall_s:.2f} s wall, {workload.num_output_tokens / r.wall_s:.1f} "
            f"output tok/s",
            flush=True,
        )
    report(workload, results)


if __name__ == "__main__":
    main()
