"""The GPU readiness kit's driver: every check of the GPU path in one call, each stage in its own
process with its own time budget, all inside `TOTAL_BUDGET_S`, results in `--out`.

A GPU is lent for minutes, with nothing reachable from it: this must run once, unattended, and
leave figures even when a stage fails or runs out of time (its process is killed, what it wrote
so far is kept, the next stage runs). Stages, most important first:

  env           device, driver, versions, memory
  kernels       `pytest -m gpu` (tests/attention/test_triton_gpu.py): every Triton kernel
                against the torch reference in fp16, bf16 and fp32
  equality      greedy tokens of `LLM.generate` on CUDA against transformers, four architectures,
                and random sampling on the device
  decode_table  the paged decode kernel's time and bandwidth against a device copy, SDPA over a
                gathered cache and flex_attention (benchmarks/gpu/decode_table.py)
  throughput    a ~1B random Llama in bf16: pagedray against transformers' static and continuous
                batching on 256 ShareGPT-like requests (benchmarks/gpu/engine_check.py)
  host_tier     saving blocks from the device pool into the node's host KV tier and loading them
                back, against a pinned device-to-host copy (benchmarks/gpu/host_tier_check.py)

Writes `results.json`, `results.md` and `kit.log` (each stage's output) to `--out`. `--dry-run`
runs the same stages on the CPU with tiny shapes (the torch reference in place of the GPU
kernels), which `.ci/run` does so the kit cannot rot. Exit status 1 if any stage failed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
import xml.etree.ElementTree as ElementTree
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from results_report import markdown

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
# Well inside the 10 minutes a lent machine allows one call; stages past it are skipped.
TOTAL_BUDGET_S = 480.0
DRY_RUN_BUDGET_S = 900.0  # the CPU interpreter is slow; CI has the time
MIN_STAGE_S = 15.0  # a stage with less left than this is skipped, with a note


@dataclass(frozen=True)
class Stage:
    name: str
    budget_s: float  # on a GPU; the dry run scales it by DRY_RUN_BUDGET_S / TOTAL_BUDGET_S
    args: tuple[str, ...]  # the command after the Python executable; {json} is its output


STAGES = (
    Stage("kernels", 150.0, ("-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider",
                             "tests/attention/test_triton_gpu.py", "--junitxml={json}")),
    Stage("equality", 80.0, (str(HERE / "engine_check.py"), "equality", "--json", "{json}")),
    Stage("decode_table", 90.0, (str(HERE / "decode_table.py"), "--json", "{json}")),
    Stage("throughput", 150.0, (str(HERE / "engine_check.py"), "throughput", "--json", "{json}")),
    Stage("host_tier", 30.0, (str(HERE / "host_tier_check.py"), "--json", "{json}")),
)  # fmt: skip


def environment() -> dict[str, Any]:
    import torch

    env: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cpu_count": os.cpu_count(),
    }
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env["device"] = props.name
        env["compute_capability"] = f"{props.major}.{props.minor}"
        env["memory_gib"] = round(props.total_memory / 2**30, 1)
        env["multiprocessors"] = props.multi_processor_count
    else:
        env["device"] = "cpu"
    return env


def run_stage(stage: Stage, deadline: float, out: Path, dry_run: bool, log: Any) -> dict[str, Any]:
    """Runs one stage's process within its budget and what is left of the total."""
    scale = DRY_RUN_BUDGET_S / TOTAL_BUDGET_S if dry_run else 1.0
    left = deadline - time.monotonic()
    timeout = min(stage.budget_s * scale, left - 5.0)
    if timeout < MIN_STAGE_S:
        return {"status": "skipped", "note": f"budget spent ({left:.0f} s left of the total)"}
    suffix = ".xml" if stage.name == "kernels" else ".json"
    data_path = out / f".{stage.name}{suffix}"
    data_path.unlink(missing_ok=True)
    command = [sys.executable, *(a.replace("{json}", str(data_path)) for a in stage.args)]
    if dry_run and stage.name != "kernels":
        command.append("--dry-run")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if dry_run:
        env["PAGEDRAY_GPU_DRY_RUN"] = "1"
    start = time.monotonic()
    log.write(f"\n===== {stage.name}: {' '.join(command)}\n")
    log.flush()
    try:
        proc = subprocess.run(
            command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout
        )
        status = "ok" if proc.returncode == 0 else f"failed (exit {proc.returncode})"
    except subprocess.TimeoutExpired:
        status = f"timed out after {timeout:.0f} s"
    result: dict[str, Any] = {"status": status, "seconds": round(time.monotonic() - start, 1)}
    if data_path.exists():
        text = data_path.read_text()
        result["data"] = _junit(text) if suffix == ".xml" else json.loads(text or "{}")
        data_path.unlink()
    return result


def _junit(text: str) -> dict[str, Any]:
    """pytest's junit XML as counts and the failing tests' names and first message line."""
    suite = ElementTree.fromstring(text)
    suite = suite.find("testsuite") if suite.tag == "testsuites" else suite
    assert suite is not None
    failures = []
    for case in suite.iter("testcase"):
        for problem in (*case.findall("failure"), *case.findall("error")):
            message = (problem.get("message") or "").splitlines()[:1]
            failures.append({"test": case.get("name"), "message": " ".join(message)[:300]})
    return {key: int(suite.get(key, 0)) for key in ("tests", "failures", "errors", "skipped")} | {
        "failed": failures
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="folder for results.json/.md and kit.log")
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU")
    parser.add_argument("--stages", default=",".join(s.name for s in STAGES))
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + (DRY_RUN_BUDGET_S if args.dry_run else TOTAL_BUDGET_S)
    results: dict[str, Any] = {
        "dry_run": args.dry_run,
        "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "env": environment(),
        "stages": {},
    }
    wanted = args.stages.split(",")
    with open(out / "kit.log", "w") as log:
        for stage in STAGES:
            if stage.name in wanted:
                results["stages"][stage.name] = run_stage(stage, deadline, out, args.dry_run, log)
                _write(out, results)
                print(f"{stage.name}: {results['stages'][stage.name]['status']}", flush=True)
    _write(out, results)
    return 0 if all(_passed(r) for r in results["stages"].values()) else 1


def _passed(result: dict[str, Any]) -> bool:
    if result["status"] != "ok":
        return False
    data = result.get("data", {})
    if "failures" in data:  # the kernel tests
        return not data["failures"] and not data["errors"]
    return all(arch.get("equal", True) for arch in data.values() if isinstance(arch, dict))


def _write(out: Path, results: dict[str, Any]) -> None:
    (out / "results.json").write_text(json.dumps(results, indent=2))
    (out / "results.md").write_text(markdown(results))


if __name__ == "__main__":
    raise SystemExit(main())
