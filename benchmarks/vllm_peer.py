"""pagedray side by side with vLLM's CPU build: same model, same workload, same run, as ratios.

Optional (CI does not run it): vLLM's CPU build lives in a venv of its own (--venv), run by its
interpreter; the script exits with a message when that venv is absent. guidellm drives the servers.

    .venv/bin/python benchmarks/vllm_peer.py            # about 10-15 minutes on 2 cores
    .venv/bin/python benchmarks/vllm_peer.py --quick    # a smoke run, a few minutes
    .venv/bin/python benchmarks/vllm_peer.py --parts served --preset qwen2.5-0.5b --dtype bfloat16

What it measures, both systems in the same run:
1. Offline: output tok/s of pagedray's and vLLM's `LLM.generate` on `offline_throughput.py`'s
   seeded workload (token-id prompts, per-request output lengths, EOS ignored, greedy; the
   small model in fp32 unless --preset names a published shape and --dtype another type;
   prefix caching off in both since repeats resend the same prompts). vLLM runs in a subprocess
   that keeps its engine and times `generate` alone; the runs alternate (ABBA) between the
   systems, `--repeats` each, and the medians are compared: vllm_offline.py's sharegpt fp32
   cell (that script runs the whole fp32/bf16 x workload table).
2. Served: `pagedray serve` and vLLM's OpenAI server one after the other, each through the same
   guidellm sweep (synthetic 128-token prompts, 64 output tokens, EOS ignored, streamed chat
   completions: the model has a chat template): synchronous, then a fixed number of concurrent
   streams (`--streams`, by default 64; several, as `--streams 1 8 32 64`, for the TTFT table),
   each bounded by a request count and a duration. TTFT median and p95, ITL and request latency
   medians and output tok/s, as pagedray/vLLM ratios, and each server's concurrent tok/s (the
   most streams) over its offline tok/s.
   `--systems pagedray,vllm,no-ray` adds `pagedray serve --no-ray` (one process: the same
   routes over an engine it steps itself, no Serve hops) as a third system.
   NOTE: on 2 cores vLLM's API process often gets no CPU while the engine steps, so a request's
   tokens reach the client in one burst (ITL near 0, TTFT near the whole latency): the report
   says how many requests did; compare latency there rather than TTFT or ITL alone.
3. CPU of each server's processes (and of guidellm) over the concurrent run, from /proc sampled
   every 0.5 s and cut at guidellm's start and end times, in ms per output token.

vLLM settings (environment variables read by its CPU platform; flags change them):
- VLLM_CPU_KVCACHE_SPACE=2 (GiB): pagedray's CPU pool is min(4 GiB, max_num_seqs x max_model_len
  tokens), 2 GiB for the small model (4 KiB per token, 524,288 tokens); vLLM's 2 GiB holds the
  same 524,288 tokens (its default would be 4 GiB). The 0.5B shape's 12 KiB a token leave vLLM
  174,762 tokens, still far more than 64 streams of 192 tokens hold.
- VLLM_CPU_OMP_THREADS_BIND=0-1: "auto" reserves one of the two cores for its engine-core and API
  processes and leaves the model worker one OpenMP thread, as `pagedray serve` does by default
  for a light model;
  vLLM's worker gets both cores instead, bound, which measured faster for it (in a --quick run,
  "auto" gave vLLM 1,572 concurrent tok/s, "0-1" 1,913): the peer at its best. "nobind" would
  leave Intel OpenMP's 200 ms spin-wait in place of the 5 ms vLLM sets when it binds.
  VLLM_CPU_NUM_OF_RESERVED_CPU is left unset: only the "auto" binding reads it.
- LD_PRELOAD of tcmalloc and the venv's Intel OpenMP (libiomp5), as vLLM's CPU docs recommend.
- Everything else at vLLM's defaults (block size 128 on CPU, its own batch limits, torch.compile
  of the model at start-up); pagedray at its own (offline 2 threads; served, the cores but one
  for a light model and all of them for a heavy one, `--stream-interval 1`, as vLLM's).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

# NOTE: run as a script, this directory is on sys.path.
from http_throughput import CONTENDED, Server, _role_of
from offline_throughput import benchmark_workload
from vllm_offline import DTYPES, Cell, add_vllm_args, report, run_cell, vllm_env
from vllm_peer_tools import (
    MODEL_ROLES,
    SERVING_PATH_ROLES,
    CpuTimeline,
    Guidellm,
    Profile,
    VllmEnv,
    VllmServer,
    vllm_role,
)

from pagedray.tools.default_model import PRESETS

SYSTEMS = ("pagedray", "vLLM")
# `pagedray serve --no-ray` (one process, no Serve hops), a served system --systems may name.
NO_RAY = "pagedray --no-ray"
SERVED_SYSTEMS = {"pagedray": "pagedray", "vllm": "vLLM", "no-ray": NO_RAY}
PROMPT_TOKENS, OUTPUT_TOKENS = 128, 64  # the served workload, per request
# (count, seconds) bounds per guidellm profile: full, quick.
SYNC_BOUNDS = {False: (40, 60.0), True: (8, 20.0)}
CONCURRENT_BOUNDS = {False: (384, 120.0), True: (128, 45.0)}


# ---- served ----------------------------------------------------------------------------------


@dataclass
class Served:
    """One server through the guidellm sweep."""

    startup_s: float
    sync: Profile
    by_streams: dict[int, Profile]  # the fixed-concurrency profiles
    concurrent: Profile  # the most streams' (CPU accounting, served/offline)
    cpu_by_role: dict[str, float]  # CPU seconds over the concurrent benchmark, by process role
    others_share: float  # other processes' CPU over it, as a share of every CPU

    def cpu_ms_per_token(self, roles: list[str]) -> float:
        seconds = sum(self.cpu_by_role.get(role, 0.0) for role in roles)
        return 1000 * seconds / max(1, self.concurrent.num_output_tokens)


def warm_up(url: str) -> None:
    """One short chat request, untimed, so that neither server's first request is measured
    (the last model listed: a LoRA adapter where the servers have one)."""
    model = httpx.get(f"{url}/v1/models", timeout=60).json()["data"][-1]["id"]
    body = {"model": model, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 8}
    httpx.post(f"{url}/v1/chat/completions", json=body, timeout=300).raise_for_status()


# The adapter's name, on both servers, with --lora.
LORA_NAME = "adapter"


def serve_sweep(system: str, args: argparse.Namespace, env: VllmEnv, path: str) -> Served:
    log_dir = Path(tempfile.mkdtemp(prefix=f"vllm_peer_{system.replace(' ', '')}_"))
    server: Server
    # With --lora, both serve one adapter, which every request names (vLLM's flags, both).
    lora_flags: tuple[str, ...] = ()
    if args.lora_adapter:
        lora_flags = ("--enable-lora", "--lora-modules", f"{LORA_NAME}={args.lora_adapter}")
        lora_flags += ("--max-lora-rank", str(args.lora_rank))
    if system in ("pagedray", NO_RAY):
        # NOTE: each with a host KV tier of its own (`Server`'s default): guidellm's seeded
        # prompts repeat from one sweep to the next, and vLLM starts with an empty cache.
        flags = (("--no-ray",) if system == NO_RAY else ()) + lora_flags
        server = Server(path, args.server_threads, 1, log_dir, 1, flags, args.dtype)
        role_of = _role_of
    else:
        server = VllmServer(env, path, log_dir, lora_flags, dtype=args.dtype)
        role_of = vllm_role
    guidellm = Guidellm(
        args.guidellm,
        path,
        args.request_format,
        PROMPT_TOKENS,
        OUTPUT_TOKENS,
        log_dir,
        LORA_NAME if args.lora_adapter else None,
    )
    with CpuTimeline() as timeline:
        timeline.watch(os.getsid(0), lambda pid: "benchmark")
        timeline.watch(server.proc.pid, role_of)
        try:
            startup_s = server.wait_healthy(args.startup_timeout)
            print(f"{system} server healthy after {startup_s:.0f} s", flush=True)
            warm_up(server.url)
            sync = guidellm.run(
                server.url, "kind=synchronous", *SYNC_BOUNDS[args.quick], "sync", timeline
            )
            print(f"{system} synchronous: {sync.output_tok_s:.1f} output tok/s", flush=True)
            count, seconds = CONCURRENT_BOUNDS[args.quick]
            seconds = args.concurrent_seconds or seconds
            by_streams = {}
            for streams in sorted(args.streams):
                by_streams[streams] = guidellm.run(
                    server.url,
                    f"kind=concurrent,streams={streams}",
                    count,
                    seconds,
                    f"concurrent{streams}",
                    timeline,
                )
                got = by_streams[streams]
                print(
                    f"{system} {streams} concurrent: {got.output_tok_s:.1f} output tok/s, "
                    f"TTFT median {got.ttft_ms:.1f} p95 {got.ttft_p95_ms:.1f} ms",
                    flush=True,
                )
            concurrent = by_streams[max(by_streams)]
        except BaseException:
            print(f"{system} sweep failed; logs stay in {log_dir}", flush=True)
            raise
        finally:
            print(f"{system} server stopped ({server.stop()})", flush=True)
    shutil.rmtree(log_dir, ignore_errors=True)  # kept only when the sweep failed
    by_role, others_s, window_s = timeline.window(concurrent.start, concurrent.end)
    by_role.pop("benchmark", None)
    others_share = others_s / (window_s * (os.cpu_count() or 1))
    return Served(startup_s, sync, by_streams, concurrent, by_role, others_share)


# ---- report ----------------------------------------------------------------------------------


def ratio(ours: float, theirs: float) -> str:
    return f"{ours / theirs:.2f}x" if theirs else "-"


def report_served(
    served: dict[str, list[Served]], offline: Cell | None, all_streams: list[int]
) -> None:
    rounds = len(served["pagedray"])
    print(
        f"\nServed through guidellm ({PROMPT_TOKENS} prompt / {OUTPUT_TOKENS} output tokens, "
        f"streamed; median of {rounds} round(s)); ratios: higher is better for tok/s, "
        "lower for TTFT and ITL"
    )
    systems = list(served)
    # Ratios against vLLM, where it ran.
    ours_names = [x for x in systems if x != "vLLM"] if "vLLM" in systems else []
    header = "".join(f"{x:>18}" for x in systems)
    header += "".join(f"{x + '/vLLM':>26}" for x in ours_names)
    print(f"{'profile':<16}{'metric':<16}{header}")
    rows: list[tuple[str, str, Any]] = [
        ("synchronous", "TTFT ms", lambda s: s.sync.ttft_ms),
        ("", "TTFT p95 ms", lambda s: s.sync.ttft_p95_ms),
        ("", "ITL ms", lambda s: s.sync.itl_ms),
        ("", "latency ms", lambda s: s.sync.latency_ms),
        ("", "out tok/s", lambda s: s.sync.output_tok_s),
    ]
    for n in sorted(all_streams):
        rows += [
            (f"concurrent {n}", "out tok/s", lambda s, n=n: s.by_streams[n].output_tok_s),
            ("", "TTFT ms", lambda s, n=n: s.by_streams[n].ttft_ms),
            ("", "TTFT p95 ms", lambda s, n=n: s.by_streams[n].ttft_p95_ms),
            ("", "ITL ms", lambda s, n=n: s.by_streams[n].itl_ms),
            ("", "latency ms", lambda s, n=n: s.by_streams[n].latency_ms),
        ]
    streams = max(all_streams)
    for profile, metric, get in rows:
        value = {x: statistics.median(get(s) for s in served[x]) for x in systems}
        line = "".join(f"{value[x]:>18.1f}" for x in systems)
        line += "".join(f"{ratio(value[x], value['vLLM']):>26}" for x in ours_names)
        print(f"{profile:<16}{metric:<16}{line}")
    for system in systems:
        runs = served[system]
        line = f"  {system}: start-up {statistics.median(s.startup_s for s in runs):.0f} s"
        profiles = [p for s in runs for p in (s.sync, *s.by_streams.values())]
        ok = sum(p.num_requests for p in profiles)
        errored = sum(p.num_errored for p in profiles)
        line += f", requests ok {ok}, errored {errored}"
        bursts = max(p.burst_share for p in profiles)
        if bursts:
            line += f", up to {bursts:.0%} of a profile's requests streamed in one burst"
        line += f"; concurrent tok/s by round {[round(s.concurrent.output_tok_s) for s in runs]}"
        if offline is not None:
            conc = statistics.median(s.concurrent.output_tok_s for s in runs)
            line += f"; served (concurrent) / offline: {ratio(conc, offline.median(system))}"
        print(line)
    print(f"CPU over the concurrent-{streams} run, ms per output token, by process (medians):")
    for system in systems:
        runs = served[system]
        roles = {role for s in runs for role in s.cpu_by_role} - {"guidellm client"}

        def ms(roles: list[str], runs: list[Served] = runs) -> float:
            return statistics.median(s.cpu_ms_per_token(roles) for s in runs)

        parts = ", ".join(f"{r} {ms([r]):.3f}" for r in sorted(roles, key=lambda r: -ms([r])))
        client = ms(["guidellm client"])
        print(f"  {system}: server {ms(sorted(roles)):.3f} ({parts}); guidellm client {client:.3f}")
        outside = sorted(roles - MODEL_ROLES)
        print(f"    outside the model ({', '.join(outside)}): {ms(outside):.3f}")
        path = sorted(roles & SERVING_PATH_ROLES)
        print(f"    of it the serving path ({', '.join(path)}): {ms(path):.3f}")
        if max(s.others_share for s in runs) >= CONTENDED:
            print(f"WARNING: other processes used the CPUs during {system}'s concurrent run(s)")


# ---- main ------------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--quick", action="store_true", help="16 short offline requests, short guidellm runs")
    add("--num-requests", type=int, default=None, help="offline requests (default 64, quick 16)")
    add("--repeats", type=int, default=3, help="offline runs per system, interleaved")
    add("--rounds", type=int, default=None, help="served sweeps per system (default 3, quick 1)")
    add("--parts", default="offline,served", help="comma-separated: offline, served")
    add("--threads", type=int, default=2, help="pagedray's torch threads offline")
    add("--server-threads", type=int, default=None, help="pagedray serve's (default: its own)")
    add("--streams", type=int, nargs="+", default=[64], help="guidellm's concurrent streams")
    add(
        "--systems",
        default="pagedray,vllm",
        help="served systems, comma-separated from pagedray, vllm, no-ray (pagedray --no-ray)",
    )
    add("--concurrent-seconds", type=float, default=None, help="each concurrent profile's limit")
    add("--seed", type=int, default=0, help="seeds the offline workload")
    add("--preset", default="small", choices=PRESETS, help="the built model")
    add("--dtype", default="float32", choices=DTYPES, help="both systems' weights and KV")
    add("--startup-timeout", type=float, default=600.0, help="seconds to wait for /health")
    add("--lora", action="store_true", help="served: every request names one LoRA adapter")
    add("--lora-rank", type=int, default=8, help="its rank (pagedray make-lora's, seeded)")
    add_vllm_args(parser)
    add("--guidellm", default="/work/clients-venv/bin/guidellm", help="guidellm executable")
    add(
        "--request-format",
        default="",
        help="guidellm's request_format (default its own: streamed /v1/chat/completions)",
    )
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    parts = {p.strip() for p in args.parts.split(",") if p.strip()}
    if parts - {"offline", "served"}:
        raise SystemExit(f"--parts: unknown {sorted(parts - {'offline', 'served'})}")
    env = vllm_env(args)
    env.check()
    if "served" in parts and not Path(args.guidellm).exists():
        raise SystemExit(f"guidellm not found at {args.guidellm}: pass --guidellm")
    num_requests = args.num_requests or (16 if args.quick else 64)
    path, workload = benchmark_workload(num_requests, args.quick, args.seed, args.preset)
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    served = args.server_threads or "its default"
    print(
        f"model {path} in {args.dtype}; pagedray {args.threads} threads offline, {served} "
        f"served; load {load}"
    )
    print(
        f"vLLM: {env.python}, KV {env.kv_space_gib} GiB, OMP bind {env.omp_bind!r}, "
        f"LD_PRELOAD {env.preload}"
    )
    offline = None
    if "offline" in parts:
        log_dir = Path(tempfile.mkdtemp(prefix="vllm_peer_offline_"))
        offline = run_cell(
            path, workload, env, args.dtype, "sharegpt", args.threads, args.repeats, args.seed,
            log_dir,
        )  # fmt: skip
        shutil.rmtree(log_dir, ignore_errors=True)  # kept, with vLLM's log, when it failed
    unknown = set(args.systems.split(",")) - set(SERVED_SYSTEMS)
    if unknown:
        raise SystemExit(f"--systems: unknown {sorted(unknown)}; from {sorted(SERVED_SYSTEMS)}")
    systems = [SERVED_SYSTEMS[name] for name in args.systems.split(",")]
    args.lora_adapter = None
    if args.lora:
        from pagedray.workers.lora_checkpoint import make_lora_adapter

        folder = Path(tempfile.mkdtemp(prefix="vllm_peer_lora_")) / LORA_NAME
        args.lora_adapter = str(make_lora_adapter(path, folder, rank=args.lora_rank))
        print(f"served: every request names a rank-{args.lora_rank} LoRA adapter", flush=True)
    served: dict[str, list[Served]] = {system: [] for system in systems}
    if "served" in parts:
        for round_idx in range(args.rounds or (1 if args.quick else 3)):
            for system in systems if round_idx % 2 == 0 else systems[::-1]:
                served[system].append(serve_sweep(system, args, env, path))
    if offline is not None:
        report([offline])
    if "served" in parts:
        report_served(served, offline, args.streams)


if __name__ == "__main__":
    main()
