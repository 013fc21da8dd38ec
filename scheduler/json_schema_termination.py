"""Whether a JSON schema admits any finite value: a `$ref` cycle with no way out cannot.

A schema that refers to itself is fine while some branch ends (a tree whose `children` may be
empty). One that never can (a `$ref` loop, an object whose required property is the object
again, an array of at least one of itself) compiles in llguidance, but its matcher either has no
token to allow at the first step or lets the output nest until `max_tokens`: a failed request,
with the grammar engine's state in the log. Refused here instead, as a 400 naming the field.

The analysis is sound for refusal: it calls a schema endless only when every alternative it
allows is proved to need an endless value. Keywords it does not model count as satisfiable.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import unquote


def endless_reference(schema: Any) -> str | None:
    """The `$ref` (a JSON pointer) through which `schema` admits no finite value; None when it
    admits one, or when it holds no such cycle that can be told."""
    pointers = _reachable_pointers(schema)
    finite = {pointer: False for pointer in pointers}
    # Least fixpoint: a pointer is finite once its target is, with what is known so far.
    changed = True
    while changed:
        changed = False
        for pointer in pointers:
            if not finite[pointer] and _finite(_resolve(schema, pointer), schema, finite):
                finite[pointer] = changed = True
    if _finite(schema, schema, finite):
        return None
    return next((pointer for pointer in pointers if not finite[pointer]), "#")


def _finite(node: Any, root: Any, finite: dict[str, bool]) -> bool:
    """Whether `node` admits a finite value, taking `finite` for what each `$ref` target does."""
    if isinstance(node, bool):
        return node
    if not isinstance(node, dict):
        return True  # not a schema: llguidance refuses it with its own message
    ref = node.get("$ref")
    if isinstance(ref, str) and not finite.get(ref, True):
        return False
    if not all(_finite(sub, root, finite) for sub in _list(node.get("allOf"))):
        return False
    for key in ("anyOf", "oneOf"):
        if key in node and not any(_finite(sub, root, finite) for sub in _list(node[key])):
            return False
    if "enum" in node or "const" in node:
        return True
    types = node.get("type")
    allowed = [types] if isinstance(types, str) else types if isinstance(types, list) else None
    if allowed is None or any(kind not in ("object", "array") for kind in allowed):
        # Untyped: a string or a number satisfies its object and array keywords. A type it does
        # not know is llguidance's to refuse, with its own reason.
        return True
    return ("object" in allowed and _finite_object(node, root, finite)) or (
        "array" in allowed and _finite_array(node, root, finite)
    )


def _finite_object(node: dict[str, Any], root: Any, finite: dict[str, bool]) -> bool:
    properties = node.get("properties")
    properties = properties if isinstance(properties, dict) else {}
    extra = node.get("additionalProperties", True)
    for name in _list(node.get("required")):
        sub = properties.get(name, extra) if isinstance(name, str) else True
        if not _finite(sub, root, finite):
            return False
    return True


def _finite_array(node: dict[str, Any], root: Any, finite: dict[str, bool]) -> bool:
    min_items = node.get("minItems", 0)
    if not isinstance(min_items, int) or min_items <= 0:
        return True
    prefix = _list(node.get("prefixItems"))
    if not all(_finite(sub, root, finite) for sub in prefix[:min_items]):
        return False
    return min_items <= len(prefix) or _finite(node.get("items", True), root, finite)


def _reachable_pointers(root: Any) -> list[str]:
    """Every local `$ref` reachable from the root, through the subschemas and the targets."""
    pointers: list[str] = []
    pending = [root]
    seen_nodes: set[int] = set()
    while pending:
        node = pending.pop()
        if isinstance(node, list):
            pending.extend(node)
            continue
        if not isinstance(node, dict) or id(node) in seen_nodes:
            continue
        seen_nodes.add(id(node))
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#") and ref not in pointers:
            pointers.append(ref)
            pending.append(_resolve(root, ref))
        pending.extend(value for key, value in node.items() if key not in ("enum", "const"))
    return pointers


def _resolve(root: Any, pointer: str) -> Any:
    """The subschema a local JSON pointer names; True (satisfiable) if it names none."""
    node = root
    for part in pointer[1:].lstrip("/").split("/") if pointer not in ("#", "#/") else []:
        key = unquote(part).replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and key in node:
            node = node[key]
        elif isinstance(node, list) and key.isdigit() and int(key) < len(node):
            node = node[int(key)]
        else:
            return True
    return node


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []
