"""vLLM's side of `vllm_peer.py`'s offline comparison: run by vLLM's own interpreter, not ours.

Builds one `vllm.LLM`, warms it up, then runs the workload once per `run` line on stdin and writes
one JSON line per run to the file descriptor `--result-fd`; `quit` (or end of input) exits.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

# Requests whose tokens are sent back for the loose comparison with pagedray's.
NUM_RETURNED = 4


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="HF checkpoint dir")
    parser.add_argument("--workload", required=True, help="JSON file written by vllm_peer.py")
    parser.add_argument("--result-fd", type=int, required=True, help="where the JSON lines go")
    args = parser.parse_args()

    from vllm import LLM, SamplingParams

    with open(args.workload) as file:
        workload = json.load(file)
    results = os.fdopen(args.result_fd, "w")

    def send(message: dict[str, Any]) -> None:
        results.write(json.dumps(message) + "\n")
        results.flush()

    # NOTE: prefix caching off, as in pagedray's run: every repeat sends the same prompts.
    llm = LLM(model=args.model, dtype="float32", seed=0, enable_prefix_caching=False)

    def generate(prompts: list[list[int]], output_lens: list[int]) -> list[list[int]]:
        params = [SamplingParams(max_tokens=n, ignore_eos=True, temperature=0) for n in output_lens]
        inputs = [{"prompt_token_ids": p} for p in prompts]
        outputs = llm.generate(inputs, params, use_tqdm=False)
        return [list(out.outputs[0].token_ids) for out in outputs]

    generate(workload["warmup_prompts"], workload["warmup_output_lens"])  # not timed
    config = llm.llm_engine.vllm_config
    send(
        {
            "ready": True,
            "max_num_seqs": config.scheduler_config.max_num_seqs,
            "max_num_batched_tokens": config.scheduler_config.max_num_batched_tokens,
            "block_size": config.cache_config.block_size,
        }
    )
    for line in sys.stdin:
        if line.strip() != "run":
            break
        start = time.perf_counter()
        token_ids = generate(workload["prompts"], workload["output_lens"])
        wall_s = time.perf_counter() - start
        send(
            {
                "wall_s": wall_s,
                "counts": [len(t) for t in token_ids],
                "token_ids": token_ids[:NUM_RETURNED],
            }
        )


if __name__ == "__main__":
    main()
