"""Schemas that admit no finite value are refused before a request is queued; recursive schemas
that can end are not (scheduler/json_schema_termination.py)."""

from __future__ import annotations

from typing import Any

import pytest

from pagedray.scheduler.json_schema_termination import endless_reference
from pagedray.scheduler.structured_outputs import StructuredOutputsParams

NODE = {"type": "object", "properties": {"child": {"$ref": "#/$defs/node"}}}


def needs(key: str, target: str) -> dict[str, Any]:
    return {"type": "object", "required": [key], "properties": {key: {"$ref": target}}}


ENDLESS = {
    "a $ref loop": ({"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}, "#/$defs/a"),
    "a required self": (
        {"$ref": "#/$defs/node", "$defs": {"node": {**NODE, "required": ["child"]}}},
        "#/$defs/node",
    ),
    "a non-empty array of itself": ({"type": "array", "minItems": 1, "items": {"$ref": "#"}}, "#"),
    "all of itself": ({"allOf": [{"$ref": "#"}]}, "#"),
    "two objects requiring each other": (
        {
            "$ref": "#/definitions/a",
            "definitions": {
                "a": needs("b", "#/definitions/b"),
                "b": needs("a", "#/definitions/a"),
            },
        },
        "#/definitions/a",
    ),
}  # fmt: skip

ENDING = {
    "an optional self": {"$ref": "#/$defs/node", "$defs": {"node": NODE}},
    "a tree": {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "kids": {"type": "array", "items": {"$ref": "#"}},
        },
        "required": ["name", "kids"],
    },
    "a way out in anyOf": {"anyOf": [{"$ref": "#"}, {"type": "string"}]},
    "untyped: a string satisfies it": {
        "$ref": "#/$defs/n",
        "$defs": {"n": {"properties": {"c": {"$ref": "#/$defs/n"}}, "required": ["c"]}},
    },
    "an enum": {"enum": [1, 2], "$defs": {"x": {"$ref": "#/$defs/x"}}},
    "a ref to nothing": {"$ref": "#/$defs/missing"},
    "a misspelt type": {"type": "strin"},
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(ENDLESS))
def test_endless_schemas_are_found_and_refused(name: str) -> None:
    schema, through = ENDLESS[name]
    assert endless_reference(schema) == through
    with pytest.raises(ValueError, match=r"^structured_outputs\.json: the schema admits no finite"):
        StructuredOutputsParams(json=schema)


@pytest.mark.parametrize("name", sorted(ENDING))
def test_recursive_schemas_that_can_end_pass(name: str) -> None:
    schema: Any = ENDING[name]
    assert endless_reference(schema) is None
    if name not in ("a ref to nothing", "a misspelt type"):  # llguidance's own refusals
        StructuredOutputsParams(json=schema)
