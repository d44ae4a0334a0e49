"""Reading a harness's request body safely: the JSON itself, and fields whose type is checked.

Every style parses its native body with these, so a malformed body is refused the same way in
each: a 400 (`InvalidRequest`) whose message starts with the path of the field at fault
(`tools.0.input_schema: must be an object`), written in the style's own error shape by its
`render_error`. `loads` guards what `json.loads` alone would let through into the rest of the
gateway: nesting deep enough to exhaust the stack, and lone UTF-16 surrogates (`"\\ud800"`), which
JSON allows as escapes but no text encoding can write, so hashing, tokenizing or storing them
fails far from the request that carried them. Both are refused before any style sees the body.
"""

from __future__ import annotations

import json
import re
from typing import Any

import numpy as np

from polar_mitm.neutral import ProviderError

# Deeper than any real request (JSON Schemas of MCP tools nest a few dozen levels); shallow enough
# that every recursive reader downstream (schema conversion, templates' tojson) stays far from
# Python's recursion limit.
MAX_DEPTH = 128

# The escape of a high or low surrogate code unit.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
# The bytes `nesting_depth` looks at, and what each bracket does to the depth.
_MATTERS = np.zeros(256, bool)
_MATTERS[list(b'[]{}"\\')] = True
_DEPTH_STEP = np.zeros(256, np.int64)
_DEPTH_STEP[list(b"[{")] = 1
_DEPTH_STEP[list(b"]}")] = -1
_SURROGATES = re.compile("[\ud800-\udfff]")


class InvalidRequest(ProviderError):
    """A 400 that names the request field at fault (OpenAI's error `param`)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__("invalid_request", message, 400)
        self.param = param


def bad(where: str, problem: str) -> InvalidRequest:
    return InvalidRequest(f"{where}: {problem}", where)


# ---- the body ----------------------------------------------------------------------------------


def loads(raw: bytes, *, max_depth: int = MAX_DEPTH) -> Any:
    """The request body as JSON, or an InvalidRequest that says what is wrong with it."""
    depth = nesting_depth(raw)
    if depth > max_depth:
        raise InvalidRequest(
            f"request body: JSON nested {depth} levels deep; at most {max_depth} are accepted"
        )
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InvalidRequest(f"request body is not valid UTF-8 (byte {e.start})") from None
    try:
        body = json.loads(text)
    except ValueError as e:
        raise InvalidRequest(f"request body is not valid JSON: {e}") from None
    if _SURROGATE_ESCAPE.search(raw):  # rare: emoji and other astral characters as escape pairs
        where = lone_surrogate(body)
        if where is not None:
            raise bad(
                where or "request body",
                "contains a lone UTF-16 surrogate escape (such as \\ud800) that is not valid Unicode; "
                "send text as UTF-8 or as complete surrogate pairs",
            )
    return body


def nesting_depth(raw: bytes) -> int:
    """How deep arrays and objects nest in a JSON text (brackets inside strings not counted), read
    without recursion and vectorized; a body with at most MAX_DEPTH opening brackets gets their
    count, which bounds its depth.

    Only the bytes that matter are looked at: quotes, backslashes and brackets (a few percent of a
    request). A quote is escaped when an odd run of backslashes stands right before it; quotes
    that are not escaped open and close strings; brackets outside strings step the depth."""
    opening = raw.count(b"[") + raw.count(b"{")
    if opening <= MAX_DEPTH:
        return opening
    data = np.frombuffer(raw, np.uint8)
    at = np.flatnonzero(_MATTERS[data])
    sym = data[at]
    backslash = sym == 92
    # The length of the run of adjacent backslashes ending at each kept byte (0 for others).
    adjacent = np.empty(at.size, bool)
    adjacent[0] = False
    adjacent[1:] = np.diff(at) == 1
    counted = np.cumsum(backslash, dtype=np.int64)
    breaks = ~backslash | ~adjacent  # a run restarts at a non-backslash or after a gap
    base = np.maximum.accumulate(np.where(breaks, counted - backslash, 0))
    run = np.where(backslash, counted - base, 0)
    escaped = np.zeros(at.size, bool)
    escaped[1:] = adjacent[1:] & (run[:-1] % 2 == 1)
    quote = (sym == 34) & ~escaped
    outside = (np.cumsum(quote) % 2 == 0) & ~quote
    step = np.where(outside, _DEPTH_STEP[sym], 0)
    return int(np.cumsum(step, dtype=np.int64).max(initial=0))


def lone_surrogate(value: Any, where: str = "") -> str | None:
    """The dotted path of the first string (or key) in `value` holding a lone surrogate, if any."""
    stack: list[tuple[Any, str]] = [(value, where)]
    while stack:
        v, at = stack.pop()
        if isinstance(v, str):
            if not v.isascii() and _SURROGATES.search(v):
                return at
        elif isinstance(v, dict):
            for k, item in v.items():
                here = f"{at}.{k}" if at else str(k)
                if not k.isascii() and _SURROGATES.search(k):
                    return at or "request body"
                stack.append((item, here))
        elif isinstance(v, list):
            stack.extend((item, f"{at}.{i}" if at else str(i)) for i, item in enumerate(v))
    return None


# ---- typed fields ------------------------------------------------------------------------------
# `where` is the path of the object read from; errors name `where.key`. Absent and null are the
# same (the APIs' optional fields accept null).


def obj(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise bad(where, f"must be an object, not {kind(value)}")
    return value


def string(d: dict[str, Any], key: str, where: str) -> str:
    """A required string field."""
    v = d.get(key)
    if not isinstance(v, str):
        raise bad(f"{where}.{key}" if where else key, f"required (a string), not {kind(v)}")
    return v


def opt_str(d: dict[str, Any], key: str, where: str, default: str = "") -> str:
    v = d.get(key)
    if v is None:
        return default
    if not isinstance(v, str):
        raise bad(f"{where}.{key}" if where else key, f"must be a string, not {kind(v)}")
    return v


def opt_list(d: dict[str, Any], key: str, where: str) -> list[Any]:
    v = d.get(key)
    if v is None:
        return []
    if not isinstance(v, list):
        raise bad(f"{where}.{key}" if where else key, f"must be a list, not {kind(v)}")
    return v


def opt_obj(d: dict[str, Any], key: str, where: str) -> dict[str, Any] | None:
    v = d.get(key)
    if v is None:
        return None
    return obj(v, f"{where}.{key}" if where else key)


def no_arguments() -> dict[str, Any]:
    """The JSON Schema of a tool that takes no arguments."""
    return {"type": "object", "properties": {}}


def schema(d: dict[str, Any], key: str, where: str) -> dict[str, Any]:
    """A tool's JSON Schema (an object; absent: `no_arguments()`)."""
    v = d.get(key)
    if v is None:
        return no_arguments()
    if not isinstance(v, dict):
        raise bad(f"{where}.{key}" if where else key, f"must be a JSON Schema object, not {kind(v)}")
    return v


def type_tag(d: dict[str, Any], where: str) -> str | None:
    """The `type` discriminator of a tool, a content block or an item (absent: None)."""
    return opt_str(d, "type", where, default="") or None


def kind(v: Any) -> str:
    """A JSON value's type, as the error messages name it."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "a boolean"
    if isinstance(v, int | float):
        return "a number"
    if isinstance(v, str):
        return "a string"
    if isinstance(v, list):
        return "a list"
    return "an object"
