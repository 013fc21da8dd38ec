"""The engine on a GPU: greedy tokens against transformers for the four architectures, then
throughput of a ~1B-parameter random Llama in bf16 against transformers' own batching.

    python benchmarks/gpu/engine_check.py equality --json out.json [--dry-run]
    python benchmarks/gpu/engine_check.py throughput --json out.json [--dry-run]

`equality`: each architecture's tiny preset (seeded, offline), fp32, three prompts, 16 greedy
tokens with EOS ignored: `LLM.generate` on CUDA must give transformers' `generate` tokens; then
random sampling on the device (seeded and unseeded rows in one batch; a seeded request draws
the same tokens alone as in the batch).
`throughput`: TinyLlama's shape (22 layers, hidden 2048, GQA 32/4, about 1.1B parameters with
this vocabulary) in bf16; 256 ShareGPT-like requests (benchmarks/offline_throughput.py's
workload, EOS ignored, greedy) through pagedray, transformers' static `generate` (batches of 64,
left-padded) and its continuous batching, one after the other in this process.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/

from offline_throughput import (  # noqa: E402
    FULL_OUTPUT,
    FULL_PROMPT,
    QUICK_OUTPUT,
    QUICK_PROMPT,
    make_workload,
    run_continuous,
    run_pagedray,
    run_static,
)

from pagedray.tools.default_model import ARCHS, make_model  # noqa: E402

TINYLLAMA_SHAPE = {
    "hidden_size": 2048,
    "intermediate_size": 5632,
    "num_hidden_layers": 22,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
}
NUM_NEW_TOKENS = 16


def equality(device: str, folder: Path) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    from pagedray import LLM, SamplingParams

    results: dict[str, Any] = {}
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)
    for arch in ARCHS:
        path = make_model(folder / arch, arch=arch, preset="tiny", seed=0)
        prompts = [[5 + (i * 7 + j) % 200 for j in range(n)] for i, n in enumerate((3, 17, 64))]
        llm = LLM(str(path), dtype="float32", device=device)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        ours = [list(out.outputs[0].token_ids) for out in outputs]
        llm.shutdown()
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()
        model.generation_config.eos_token_id = None
        theirs = []
        with torch.inference_mode():
            for prompt in prompts:
                ids = torch.tensor([prompt], device=device)
                out = model.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    max_new_tokens=NUM_NEW_TOKENS,
                    do_sample=False,
                    pad_token_id=0,
                )
                theirs.append(out[0, len(prompt) :].tolist())
        results[arch] = {"equal": ours == theirs, "pagedray": ours, "transformers": theirs}
        print(arch, "equal" if ours == theirs else "DIFFERENT", flush=True)
    results["sampled"] = sampled(device, folder / ARCHS[0])
    return results


def sampled(device: str, path: Path) -> dict[str, Any]:
    """Random sampling on the device: unseeded rows draw from the worker's generator, seeded
    ones from their own; a seeded request draws the same tokens alone as beside others."""
    from pagedray import LLM, SamplingParams

    llm = LLM(str(path), dtype="float32", device=device)
    prompt = {"prompt_token_ids": list(range(5, 25))}
    seeded = SamplingParams(temperature=1.0, seed=7, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)
    free = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)
    alone = llm.generate([prompt], seeded, use_tqdm=False)[0].outputs[0].token_ids
    batch = llm.generate([prompt, prompt, prompt], [free, seeded, free], use_tqdm=False)
    llm.shutdown()
    lengths = [len(out.outputs[0].token_ids) for out in batch]
    ok = list(batch[1].outputs[0].token_ids) == list(alone) and lengths == [NUM_NEW_TOKENS] * 3
    print("sampled", "ok" if ok else "DIFFERENT", flush=True)
    return {"equal": ok, "seeded_alone": list(alone), "lengths": lengths}


def throughput(device: str, folder: Path, dry_run: bool, json_path: str) -> dict[str, Any]:
    from transformers import AutoTokenizer

    if dry_run:
        path = make_model(folder / "llama-tiny", arch="llama", preset="tiny", seed=0)
        num_requests, dists, dtype = 8, (QUICK_PROMPT, QUICK_OUTPUT), torch.float32
    else:
        path = make_model(
            folder / "llama-1b", arch="llama", preset="small", seed=0, dtype="bfloat16",
            **TINYLLAMA_SHAPE,
        )  # fmt: skip
        num_requests, dists, dtype = 256, (FULL_PROMPT, FULL_OUTPUT), torch.bfloat16
    tokenizer = AutoTokenizer.from_pretrained(path)
    special = set(tokenizer.all_special_ids)
    vocab_ids = [i for i in range(len(tokenizer)) if i not in special]
    workload = make_workload(num_requests, *dists, vocab_ids, seed=0)
    num_params = _num_params(path)
    result: dict[str, Any] = {
        "model": str(path.name),
        "parameters": num_params,
        "dtype": str(dtype).removeprefix("torch."),
        "num_requests": num_requests,
        "output_tokens": workload.num_output_tokens,
        "systems": {},
    }
    runs = {
        "pagedray": lambda: run_pagedray(
            str(path),
            workload,
            threads=1 if device == "cpu" else None,
            device=device,
            dtype=result["dtype"],
        ),
        "transformers static (batch 64)": lambda: run_static(
            str(path), workload, batch_size=64, device=device, dtype=dtype
        ),
        "transformers continuous": lambda: run_continuous(
            str(path), workload, max_batch_tokens=8192, device=device, dtype=dtype
        ),
    }
    for name, run in runs.items():
        try:
            outcome = run()
            result["systems"][name] = {
                "seconds": outcome.wall_s,
                "output_tokens_per_s": workload.num_output_tokens / outcome.wall_s,
                "notes": outcome.notes,
            }
        except Exception as exc:  # noqa: BLE001 - one system failing is a finding, not the end
            result["systems"][name] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        print(name, json.dumps(result["systems"][name]), flush=True)
        Path(json_path).write_text(json.dumps(result, indent=2))  # a timeout keeps what ran
        if device == "cuda":
            torch.cuda.empty_cache()
    return result


def _num_params(path: Path) -> int:
    from safetensors import safe_open

    total = 0
    for file in path.glob("*.safetensors"):
        with safe_open(str(file), "pt") as tensors:
            for name in tensors.keys():  # noqa: SIM118 - safe_open has no __iter__
                total += math.prod(tensors.get_slice(name).get_shape())
    return total


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("check", choices=["equality", "throughput"])
    parser.add_argument("--json", required=True)
    parser.add_argument("--dry-run", action="store_true", help="tiny, on the CPU")
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() and not args.dry_run else "cpu"
    with tempfile.TemporaryDirectory(prefix="pagedray-gpu-") as tmp:
        if args.check == "equality":
            result = equality(device, Path(tmp))
        else:
            result = throughput(device, Path(tmp), args.dry_run, args.json)
    result = {"device": device, **result}
    Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
