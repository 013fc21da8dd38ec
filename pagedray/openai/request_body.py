"""A request body decoded as strict JSON: UTF-8, bounded nesting, no lone surrogates.

`json.loads` alone lets three kinds of body through to fail later as 500s: bytes that are not
UTF-8 (a UnicodeDecodeError, not a JSONDecodeError), arrays nested thousands deep (a
RecursionError in the parser, or in whatever walks the value after it) and `"\\ud800"` escapes,
which decode to a lone surrogate that no tokenizer, hash or encoder accepts. Each is a 400 here,
naming the field where one can be named.
"""

from __future__ import annotations

import json
from typing import Any

from pagedray.engine.unicode_text import has_lone_surrogate

# Deeper than any OpenAI body (messages → content parts → text is 4) by a wide margin.
MAX_JSON_DEPTH = 64


class BodyError(ValueError):
    """A body that cannot be a request: "field: message", with the top-level field as `param`."""

    def __init__(self, message: str, param: str | None = "body") -> None:
        super().__init__(message)
        self.param = param


def parse_json_body(raw: bytes, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """Decode `raw` as one JSON value; raises BodyError on anything a route should not see."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BodyError(f"body: invalid UTF-8 at byte {exc.start}") from None
    try:
        value = json.loads(text)
    except RecursionError:
        raise BodyError(f"body: JSON nested deeper than {max_depth} levels") from None
    except json.JSONDecodeError as exc:
        raise BodyError(f"body: invalid JSON ({exc.msg})") from None
    check_json_value(value, max_depth)
    return value


def check_json_value(value: Any, max_depth: int = MAX_JSON_DEPTH) -> None:
    """Raise BodyError if `value` nests deeper than `max_depth` or holds a lone surrogate.

    Iterative (an explicit stack), so a deep value cannot exhaust the interpreter's stack here.
    """
    stack: list[tuple[Any, tuple[str | int, ...]]] = [(value, ())]
    while stack:
        item, path = stack.pop()
        if isinstance(item, str):
            if has_lone_surrogate(item):
                raise _surrogate_error(path)
            continue
        if not isinstance(item, (dict, list)):
            continue
        if len(path) >= max_depth:
            raise BodyError(f"body: JSON nested deeper than {max_depth} levels")
        if isinstance(item, dict):
            for key, child in item.items():
                if has_lone_surrogate(key):
                    raise _surrogate_error((*path, key))
                if isinstance(child, (str, dict, list)):
                    stack.append((child, (*path, key)))
        else:
            stack.extend(
                (child, (*path, i))
                for i, child in enumerate(item)
                if isinstance(child, (str, dict, list))
            )


def _surrogate_error(path: tuple[str | int, ...]) -> BodyError:
    if not path:
        return BodyError("body: contains a lone surrogate (invalid Unicode)")
    location = ".".join(_printable(part) for part in path)
    param = _printable(path[0])
    return BodyError(f"{location}: contains a lone surrogate (invalid Unicode)", param=param)


def _printable(part: str | int) -> str:
    """A path element fit for an error message: a key with a surrogate is shown escaped."""
    return str(part).encode("utf-8", "backslashreplace").decode("utf-8")
