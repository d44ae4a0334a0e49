"""Minimal JSON-schema instances (pure): the fake's constrained decoding.

With a `json_schema` (or a chat `response_format`) both models answer the smallest value the
schema accepts; the script also uses it to fill a shell tool's other required arguments.
"""

from __future__ import annotations

from typing import Any

import numpy as np

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
        non_null = [x for x in t if x != "null"]
        return non_null[0] if non_null else (t[0] if t else None)
    if isinstance(t, str):
        return t
    if "properties" in schema or "required" in schema:
        return "object"
    if "items" in schema or "prefixItems" in schema:
        return "array"
    return None


def _resolve_ref(ref: str, root: dict[str, Any]) -> Any:
    if not ref.startswith("#"):
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


def minimal_json_instance(schema: Any, root: Any = None, _depth: int = 0) -> Any:
    """A small value valid for `schema`: required properties only, the first enum value, `""` /
    `0` / `false` / `[]` / `null` defaults respecting simple bounds, nested objects, `$ref`,
    `anyOf`/`oneOf` (first branch) and `allOf` (merged)."""
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
                merged.setdefault("properties", {}).update(part.get("properties") or {})
                merged["required"] = list(
                    dict.fromkeys([*(merged.get("required") or []), *(part.get("required") or [])])
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
        props = schema.get("properties") or {}
        required = [r for r in schema.get("required") or [] if isinstance(r, str)]
        names = list(required)
        min_props = schema.get("minProperties") or 0
        for name in props:
            if len(names) >= min_props:
                break
            if name not in names:
                names.append(name)
        return {n: minimal_json_instance(props.get(n, {}), root, _depth + 1) for n in names}
    if t == "array":
        count = int(schema.get("minItems") or 0)
        prefix = schema.get("prefixItems") or []
        items = schema.get("items", {})
        out = [minimal_json_instance(p, root, _depth + 1) for p in prefix[:count]]
        while len(out) < count:
            out.append(minimal_json_instance(items if isinstance(items, dict) else {}, root, _depth + 1))
        return out
    if t == "string":
        fmt = schema.get("format")
        if isinstance(fmt, str) and fmt in _FORMAT_EXAMPLES:
            return _FORMAT_EXAMPLES[fmt]
        return "a" * int(schema.get("minLength") or 0)
    if t in ("integer", "number"):
        value: float = 0
        if "minimum" in schema:
            value = max(value, schema["minimum"])
        if "exclusiveMinimum" in schema and isinstance(schema["exclusiveMinimum"], int | float):
            value = max(value, schema["exclusiveMinimum"] + 1)
        if "maximum" in schema and value > schema["maximum"]:
            value = schema["maximum"]
        if t == "integer":
            value = int(np.ceil(value))
        return value
    if t == "boolean":
        return False
    if t == "null":
        return None
    return None
