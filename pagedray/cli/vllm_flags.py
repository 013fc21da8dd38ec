"""Flag values as vLLM's command line spells them (vllm/engine/arg_utils.py and
vllm/entrypoints/openai/cli_args.py), for the flags `pagedray` shares with it: a vLLM command
line then means the same here, where it names a setting this server has.
"""

from __future__ import annotations

import argparse
import json
import re

# vLLM's --dtype choices: "half" and "float" are its other names for float16 and float32.
DTYPES = ("auto", "half", "float16", "bfloat16", "float", "float32")
DTYPE_ALIASES = {"half": "float16", "float": "float32"}
_SUFFIXED = re.compile(r"(\d+(?:\.\d+)?)([kKmMgGtT])")
_DECIMAL = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
# The `build_app` arguments of `add_cors_args`' flags, named as the flags are.
CORS_ARGS = ("allowed_origins", "allowed_methods", "allowed_headers", "allow_credentials")


def human_readable_int(value: str) -> int:
    """A count as vLLM reads --max-num-batched-tokens or --kv-cache-memory-bytes: "2048", "8k"
    (8,000), "8K" (8,192), "1.5m"; decimals only with a decimal (lower-case) suffix."""
    match = _SUFFIXED.fullmatch(value.strip())
    if match is None:
        return int(value)
    number, suffix = match.groups()
    if suffix in _DECIMAL:
        return int(float(number) * _DECIMAL[suffix])
    if "." in number:
        raise argparse.ArgumentTypeError(f"{value!r}: no decimals with a binary suffix")
    return int(number) * _BINARY[suffix]


def max_model_len(value: str) -> int | None:
    """vLLM's --max-model-len: a count as `human_readable_int`, or "auto" (or -1) for the
    model's own limit, capped by what the KV pool holds: what None means here."""
    if value.strip().lower() in ("auto", "-1"):
        return None
    return human_readable_int(value)


def json_list(value: str) -> list[str]:
    """vLLM's CORS flags (--allowed-origins and the like): a JSON list of strings."""
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError:
        parsed = None
    if not isinstance(parsed, list) or not all(isinstance(item, str) for item in parsed):
        raise argparse.ArgumentTypeError(f"{value!r} is not a JSON list of strings")
    return parsed


def add_cors_args(parser: argparse.ArgumentParser) -> None:
    """vLLM's CORS flags; their defaults (None here: the app's) allow any origin, method and
    header, without credentials, as vLLM's do."""
    for what in ("origins", "methods", "headers"):
        parser.add_argument(
            f"--allowed-{what}",
            type=json_list,
            default=None,
            help=f'CORS: the {what} browsers may use, a JSON list (default ["*"])',
        )
    parser.add_argument(
        "--allow-credentials",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="CORS: let browsers send cookies and credentials (default: no)",
    )
