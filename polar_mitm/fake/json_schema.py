"""Minimal JSON-schema instances (pure): the fake's constrained decoding.

With a `json_schema` (or a chat `response_format`) both models answer a small value the schema
accepts (only required properties, the first enum value, bounds honoured); the script also uses
it to fill a shell tool's other required arguments.
"""

from __future__ import annotations

import math
from typing import Any

_FORMAT_EXAMPLES = {
    "date-time": "1970-01-01T00:00:00Z",
    "date": "1970-01-01",
    "time": "00:00:00Z",
    "email": "a@example.com",
    "uri": "https://example.com",
    "url": "https://example.com",
    "uuid": "00000000-0000-0000-0000-000000000000",
    "ipv4": "127.0.0.1",
    "ipv6": "::1",
    "hostname": "example.com",
}


def _schema_type(schema: Any) -> str | None:
    if not isinstance(schema, dict):
        return None
    t = schema.get("type")
    if isinstance(t, list):
        names = [x for x in t if isinstance(x, str)]
        non_null = [x for x in names if x != "null"]
        return non_null[0] if non_null else (names[0] if names else None)
    if isinstance(t, str):
        return t
    if "properties" in schema or "required" in schema:
        return "object"
    if "items" in schema or "prefixItems" in schema:
        return "array"
    return None


def _resolve_ref(ref: Any, root: Any) -> Any:
    if not isinstance(ref, str) or not ref.startswith("#"):
        return {}
    node: Any = root
    for part in ref.lstrip("#").strip("/").split("/"):
        if not part:
            continue
        part = part.replace("~1", "/").replace("~0", "~")
        if not isinstance(node, dict) or part not in node:
            return {}
        node = node[part]
    return node


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _names(value: Any) -> list[str]:
    """The strings of a `required` list (anything else in it, or instead of it, left out)."""
    return [v for v in value if isinstance(v, str)] if isinstance(value, list) else []


def _int(value: Any) -> int | None:
    return int(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _bound(schema: dict[str, Any], inclusive: str, exclusive: str) -> tuple[float | None, bool]:
    """(limit, open) from `minimum`/`exclusiveMinimum` (or the maximum pair); draft 4 writes
    `exclusiveMinimum: true` beside `minimum`. The tighter of the two wins."""
    closed = schema.get(inclusive)
    closed = closed if isinstance(closed, int | float) and not isinstance(closed, bool) else None
    excl = schema.get(exclusive)
    if excl is True and closed is not None:
        return closed, True
    if isinstance(excl, int | float) and not isinstance(excl, bool):
        if closed is None or (excl >= closed if inclusive == "minimum" else excl <= closed):
            return excl, True
    return closed, False


def _number(schema: dict[str, Any], *, integer: bool) -> int | float:
    """1 where the bounds allow it, else the value nearest to it inside them. Not 0: numbers in
    real schemas are mostly counts, sizes and scores, and a harness may check more than its schema
    says (Gemini CLI's router wants a complexity_score from 1 to 100, said only in a description)."""
    lo, lo_open = _bound(schema, "minimum", "exclusiveMinimum")
    hi, hi_open = _bound(schema, "maximum", "exclusiveMaximum")
    if integer:
        lo = None if lo is None else (math.floor(lo) + 1 if lo_open else math.ceil(lo))
        hi = None if hi is None else (math.ceil(hi) - 1 if hi_open else math.floor(hi))
        lo_open = hi_open = False
    value: float = 1
    if lo is not None and (value < lo or (lo_open and value <= lo)):
        value = lo + 1 if lo_open else lo
    if hi is not None and (value > hi or (hi_open and value >= hi)):
        value = hi - 1 if hi_open else hi
        if lo is not None and (value < lo or (lo_open and value <= lo)):  # a narrow open range
            value = (lo + hi) / 2
    step = schema.get("multipleOf")
    if isinstance(step, int | float) and not isinstance(step, bool) and step > 0:
        value = math.ceil(value / step) * step
    if integer or float(value).is_integer():
        return int(value)
    return value


def minimal_json_instance(schema: Any, root: Any = None, _depth: int = 0) -> Any:
    """A small value valid for `schema`: required properties only, the first enum value, `""` /
    `1` / `false` / `[]` / `null` defaults respecting bounds (minimum, maximum and their exclusive
    forms, multipleOf, minLength/maxLength, minItems/maxItems, minProperties), nested objects,
    `$ref`, `anyOf`/`oneOf` (first branch) and `allOf` (merged)."""
    root = schema if root is None else root
    if _depth > 32 or schema is True or schema is None:
        return {} if _depth == 0 else None
    if not isinstance(schema, dict):
        return None
    if "$ref" in schema:
        return minimal_json_instance(_resolve_ref(schema["$ref"], root), root, _depth + 1)
    if "const" in schema:
        return schema["const"]
    if isinstance(schema.get("enum"), list) and schema["enum"]:
        return schema["enum"][0]
    if isinstance(schema.get("allOf"), list) and schema["allOf"]:
        merged: dict[str, Any] = {k: v for k, v in schema.items() if k != "allOf"}
        for part in schema["allOf"]:
            part = _resolve_ref(part["$ref"], root) if isinstance(part, dict) and "$ref" in part else part
            if isinstance(part, dict):
                merged["properties"] = {**_dict(merged.get("properties")), **_dict(part.get("properties"))}
                merged["required"] = list(
                    dict.fromkeys([*_names(merged.get("required")), *_names(part.get("required"))])
                )
                for k, v in part.items():
                    if k not in ("properties", "required"):
                        merged.setdefault(k, v)
        return minimal_json_instance(merged, root, _depth + 1)
    for key in ("anyOf", "oneOf"):
        options = schema.get(key)
        if isinstance(options, list) and options:
            non_null = [o for o in options if not (isinstance(o, dict) and o.get("type") == "null")]
            return minimal_json_instance((non_null or options)[0], root, _depth + 1)
    t = _schema_type(schema)
    if t == "object" or (t is None and _depth == 0):
        props = _dict(schema.get("properties"))
        names = _names(schema.get("required"))
        min_props = _int(schema.get("minProperties")) or 0
        for name in props:
            if len(names) >= min_props:
                break
            if name not in names:
                names.append(name)
        return {n: minimal_json_instance(props.get(n, {}), root, _depth + 1) for n in names}
    if t == "array":
        count = _int(schema.get("minItems")) or 0
        if (most := _int(schema.get("maxItems"))) is not None:
            count = min(count, most)
        prefix_items = schema.get("prefixItems")
        prefix = prefix_items if isinstance(prefix_items, list) else []
        items = schema.get("items", {})
        out = [minimal_json_instance(p, root, _depth + 1) for p in prefix[:count]]
        while len(out) < count:
            out.append(minimal_json_instance(items if isinstance(items, dict) else {}, root, _depth + 1))
        return out
    if t == "string":
        fmt = schema.get("format")
        if isinstance(fmt, str) and fmt in _FORMAT_EXAMPLES:
            return _FORMAT_EXAMPLES[fmt]
        length = _int(schema.get("minLength")) or 0
        if (most := _int(schema.get("maxLength"))) is not None:
            length = min(length, most)
        return "a" * length
    if t in ("integer", "number"):
        return _number(schema, integer=t == "integer")
    if t == "boolean":
        return False
    if t == "null":
        return None
    return None
