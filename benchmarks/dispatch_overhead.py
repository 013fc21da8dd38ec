"""Per-step dispatch overhead of the Ray executor: actor calls, a Compiled Graph, named pipes.

Each round trip sends an empty `SchedulerOutput` (no tokens scheduled: the workers update an
empty batch and return at once) to every tensor-parallel rank and waits for rank 0's output,
so what is timed is the dispatch itself, not the model. Per path it prints the median over
rounds of each round's median step time, and the best round:

    .venv/bin/python benchmarks/dispatch_overhead.py              # TP=2, 3 x 200 steps per path
    .venv/bin/python benchmarks/dispatch_overhead.py --steps 1000 --address auto
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

from pagedray.cluster.placement import ensure_ray
from pagedray.cluster.ray_executor import DISPATCHES, RayExecutor
from pagedray.scheduler.messages import CachedRequestData, SchedulerOutput
from pagedray.tools.default_model import make_model
from pagedray.workers.worker_config import WorkerConfig


def empty_step(step_id: int) -> SchedulerOutput:
    return SchedulerOutput(
        step_id=step_id,
        scheduled_new_reqs=[],
        scheduled_cached_reqs=CachedRequestData(),
        num_scheduled_tokens={},
        total_num_scheduled_tokens=0,
        blocks_to_copy=[],
        finished_req_ids=[],
    )


def measure(executor: RayExecutor, steps: int, warmup: int) -> list[float]:
    """Seconds per round trip, one entry per timed step."""
    for step_id in range(warmup):
        executor.execute_model(empty_step(step_id))
    times = []
    for step_id in range(warmup, warmup + steps):
        plan = empty_step(step_id)
        start = time.perf_counter()
        output = executor.execute_model(plan)
        times.append(time.perf_counter() - start)
        assert output.step_id == step_id
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=2, help="tensor_parallel_size")
    parser.add_argument("--steps", type=int, default=200, help="timed round trips per path")
    parser.add_argument("--warmup", type=int, default=50, help="untimed round trips first")
    parser.add_argument("--rounds", type=int, default=3, help="fresh executors per path")
    parser.add_argument("--address", default=None, help='Ray to join ("auto"); default local')
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda", "auto"))
    args = parser.parse_args()

    ensure_ray(args.address, min_cpus=1 + args.tp)
    with tempfile.TemporaryDirectory() as tmp:
        model = str(make_model(tmp, "llama", "tiny"))
        config = WorkerConfig(
            model,
            dtype="float32",
            tensor_parallel_size=args.tp,
            max_num_seqs=8,
            max_model_len=256,
            num_kv_blocks=16,
            device=args.device,
        )
        print(f"TP={args.tp}, {args.steps} steps after {args.warmup} warm-up, empty plans")
        medians: dict[str, list[float]] = {dispatch: [] for dispatch in DISPATCHES}
        # Paths alternate round by round, so a burst of load elsewhere hits them all alike.
        for _ in range(args.rounds):
            for dispatch in DISPATCHES:
                executor = RayExecutor(config, dispatch=dispatch)
                assert executor.dispatch == dispatch, f"{dispatch} fell back to {executor.dispatch}"
                try:
                    times = measure(executor, args.steps, args.warmup)
                finally:
                    executor.shutdown()
                medians[dispatch].append(statistics.median(times) * 1e6)
        for dispatch, values in medians.items():
            rounds = ", ".join(f"{value:.0f}" for value in values)
            print(
                f"{dispatch:>9}: median {statistics.median(values):7.1f} µs/step   "
                f"best round {min(values):7.1f} µs/step   (rounds: {rounds})"
            )


if __name__ == "__main__":
    main()
