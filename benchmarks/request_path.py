"""The request path, counted: the hops and files along one non-streamed chat request through a
real `pagedray serve` (TP = 1), as the README's request-path section lists them (issue P12).

It starts the server with a call recorder in every Ray worker process (`request_path_hook.py`),
sends one warm-up request, then records two windows of the same length in every process: one
idle, one around a single non-streamed chat completion through the `openai` SDK. A hop is a call
from one of the project's files into another's function (or from the framework into ours); what
the request window saw and the idle one did not is the request's path. It prints the hops by
process (each distinct caller -> callee pair of functions, and each distinct pair of files), the
files they touch, and the totals:

    .venv/bin/python benchmarks/request_path.py            # the default model
    .venv/bin/python benchmarks/request_path.py --list     # and every hop, caller -> callee
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import openai

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "deploy"))
from _subprocesses import command_line, pagedray_serve  # noqa: E402
from request_path_hook import CONTROL_DIR_ENV, SOURCE_ROOT_ENV  # noqa: E402

WINDOW_S = 3.0  # long enough for the request, its answer and the step loop going idle again


def ask(client: openai.OpenAI, model: str) -> None:
    client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Say hello."}],
        max_tokens=8,
        temperature=0.0,
    )


def record(control: Path, window: str, action) -> None:  # noqa: ANN001 - a thunk
    (control / "arm").touch()
    time.sleep(2 * 0.05)  # every recorder's poll sees it
    started = time.monotonic()
    action()
    time.sleep(max(0.0, WINDOW_S - (time.monotonic() - started)))
    (control / "arm").unlink()
    time.sleep(2 * 0.05)
    (control / "dump").write_text(window)
    time.sleep(1.0)
    (control / "dump").unlink()


def read_window(control: Path, window: str) -> dict[int, set[tuple[str, str]]]:
    seen = {}
    for path in control.glob(f"calls-{window}-*.json"):
        pid = int(path.stem.rsplit("-", 1)[1])
        seen[pid] = {tuple(edge) for edge in json.loads(path.read_text())}
    return seen


def process_name(pid: int) -> str:
    line = command_line(pid)
    return line.split(" ", 1)[0] if line.startswith("ray::") else line[:60]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", nargs="?", default=None, help="default: the built default model")
    parser.add_argument("--list", action="store_true", help="print every hop")
    args = parser.parse_args()
    control = Path(tempfile.mkdtemp(prefix="pdr-path-"))
    env = {
        CONTROL_DIR_ENV: str(control),
        SOURCE_ROOT_ENV: str(ROOT),
        "PYTHONPATH": str(Path(__file__).resolve().parent),
        # Ray gives the job's runtime environment to every worker it starts for the server.
        "RAY_JOB_CONFIG_JSON_ENV_VAR": json.dumps(
            {"runtime_env": {"worker_process_setup_hook": "request_path_hook.install"}}
        ),
    }
    try:
        with pagedray_serve(args.model, env=env, start_timeout_s=300) as server:
            client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
            model = client.models.list().data[0].id
            ask(client, model)  # imports, compiles and first-use paths stay out of the count
            record(control, "idle", lambda: None)
            record(control, "request", lambda: ask(client, model))
            idle, request = read_window(control, "idle"), read_window(control, "request")
            names = {pid: process_name(pid) for pid in request}
    finally:
        shutil.rmtree(control, ignore_errors=True)
    total_hops, total_file_hops, files_by_process = 0, 0, {}
    for pid, edges in sorted(request.items()):
        path = sorted(edges - idle.get(pid, set()))
        if not path:
            continue
        files = {side.split(":", 1)[0] for edge in path for side in edge} - {"(framework)"}
        file_hops = {tuple(side.split(":", 1)[0] for side in edge) for edge in path}
        files_by_process[pid] = files
        total_hops += len(path)
        total_file_hops += len(file_hops)
        print(
            f"{names[pid]} (pid {pid}): {len(path)} hops (function to function), "
            f"{len(file_hops)} from file to file, through {len(files)} files"
        )
        if args.list:
            by_caller: dict[str, list[str]] = defaultdict(list)
            for caller, callee in path:
                by_caller[caller].append(callee)
            for caller in sorted(by_caller):
                print(f"  {caller}")
                for callee in by_caller[caller]:
                    print(f"      -> {callee}")
    all_files = set().union(*files_by_process.values()) if files_by_process else set()
    print(
        f"total: {total_hops} hops, {total_file_hops} from file to file, {len(all_files)} files, "
        f"{len(files_by_process)} processes with hops"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
