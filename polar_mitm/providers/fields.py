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

import itertools
import json
import operator
import re
from typing import Any

import orjson

from polar_mitm.neutral import ProviderError

# Deeper than any real request (JSON Schemas of MCP tools nest a few dozen levels); shallow enough
# that every recursive reader downstream (schema conversion, templates' tojson) stays far from
# Python's recursion limit.
MAX_DEPTH = 128
_I64 = float(2**63)

# The escape of a high or low surrogate code unit.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_NOT_STRUCTURE = bytes(b for b in range(256) if b not in b'[]{}"')
# After translation an opening bracket is 3 and a closing one 1: minus 2 gives the depth step.
_STEP = bytes.maketrans(b"[{]}", b"\x03\x03\x01\x01")
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
    return read_body(raw, max_depth=max_depth)[0]


def read_body(raw: bytes, *, max_depth: int = MAX_DEPTH) -> tuple[Any, bool]:
    """`loads`, and whether orjson read the body (then it holds no NaN or infinity, and orjson
    writes each of its values back as distinct JSON text).

    orjson reads it first (4-5x faster than `json` on a long conversation). Whatever orjson
    accepts is valid UTF-8 with no lone surrogate and at most 1,024 levels deep, so only the depth
    is left to check, on the objects. What orjson refuses (malformed JSON, lone surrogates, NaN
    and infinities), and a body with a float no smaller than 2**63, which orjson also gives for
    integers too large for 64 bits, is read again by `json`, as every body was before: the same
    values, and errors that say exactly what is wrong."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return _loads_exactly(raw, max_depth), False
    depth, huge = _shape(body)
    if huge:
        return _loads_exactly(raw, max_depth), False
    if depth > max_depth:
        raise _too_deep(depth, max_depth)
    return body, True


def _loads_exactly(raw: bytes, max_depth: int) -> Any:
    depth = nesting_depth(raw)
    if depth > max_depth:
        raise _too_deep(depth, max_depth)
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


def _too_deep(depth: int, max_depth: int) -> InvalidRequest:
    return InvalidRequest(f"request body: JSON nested {depth} levels deep; at most {max_depth} are accepted")


def _shape(value: Any) -> tuple[int, bool]:
    """(how deep arrays and objects nest in `value`, whether it holds a float of magnitude 2**63
    or more), without recursion; strings and numbers are not looked into."""
    deepest = 0
    huge = False
    stack = [(value, 1)] if type(value) in (dict, list) else []
    while stack:
        v, depth = stack.pop()
        if depth > deepest:
            deepest = depth
        for item in v.values() if type(v) is dict else v:
            t = type(item)
            if t is dict or t is list:
                stack.append((item, depth + 1))
            elif t is float and not -_I64 < item < _I64:
                huge = True
    return deepest, huge


def nesting_depth(raw: bytes) -> int:
    """How deep arrays and objects nest in a JSON text (brackets inside strings not counted), read
    without recursion at C speed; a body with at most MAX_DEPTH opening brackets gets their count,
    which bounds its depth."""
    opening = raw.count(b"[") + raw.count(b"{")
    if opening <= MAX_DEPTH:
        return opening
    # Escaped backslashes, then escaped quotes, go first (left to right, as a reader pairs them);
    # every quote left opens or closes a string, so the brackets between them are text.
    structure = raw.replace(b"\\\\", b"").replace(b'\\"', b"").translate(None, _NOT_STRUCTURE)
    brackets = b"".join(structure.split(b'"')[::2]).translate(_STEP)
    return max(itertools.accumulate(map(operator.sub, brackets, itertools.repeat(2))), default=0)


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
