"""vLLM's side of `vllm_peer.py`'s offline comparison: run by vLLM's own interpreter, not ours.

Builds one `vllm.LLM` (timed: the load time), warms it up, then runs the workload once per `run`
line on stdin and writes one JSON line per run to the file descriptor `--result-fd`; `quit` (or end
of input) exits. A workload with "runs" (a list of {"prompts", "output_lens"}) takes them in turn,
one a `run`; otherwise every run sends "prompts" again.
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
    parser.add_argument("--dtype", default="float32", help="the model's dtype")
    parser.add_argument("--prefix-caching", action="store_true", help="vLLM's default: on")
    parser.add_argument("--lora-paths", default="[]", help="JSON list: adapters taken in turn")
    parser.add_argument("--max-lora-rank", type=int, default=16)
    args = parser.parse_args()

    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    with open(args.workload) as file:
        workload = json.load(file)
    results = os.fdopen(args.result_fd, "w")

    def send(message: dict[str, Any]) -> None:
        results.write(json.dumps(message) + "\n")
        results.flush()

    # NOTE: prefix caching as pagedray's run has it: off where every repeat sends the same prompts.
    start = time.perf_counter()
    adapters = json.loads(args.lora_paths)
    lora_args: dict[str, Any] = {}
    if adapters:
        lora_args = {
            "enable_lora": True,
            "max_loras": len(adapters),
            "max_cpu_loras": len(adapters),
            "max_lora_rank": args.max_lora_rank,
        }
    llm = LLM(
        model=args.model,
        dtype=args.dtype,
        seed=0,
        enable_prefix_caching=args.prefix_caching,
        **lora_args,
    )
    load_s = time.perf_counter() - start
    runs = workload.get("runs") or [workload]

    def generate(prompts: list[list[int]], output_lens: list[int]) -> list[list[int]]:
        params = [SamplingParams(max_tokens=n, ignore_eos=True, temperature=0) for n in output_lens]
        inputs = [{"prompt_token_ids": p} for p in prompts]
        lora = None
        if adapters:
            count = len(adapters)
            lora = [
                LoRARequest(f"a{i % count}", i % count + 1, adapters[i % count])
                for i in range(len(prompts))
            ]
        outputs = llm.generate(inputs, params, use_tqdm=False, lora_request=lora)
        return [list(out.outputs[0].token_ids) for out in outputs]

    generate(workload["warmup_prompts"], workload["warmup_output_lens"])  # not timed
    config = llm.llm_engine.vllm_config
    send(
        {
            "ready": True,
            "max_num_seqs": config.scheduler_config.max_num_seqs,
            "max_num_batched_tokens": config.scheduler_config.max_num_batched_tokens,
            "block_size": config.cache_config.block_size,
            "load_s": load_s,
        }
    )
    for index, line in enumerate(sys.stdin):
        if line.strip() != "run":
            break
        run = runs[index % len(runs)]
        start = time.perf_counter()
        token_ids = generate(run["prompts"], run["output_lens"])
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
