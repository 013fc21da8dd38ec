"""`pagedray` command line: build the default model, generate offline, serve, push dashboards."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from pagedray.cli.config_flags import add_config_flags, config_values
from pagedray.cli.dashboard import add_dashboard_parser
from pagedray.cli.serve import add_serve_parser
from pagedray.engine.config import EngineConfig
from pagedray.llm import OFFLINE_MAX_NUM_BATCHED_TOKENS


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pagedray", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    _add_make_model(commands)
    _add_make_lora(commands)
    _add_generate(commands)
    add_serve_parser(commands)
    add_dashboard_parser(commands)
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


def _add_make_model(commands: Any) -> None:
    from pagedray.tools.default_model import ARCHS, PRESETS

    parser = commands.add_parser("make-model", help="write a seeded random HF checkpoint, offline")
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument(
        "--arch", choices=ARCHS, default=None, help="default: the preset's own, else llama"
    )
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    parser.add_argument("--seed", type=int, default=0)
    parser.set_defaults(func=_run_make_model)


def _run_make_model(args: argparse.Namespace) -> int:
    from pagedray.tools.default_model import make_model

    path = make_model(
        args.out, arch=args.arch, preset=args.preset, seed=args.seed, dtype=args.dtype
    )
    print(path)
    return 0


def _add_make_lora(commands: Any) -> None:
    from pagedray.workers.lora_checkpoint import LORA_TARGETS

    parser = commands.add_parser(
        "make-lora", help="write a seeded random LoRA adapter (PEFT format) for a model, offline"
    )
    parser.add_argument("--model", required=True, help="the base model's directory")
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--alpha", type=int, default=16)
    parser.add_argument("--targets", nargs="+", choices=LORA_TARGETS, default=list(LORA_TARGETS))
    parser.add_argument("--seed", type=int, default=0)
    parser.set_defaults(func=_run_make_lora)


def _run_make_lora(args: argparse.Namespace) -> int:
    from pagedray.workers.lora_checkpoint import make_lora_adapter

    path = make_lora_adapter(
        args.model, args.out, rank=args.rank, alpha=args.alpha, targets=args.targets,
        seed=args.seed,
    )  # fmt: skip
    print(path)
    return 0


def _add_generate(commands: Any) -> None:
    parser = commands.add_parser("generate", help="generate offline for prompts, print JSON lines")
    # The engine's settings, one flag a field, the offline `LLM`'s defaults where it has its own.
    add_config_flags(
        parser, EngineConfig, {"max_num_batched_tokens": OFFLINE_MAX_NUM_BATCHED_TOKENS}
    )
    parser.add_argument("--prompt", action="append", help="a prompt (repeatable); default: stdin")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("-n", type=int, default=1)
    parser.set_defaults(func=_run_generate)


def _run_generate(args: argparse.Namespace) -> int:
    from pagedray import LLM, SamplingParams

    prompts = args.prompt or [line.rstrip("\n") for line in sys.stdin if line.strip()]
    try:
        params = SamplingParams(
            n=args.n, max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p
        )
        llm = LLM(**config_values(args, EngineConfig))
        outputs = llm.generate(prompts, params)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    for output in outputs:
        record = {
            "prompt": output.prompt,
            "outputs": [
                {"text": o.text, "token_ids": o.token_ids, "finish_reason": o.finish_reason}
                for o in output.outputs
            ],
        }
        print(json.dumps(record))
    print(json.dumps({"stats": llm.stats()}), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
