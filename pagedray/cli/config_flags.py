"""Command-line flags made from a settings schema (`EngineConfig`, `ServerConfig`): one flag per
field, `--field-name` unless the field names its own (vLLM's `-tp`, `--num-gpu-blocks-override`),
its help the field's description, its choices the field's, booleans with their `--no-` forms.

A flag left out sets nothing, so the schema's default stands; the values are strings, which the
schema validates (and reads as vLLM does: `--max-model-len 32k`, `--dtype half`), so a bad value
is refused with the field's own message.
"""

from __future__ import annotations

import argparse
import types
import typing
from typing import Any, Literal

from pydantic import BaseModel
from pydantic.fields import FieldInfo


def add_config_flags(
    parser: argparse.ArgumentParser,
    schema: type[BaseModel],
    defaults: dict[str, Any] | None = None,
) -> None:
    """A flag for each field of `schema` that is one (see `engine/config.py`'s `flags`);
    `defaults` are what the command puts in place of the schema's (shown in the help)."""
    for name, field in schema.model_fields.items():
        spec = _cli_spec(field)
        if spec is None:
            continue
        # NOTE: argparse reads help as a %-format ("9% of ..." broke `--help`): escaped.
        description = (field.description or name).replace("%", "%%")
        if spec.get("positional"):
            parser.add_argument(name, nargs="?", default=argparse.SUPPRESS, help=description)
            continue
        help_text = description
        if "default" not in help_text:
            shown = (defaults or {}).get(name, _shown_default(field))
            help_text += f" (default: {str(shown).replace('%', '%%')})"
        names = spec.get("flags") or ["--" + name.replace("_", "-")]
        options: dict[str, Any] = {"dest": name, "default": argparse.SUPPRESS, "help": help_text}
        kind = _kind(field.annotation)
        if kind is bool:
            options["action"] = argparse.BooleanOptionalAction
        else:
            options["metavar"] = names[0].lstrip("-").upper().replace("-", "_")
        if kind is list and not spec.get("json"):
            options["nargs"] = "+"
        elif isinstance(kind, tuple):  # a Literal's values
            options["choices"] = [*kind, *spec.get("choices", [])]
        parser.add_argument(*names, **options)


def config_values(args: argparse.Namespace, schema: type[BaseModel]) -> dict[str, Any]:
    """The fields of `schema` that its flags (`add_config_flags`) set in `args`."""
    given = vars(args)
    return {
        name: given[name]
        for name, field in schema.model_fields.items()
        if name in given and _cli_spec(field) is not None
    }


def _cli_spec(field: FieldInfo) -> dict[str, Any] | None:
    extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
    if "cli" in extra:
        return extra["cli"]  # type: ignore[return-value]
    return {}


def _kind(annotation: Any) -> Any:
    """bool, list, a Literal's values, or None (a value the schema parses from its text)."""
    args = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType) and len(args) == 1:
        annotation = args[0]
    if annotation is bool:
        return bool
    if typing.get_origin(annotation) is list:
        return list
    if typing.get_origin(annotation) is Literal:
        return tuple(str(value) for value in typing.get_args(annotation))
    return None


def _shown_default(field: FieldInfo) -> str:
    if field.is_required():
        return "required"
    default = field.get_default(call_default_factory=True)
    return "none" if default is None else str(default)
