"""Tool-call formats of the policy's output text, one per SGLang tool parser name.

Each format says which markers open and close a call (and, for DeepSeek and Kimi, the section
around the calls), and how the text between a call's markers becomes a name and arguments. The
streaming state machine that finds the markers lives in `parsers.py`; here are only the formats,
read from SGLang's `python/sglang/srt/function_call/*_detector.py`:

- `qwen25` / `qwen` / `hermes`: `<tool_call>{"name": N, "arguments": {...}}</tool_call>`
- `qwen3_coder`: `<tool_call>\\n<function=N>\\n<parameter=K>\\nV\\n</parameter>\\n</function>\\n</tool_call>`
- `glm45` / `glm`: `<tool_call>N\\n<arg_key>K</arg_key>\\n<arg_value>V</arg_value>\\n</tool_call>`
- `glm47`: the same without the newlines
- `deepseekv3`: `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>N\\n```json\\n{...}\\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>`
- `deepseekv31`: `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>N<｜tool▁sep｜>{...}<｜tool▁call▁end｜><｜tool▁calls▁end｜>`
- `kimi_k2`: `<|tool_calls_section_begin|><|tool_call_begin|>functions.N:I<|tool_call_argument_begin|>{...}<|tool_call_end|><|tool_calls_section_end|>`

The XML-ish formats write values as text; like SGLang, they are typed with the tool's JSON schema
when the request's tools are known.

Each block is also judged (`PARSE_FAILURES`): a block that is not a call says why (`diagnose`: its
format's own reading of what is missing), and a call that is read says whether its tool is one
the request declared and its arguments fit that tool's schema (`check_call`). The harness still
gets what it always got (a block that is not a call as text, a call as a call); the turn records
the verdicts, so a trainer can tell a malformed call from an honest text reply.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from polar_mitm.neutral import Tool

# One decoded call: its name, and its arguments (a dict) or their raw text when not a JSON object.
Decoded = tuple[str, dict[str, Any] | str]
# Tool name -> its parameters' JSON schema.
Schemas = Mapping[str, dict[str, Any]]
# (call body, schemas, whether the call's closing marker was seen) -> calls, or None: not a call.
Decoder = Callable[[str, Schemas, bool], list[Decoded] | None]


@dataclass(frozen=True)
class ToolFormat:
    call_open: str
    call_close: str
    decode: Decoder
    section_open: str | None = None  # DeepSeek and Kimi wrap their calls in a section
    section_close: str | None = None
    # Why a closed block's body is no call (one of PARSE_FAILURES), by the format's own reading.
    diagnose: Callable[[str], str] | None = None

    @property
    def openers(self) -> tuple[str, ...]:
        """Markers that start tool calls in text (a bare call marker counts, as in SGLang)."""
        return (self.section_open, self.call_open) if self.section_open else (self.call_open,)


def tool_schemas(tools: Sequence[Tool] | None) -> dict[str, dict[str, Any]]:
    return {t.name: t.parameters for t in tools or ()}


def _param_type(schemas: Schemas, tool: str, param: str) -> str | None:
    """The JSON schema type of a tool's parameter, when the schema says one clearly."""
    props = (schemas.get(tool) or {}).get("properties")
    if not isinstance(props, dict) or not isinstance(props.get(param), dict):
        return None
    return _schema_type(props[param])


def _schema_type(schema: dict[str, Any]) -> str | None:
    t = schema.get("type")
    if isinstance(t, list):
        t = [x for x in t if x != "null"]
        t = t[0] if len(t) == 1 else None
    if isinstance(t, str):
        return t
    for key in ("anyOf", "oneOf"):
        alts = schema.get(key)
        if isinstance(alts, list):
            kinds = {_schema_type(a) for a in alts if isinstance(a, dict) and a.get("type") != "null"}
            return kinds.pop() if len(kinds) == 1 else None
    if "properties" in schema:
        return "object"
    if "items" in schema:
        return "array"
    return None


def _literal(text: str) -> Any:
    """A Python literal (models sometimes write `['a', 'b']` or `True`); raises ValueError."""
    try:
        return ast.literal_eval(text)
    except (SyntaxError, TypeError, MemoryError, RecursionError) as e:
        raise ValueError(str(e)) from e


def _json_object(text: str) -> dict[str, Any] | None:
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    return obj if isinstance(obj, dict) else None


# -- why a block is not a (valid) call ---------------------------------------------------------

# What a tool-call block can fail by, as a turn records it (`OutputParser.parse_status`).
PARSE_FAILURES = ("invalid_json", "unclosed", "missing_name", "unknown_tool", "schema_mismatch", "malformed")


def diagnose(fmt: ToolFormat, body: str, complete: bool) -> str:
    """Why `fmt.decode` read no call from a block (one of PARSE_FAILURES)."""
    if not complete:
        return "unclosed"
    return fmt.diagnose(body) if fmt.diagnose is not None else "malformed"


def check_call(name: str, args: dict[str, Any] | str, schemas: Schemas) -> str | None:
    """Why a call that was read is not one the request can run, or None: a tool it did not declare,
    arguments that are not a JSON object, or arguments that do not fit the declared schema."""
    if schemas and name not in schemas:
        return "unknown_tool"
    if isinstance(args, str):
        return "invalid_json"
    schema = schemas.get(name)
    if isinstance(schema, dict) and not _fits(args, schema):
        return "schema_mismatch"
    return None


_PY_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "array": (list,),
    "object": (dict,),
}


def _fits(args: dict[str, Any], schema: dict[str, Any]) -> bool:
    """The checks a trainer can rely on without a validator: required keys present, no key the
    schema forbids, each value of a clearly typed property of that type (null always passes)."""
    found = schema.get("properties")
    props: dict[str, Any] = found if isinstance(found, dict) else {}
    required = schema.get("required")
    if isinstance(required, list) and any(isinstance(k, str) and k not in args for k in required):
        return False
    if schema.get("additionalProperties") is False and any(k not in props for k in args):
        return False
    for key, value in args.items():
        sub = props.get(key)
        if value is None or not isinstance(sub, dict):
            continue
        want = _PY_TYPES.get(_schema_type(sub) or "")
        if want is None:
            continue
        if isinstance(value, bool) and bool not in want:
            return False  # a bool is an int to Python, not to JSON Schema
        if not isinstance(value, want):
            return False
    return True


def _diagnose_json(body: str) -> str:
    try:
        obj = json.loads(body.strip())
    except ValueError:
        return "invalid_json"
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return "missing_name"
    return "malformed"


def _diagnose_coder(body: str) -> str:
    pos = body.find(_FUNCTION)
    if pos < 0 or not body[pos + len(_FUNCTION) : body.find(">", pos)].strip():
        return "missing_name"
    return "malformed"


def _diagnose_glm(body: str) -> str:
    m = _GLM_NAME_END.search(body)
    name = (body[: m.start()] if m else body).strip()
    return "missing_name" if not name or "<" in name else "malformed"


def _diagnose_deepseek_v3(body: str) -> str:
    _, sep, rest = body.partition(DS_SEP)
    if not sep:
        return "malformed"
    return "missing_name" if not rest.split("\n", 1)[0].strip() else "invalid_json"


def _diagnose_deepseek_v31(body: str) -> str:
    name, sep, _ = body.partition(DS_SEP)
    if not sep:
        return "malformed"
    return "missing_name" if not name.strip() or "<" in name else "invalid_json"


def _diagnose_kimi(body: str) -> str:
    call_id, sep, _ = body.partition(KIMI_ARGS)
    if not sep:
        return "malformed"
    return "missing_name" if not _KIMI_ID.fullmatch(call_id.strip()) else "invalid_json"


# -- qwen25 / hermes: a JSON object per call ---------------------------------------------------


def decode_json_call(body: str, schemas: Schemas, complete: bool) -> list[Decoded] | None:
    try:
        obj = json.loads(body.strip())
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            parsed = json.loads(args)
        except ValueError:
            return [(obj["name"], args)]
        args = parsed
    if not isinstance(args, dict):
        return [(obj["name"], json.dumps(args))]
    return [(obj["name"], args)]


# -- qwen3_coder: <function=N><parameter=K>V</parameter></function> ------------------------------

_FUNCTION, _FUNCTION_END = "<function=", "</function>"
_PARAMETER, _PARAMETER_END = "<parameter=", "</parameter>"


def _coder_value(raw: str, typ: str | None) -> Any:
    """Qwen3-Coder's values are text, converted by the parameter's schema type (SGLang's rules)."""
    if raw.lower() == "null":
        return None
    if typ is None or typ in ("string", "str", "text", "varchar", "char", "enum"):
        return raw
    if typ.startswith(("int", "uint", "long", "short", "unsigned")):
        try:
            return int(raw)
        except ValueError:
            return raw
    if typ.startswith(("num", "float")):
        try:
            num = float(raw)
        except ValueError:
            return raw
        return int(num) if num.is_integer() and "." not in raw and "e" not in raw.lower() else num
    if typ in ("boolean", "bool", "binary"):
        return raw.lower() == "true"
    if typ in ("object", "array", "arr") or typ.startswith(("dict", "list")):
        try:
            return json.loads(raw)
        except ValueError:
            pass
    try:
        return _literal(raw)
    except ValueError:
        return raw


def decode_qwen3_coder(body: str, schemas: Schemas, complete: bool) -> list[Decoded] | None:
    calls: list[Decoded] = []
    pos = body.find(_FUNCTION)
    while pos >= 0:
        head = pos + len(_FUNCTION)
        gt = body.find(">", head)
        if gt < 0:
            return None
        name = body[head:gt].strip()
        end = body.find(_FUNCTION_END, gt)
        if end < 0 and not complete:
            return None  # cut off inside the call: a truncated value must not run
        region = body[gt + 1 : end if end >= 0 else len(body)]
        args: dict[str, Any] = {}
        p = region.find(_PARAMETER)
        while p >= 0:
            pgt = region.find(">", p)
            if pgt < 0:
                break
            key = region[p + len(_PARAMETER) : pgt].strip()
            # A value ends at </parameter>, or (unclosed) at the next parameter or the region's end.
            stops = [i for i in (region.find(_PARAMETER_END, pgt), region.find(_PARAMETER, pgt)) if i >= 0]
            stop = min(stops) if stops else len(region)
            value = region[pgt + 1 : stop]
            value = value[1:] if value.startswith("\n") else value
            value = value[:-1] if value.endswith("\n") else value
            args[key] = _coder_value(value, _param_type(schemas, name, key))
            p = region.find(_PARAMETER, stop)
        if not name:
            return None
        calls.append((name, args))
        pos = body.find(_FUNCTION, end) if end >= 0 else -1
    return calls or None


# -- glm45 / glm47: N<arg_key>K</arg_key><arg_value>V</arg_value> --------------------------------

_GLM_PAIR = re.compile(r"<arg_key>(.*?)</arg_key>(?:\\n|\s)*<arg_value>(.*?)</arg_value>", re.DOTALL)
_GLM_NAME_END = re.compile(r"\\n|\n|<arg_key>")


def _glm_json(raw: str) -> tuple[bool, Any]:
    """(parsed?, value): the value as JSON, or as JSON written with escaped quotes (`{\\"a\\": 1}`)."""
    try:
        return True, json.loads(raw)
    except ValueError:
        pass
    try:
        return True, json.loads(json.loads('{"v": "' + raw + '"}')["v"])
    except (ValueError, KeyError, TypeError):
        return False, None


def _glm_value(raw: str, typ: str | None) -> Any:
    """GLM's values: JSON when they parse, typed by the schema when known (SGLang's rules)."""
    ok, parsed = _glm_json(raw)
    if typ == "string":
        if ok and isinstance(parsed, str):
            return parsed
        if ok and isinstance(parsed, (dict, list)):
            return json.dumps(parsed, ensure_ascii=False)
        if not ok and len(raw) >= 2 and raw[0] == raw[-1] and raw[0] in "\"'":
            return raw[1:-1]
        return raw
    if ok:
        if typ in ("number", "integer") and isinstance(parsed, str):
            try:
                return float(parsed) if "." in parsed or "e" in parsed.lower() else int(parsed)
            except ValueError:
                return parsed
        return parsed
    try:
        return _literal(raw)
    except ValueError:
        return raw


def decode_glm(body: str, schemas: Schemas, complete: bool) -> list[Decoded] | None:
    if not complete:
        return None  # like SGLang: a call is only read once </tool_call> closes it
    m = _GLM_NAME_END.search(body)
    name = (body[: m.start()] if m else body).strip()
    if not name or "<" in name:
        return None
    args: dict[str, Any] = {}
    for pair in _GLM_PAIR.finditer(body, m.start() if m else len(body)):
        key = pair.group(1).strip()
        args[key] = _glm_value(pair.group(2), _param_type(schemas, name, key))
    return [(name, args)]


# -- deepseekv3 / deepseekv31 ------------------------------------------------------------------

# The markers use U+FF5C FULLWIDTH VERTICAL LINE and U+2581 LOWER ONE EIGHTH BLOCK, as DeepSeek's
# tokenizer spells them.
DS_CALLS_BEGIN, DS_CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_CALL_BEGIN, DS_CALL_END, DS_SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
_DS_V3_CALL = re.compile(
    r"\s*[^<]*?" + re.escape(DS_SEP) + r"(?P<name>[^\n]*)\n```(?:json)?[ \t]*\n(?P<args>.*?)\n?```\s*",
    re.DOTALL,
)


def decode_deepseek_v3(body: str, schemas: Schemas, complete: bool) -> list[Decoded] | None:
    """`function<｜tool▁sep｜>N` then the arguments in a ```json fence."""
    m = _DS_V3_CALL.fullmatch(body)
    if not m or not m.group("name").strip():
        return None
    args = _json_object(m.group("args"))
    return None if args is None else [(m.group("name").strip(), args)]


def decode_deepseek_v31(body: str, schemas: Schemas, complete: bool) -> list[Decoded] | None:
    """`N<｜tool▁sep｜>{...}`."""
    name, sep, raw = body.partition(DS_SEP)
    if not sep or not name.strip() or "<" in name:
        return None
    args = _json_object(raw)
    return None if args is None else [(name.strip(), args)]


# -- kimi_k2 -----------------------------------------------------------------------------------

KIMI_SECTION_BEGIN, KIMI_SECTION_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
KIMI_CALL_BEGIN, KIMI_CALL_END = "<|tool_call_begin|>", "<|tool_call_end|>"
KIMI_ARGS = "<|tool_call_argument_begin|>"
# The call id is `functions.NAME:INDEX`; SGLang also takes `NAME:INDEX`.
_KIMI_ID = re.compile(r"(?:functions\.)?(?P<name>\S+?):(?P<index>\d+)")


def decode_kimi_k2(body: str, schemas: Schemas, complete: bool) -> list[Decoded] | None:
    call_id, sep, raw = body.partition(KIMI_ARGS)
    m = _KIMI_ID.fullmatch(call_id.strip())
    if not sep or not m:
        return None
    args = _json_object(raw)
    return None if args is None else [(m.group("name"), args)]


# -- the names ---------------------------------------------------------------------------------

_QWEN25 = ToolFormat("<tool_call>", "</tool_call>", decode_json_call, diagnose=_diagnose_json)
_GLM = ToolFormat("<tool_call>", "</tool_call>", decode_glm, diagnose=_diagnose_glm)
_DEEPSEEK_V3 = ToolFormat(
    DS_CALL_BEGIN, DS_CALL_END, decode_deepseek_v3, DS_CALLS_BEGIN, DS_CALLS_END, _diagnose_deepseek_v3
)

TOOL_FORMATS: dict[str, ToolFormat] = {
    "qwen25": _QWEN25,
    "qwen": _QWEN25,
    "hermes": _QWEN25,
    "qwen3_coder": ToolFormat("<tool_call>", "</tool_call>", decode_qwen3_coder, diagnose=_diagnose_coder),
    "glm45": _GLM,
    "glm": _GLM,
    "glm47": _GLM,
    "deepseekv3": _DEEPSEEK_V3,
    "deepseek-v3": _DEEPSEEK_V3,  # SGLang's reasoning parser name, often given for the tool parser too
    "deepseekv31": ToolFormat(
        DS_CALL_BEGIN, DS_CALL_END, decode_deepseek_v31, DS_CALLS_BEGIN, DS_CALLS_END, _diagnose_deepseek_v31
    ),
    "kimi_k2": ToolFormat(
        KIMI_CALL_BEGIN, KIMI_CALL_END, decode_kimi_k2, KIMI_SECTION_BEGIN, KIMI_SECTION_END, _diagnose_kimi
    ),
}
