"""What a request's output must match: a JSON schema, a regex, a choice or a grammar (vLLM's
`StructuredOutputsParams`), and its translation into an llguidance grammar.

llguidance is the grammar engine: a zero-dependency wheel whose Earley parser and lazy lexer
need no ahead-of-time mask tables, so turning a schema into a grammar takes well under a
millisecond and a per-token mask tens of microseconds (vLLM's `guidance` backend; xgrammar would
pull triton and TVM's FFI and precompile per tokenizer). A bad schema, regex or grammar is found
here, with llguidance's own message, before anything is queued.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from pagedray.scheduler.json_schema_termination import endless_reference
from pagedray.scheduler.request_failure import refusal

# Bounds on what a client can make the grammar engine do; llguidance also bounds the lexer and
# parser work per token (its `LLParserLimits` defaults).
MAX_SPEC_CHARS = 1_000_000
MAX_CHOICES = 4_096
MAX_CACHED_SPECS = 1_024
MAX_CACHED_BYTES = 64 * 2**20
_KINDS = ("json", "regex", "choice", "grammar", "json_object")
# OpenAI's own structured outputs are compact JSON. llguidance's flexible whitespace lets a
# model emit newlines and tabs between tokens, and a weak (or random) model can spend its whole
# budget there; a client who wants it asks with `whitespace_pattern`.
_COMPACT_JSON = {"whitespace_flexible": False}


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Exactly one constraint (vLLM's field names); `json` is a schema (dict or JSON text)."""

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # Lark (llguidance's dialect) or GBNF (`::=` rules)
    json_object: bool | None = None  # any JSON object
    whitespace_pattern: str | None = None  # regex for whitespace between JSON tokens

    def __post_init__(self) -> None:
        given = [kind for kind in _KINDS if getattr(self, kind) not in (None, False)]
        if len(given) != 1:
            raise refusal(
                "structured_outputs",
                "give exactly one of json, regex, choice, grammar or "
                f"json_object, got {given or 'none'}",
            )
        if self.choice is not None:
            ok = isinstance(self.choice, list) and all(isinstance(c, str) for c in self.choice)
            if not ok or not self.choice or len(self.choice) > MAX_CHOICES:
                raise refusal("structured_outputs.choice", f"must be 1 to {MAX_CHOICES} strings")
        for kind in ("regex", "grammar", "whitespace_pattern"):
            value = getattr(self, kind)
            if value is not None and not isinstance(value, str):
                raise refusal(f"structured_outputs.{kind}", "must be a string")
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise refusal("structured_outputs.json", "must be a JSON schema object")
        compiled_grammar(self.key)  # raises ValueError naming the problem (cached)

    @classmethod
    def from_fields(cls, fields: dict[str, Any]) -> StructuredOutputsParams:
        """From a JSON object of its fields (an HTTP body's); raises ValueError naming them."""
        try:
            return cls(**fields)
        except TypeError:
            known = list(cls.__dataclass_fields__)
            raise refusal("structured_outputs", f"fields must be among {known}") from None

    @property
    def key(self) -> tuple[str, str]:
        """(kind, canonical text): equal constraints share one compiled grammar."""
        if self.json is not None:
            schema = self.json if isinstance(self.json, str) else _dump(self.json)
            return ("json", _json_key(schema, self.whitespace_pattern))
        if self.json_object:
            return ("json", _json_key('{"type": "object"}', self.whitespace_pattern))
        if self.regex is not None:
            return ("regex", self.regex)
        if self.choice is not None:
            return ("choice", _dump(self.choice))
        assert self.grammar is not None
        return ("grammar", self.grammar)


def compiled_grammar(key: tuple[str, str]) -> str:
    """The llguidance grammar for a constraint's key; raises ValueError naming the problem.

    Kept in a cache bounded by count and by bytes (a spec may be a megabyte; the ingress and
    the engine each hold one)."""
    with _CACHE_LOCK:
        grammar = _CACHE.get(key)
        if grammar is not None:
            _CACHE.move_to_end(key)
            return grammar
    grammar = _compile(key)
    size = len(key[1]) + len(grammar)
    if size <= MAX_CACHED_BYTES // 16:  # no one spec may crowd out the rest
        global _cache_bytes
        with _CACHE_LOCK:
            if key not in _CACHE:
                _CACHE[key] = grammar
                _cache_bytes += size
            while len(_CACHE) > MAX_CACHED_SPECS or _cache_bytes > MAX_CACHED_BYTES:
                old_key, old_grammar = _CACHE.popitem(last=False)
                _cache_bytes -= len(old_key[1]) + len(old_grammar)
    return grammar


_CACHE: OrderedDict[tuple[str, str], str] = OrderedDict()
_CACHE_LOCK = threading.Lock()  # validation runs on the ingress's tokenizer threads
_cache_bytes = 0


def _compile(key: tuple[str, str]) -> str:
    from llguidance import LLMatcher

    kind, text = key
    field = f"structured_outputs.{kind}"
    if len(text) > MAX_SPEC_CHARS:
        raise refusal(field, f"longer than {MAX_SPEC_CHARS} characters")
    if kind == "json":
        options = json.loads(text)
        endless = endless_reference(options["schema"])
        if endless is not None:
            raise refusal(
                field,
                f"the schema admits no finite value: it refers to itself through "
                f"{endless!r} with no way to end",
            )
        try:
            grammar = LLMatcher.grammar_from_json_schema(
                options["schema"], defaults=options["defaults"]
            )
        except ValueError as exc:
            raise refusal(field, f"{exc}") from None
    elif kind == "regex":
        grammar = LLMatcher.grammar_from_regex(text)
    elif kind == "choice":
        alternatives = " | ".join(_dump(choice) for choice in json.loads(text))
        grammar = LLMatcher.grammar_from_lark(f"start: {alternatives}")
    else:
        grammar = LLMatcher.grammar_from_lark(_as_lark(text))
    is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        raise refusal(field, f"{_one_line(messages[0])}")
    return grammar


def _json_key(schema_text: str, whitespace_pattern: str | None) -> str:
    try:
        schema = json.loads(schema_text)
    except json.JSONDecodeError as exc:
        raise refusal("structured_outputs.json", f"not valid JSON ({exc.msg})") from None
    except RecursionError:
        raise refusal("structured_outputs.json", "nested too deeply") from None
    if not isinstance(schema, (dict, bool)):
        raise refusal("structured_outputs.json", "a JSON schema must be an object")
    defaults: dict[str, Any] = dict(_COMPACT_JSON)
    if whitespace_pattern is not None:
        defaults = {"whitespace_flexible": True, "whitespace_pattern": whitespace_pattern}
    return _dump({"schema": schema, "defaults": defaults})


def _as_lark(grammar: str) -> str:
    """GBNF (llama.cpp's, which vLLM's xgrammar backend takes) becomes Lark; Lark stays."""
    if re.search(r"^\s*[A-Za-z][\w-]*\s*::=", grammar, re.MULTILINE):
        from llguidance.gbnf_to_lark import gbnf_to_lark

        try:
            return gbnf_to_lark(grammar)
        except Exception as exc:  # noqa: BLE001 - the converter raises assorted errors
            raise refusal("structured_outputs.grammar", f"bad GBNF ({exc})") from None
    return grammar


def _dump(value: Any) -> str:
    # NOTE: keys keep their order: a schema's property order is the order of the output's keys.
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _one_line(message: str, limit: int = 300) -> str:
    """llguidance's message (it may draw a caret under the grammar) on one line, bounded."""
    text = " ".join(line.strip() for line in message.splitlines() if line.strip("^ \t"))
    return (text[:limit] + "...") if len(text) > limit else text or "invalid"
