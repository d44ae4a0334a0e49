"""SGLang's request contract: what /generate accepts, and how SGLang says no.

Request checking: an unknown `sampling_params` key (or a wrongly typed field) is refused by
SGLang's JSON contract gate with HTTP 400 `{"error": "unknown field `x`, expected one of …"}` (a
plain string); a body that is not JSON is FastAPI's validation error, which SGLang turns into 400
`{"object": "error", "message", "type": "Bad Request", "param": null, "code": 400}`; semantic
errors (`ValueError` in SGLang: no prompt, bad temperature, prompt too long) are 400
`{"error": {"message": ...}}`. Unknown top-level keys are ignored, as SGLang does. A body
without `Content-Type: application/json` is a 400 validation error whatever it holds (FastAPI
does not parse it). An `input_ids` entry outside the vocabulary is a 400 here; real SGLang
0.5.23 does not check it: its scheduler dies of an IndexError and the whole server exits
(observed on CPU), so the proxy must only ever send the served model's tokenizer's ids.

`check_generate_body` / `check_sampling_params` are the JSON contract gate (the generated
`sglang/api/v1/api_types.py`), and `GenParams.from_sglang` is `SamplingParams`' normalization and
`verify()` (`srt/sampling/sampling_params.py`), in SGLang's order and words. The error-body
helpers at the end write SGLang's shapes (and its JSON / SSE framing) for every endpoint.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from aiohttp import web

# --------------------------------------------------------------------------------------------
# SGLang's sampling parameters, normalized and verified as SamplingParams does
# --------------------------------------------------------------------------------------------


@dataclass
class GenParams:
    """SGLang sampling parameters after its normalization (`SamplingParams.__post_init__`)."""

    max_new_tokens: int | None = 128
    stop: list[str] = field(default_factory=list)
    stop_token_ids: set[int] = field(default_factory=set)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: whole vocabulary
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_new_tokens: int = 0
    n: int = 1
    json_schema: Any = None  # parsed
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    stream_interval: int = 1
    logit_bias: dict[int, float] = field(default_factory=dict)
    sampling_seed: int | None = None

    @classmethod
    def from_sglang(cls, sp: dict[str, Any], vocab_size: int) -> GenParams:
        """Normalize and verify as SGLang does; raises ValueError with SGLang's messages."""

        def get(name: str, default: Any) -> Any:
            v = sp.get(name)
            return default if v is None else v

        p = cls()
        p.max_new_tokens = sp.get("max_new_tokens", 128)
        stop = sp.get("stop")
        p.stop = [stop] if isinstance(stop, str) else list(stop or [])
        if len(p.stop) > 32:
            raise ValueError(f"at most 32 stop strings are allowed, got {len(p.stop)}")
        p.stop_token_ids = {int(t) for t in sp.get("stop_token_ids") or [] if t is not None}
        p.temperature = float(get("temperature", 1.0))
        p.top_p = float(get("top_p", 1.0))
        p.top_k = int(get("top_k", -1))
        p.min_p = float(get("min_p", 0.0))
        p.frequency_penalty = float(get("frequency_penalty", 0.0))
        p.presence_penalty = float(get("presence_penalty", 0.0))
        p.repetition_penalty = float(get("repetition_penalty", 1.0))
        p.min_new_tokens = int(get("min_new_tokens", 0))
        p.n = int(get("n", 1))
        p.ignore_eos = bool(get("ignore_eos", False))
        p.skip_special_tokens = bool(get("skip_special_tokens", True))
        p.no_stop_trim = bool(get("no_stop_trim", False))
        p.stream_interval = max(1, int(get("stream_interval", 1)))
        p.sampling_seed = sp.get("sampling_seed")
        # SGLang's verify(), in its order and words.
        if not np.isfinite(p.temperature) or p.temperature < 0.0:
            # SGLang prints the value as sent: `got -1.`, not `got -1.0.`.
            raise ValueError(f"temperature must be a non-negative finite number, got {sp['temperature']}.")
        if p.temperature < 1e-6:  # greedy: SGLang sets top_k = 1 and temperature = 1
            p.temperature, p.top_k = 1.0, 1
        if not 0.0 < p.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {p.top_p}.")
        if not 0.0 <= p.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {p.min_p}.")
        if p.top_k < 1 and p.top_k != -1:
            raise ValueError(f"top_k must be -1 (disable) or at least 1, got {p.top_k}.")
        if not -2.0 <= p.frequency_penalty <= 2.0:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {p.frequency_penalty}.")
        if not -2.0 <= p.presence_penalty <= 2.0:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {p.presence_penalty}.")
        if not 0.0 < p.repetition_penalty <= 2.0:
            raise ValueError(
                f"repetition_penalty must be in (0, 2] (1.0 = no penalty), got {p.repetition_penalty}."
            )
        if p.min_new_tokens < 0:
            raise ValueError(f"min_new_tokens must be in [0, max_new_tokens], got {p.min_new_tokens}.")
        if p.max_new_tokens is not None:
            if p.max_new_tokens < 0:
                raise ValueError(f"max_new_tokens must be at least 0, got {p.max_new_tokens}.")
            if p.min_new_tokens > p.max_new_tokens:
                raise ValueError(
                    f"min_new_tokens must be in [0, max_new_tokens({p.max_new_tokens})], got {p.min_new_tokens}."
                )
        for key, bias in (sp.get("logit_bias") or {}).items():
            try:
                tid = int(key)
            except ValueError:
                raise ValueError(f"logit_bias must has keys in [0, {vocab_size - 1}], got {key}.") from None
            if not 0 <= tid < vocab_size:
                raise ValueError(f"logit_bias must has keys in [0, {vocab_size - 1}], got {key}.")
            p.logit_bias[tid] = float(bias)
        grammars = [sp.get(k) or None for k in ("json_schema", "regex", "ebnf", "structural_tag")]
        if sum(g is not None for g in grammars) > 1:
            raise ValueError("Only one of json_schema, regex, ebnf, or structural_tag can be set.")
        if sp.get("json_schema"):
            try:
                p.json_schema = json.loads(sp["json_schema"])
            except ValueError as e:
                raise ValueError(f"Invalid json_schema {sp['json_schema'][:200]!r}: {e}") from e
        return p


# --------------------------------------------------------------------------------------------
# SGLang's request contract (the generated JSON gate in front of /generate)
# --------------------------------------------------------------------------------------------

SAMPLING_PARAM_FIELDS: dict[str, str] = {
    "max_new_tokens": "i64",
    "stop": "str_or_list",
    "stop_token_ids": "i64_list",
    "stop_regex": "str_or_list",
    "temperature": "f64",
    "top_p": "f64",
    "top_k": "i64",
    "min_p": "f64",
    "frequency_penalty": "f64",
    "presence_penalty": "f64",
    "repetition_penalty": "f64",
    "min_new_tokens": "i64",
    "n": "i64",
    "json_schema": "str",
    "regex": "str",
    "ebnf": "str",
    "structural_tag": "str",
    "ignore_eos": "bool",
    "skip_special_tokens": "bool",
    "spaces_between_special_tokens": "bool",
    "no_stop_trim": "bool",
    "stream_interval": "i64",
    "logit_bias": "f64_map",
    "sampling_seed": "i64",
    "custom_params": "any",
    "beam_width": "i64",
    "watermark": "map",
    "choice": "str_list",
}

# Top-level /generate fields we check the type of; unknown top-level keys are ignored by SGLang.
GENERATE_FIELDS: dict[str, str] = {
    "rid": "str_or_list",
    "text": "str_or_list",
    "input_ids": "ids",
    "stream": "bool",
    "return_logprob": "bool_or_list",
    "logprob_start_len": "i64_or_list",
    "top_logprobs_num": "i64_or_list",
    "token_ids_logprob": "ids",
    "return_text_in_logprobs": "bool",
    "return_prompt_token_ids": "bool",
}


class ContractError(ValueError):
    """A body SGLang's JSON contract refuses: HTTP 400 `{"error": "<message>"}`."""


def _unexpected(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return f"boolean `{'true' if v else 'false'}`"
    if isinstance(v, int):
        return f"integer `{v}`"
    if isinstance(v, float):
        return f"floating point `{v}`"
    if isinstance(v, str):
        return f'string "{v}"'
    if isinstance(v, list):
        return "sequence"
    if isinstance(v, dict):
        return "map"
    return type(v).__name__


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_kind(v: Any, kind: str) -> None:
    if v is None or kind == "any":
        return
    expected = {
        "i64": "i64",
        "f64": "f64",
        "bool": "a boolean",
        "str": "a string",
        "map": "a map",
        "f64_map": "a map",
        "i64_list": "a sequence",
        "str_list": "a sequence",
        "ids": "a sequence",
        "str_or_list": "a string or a sequence of strings",
        "bool_or_list": "a boolean or a sequence of booleans",
        "i64_or_list": "an integer or a sequence of integers",
    }[kind]
    ok: bool
    if kind == "i64":
        ok = _is_int(v)
    elif kind == "f64":
        ok = isinstance(v, int | float) and not isinstance(v, bool)
    elif kind == "bool":
        ok = isinstance(v, bool)
    elif kind == "str":
        ok = isinstance(v, str)
    elif kind in ("map", "f64_map"):
        ok = isinstance(v, dict)
        if ok and kind == "f64_map":
            for x in v.values():
                _check_kind(x, "f64")
    elif kind == "i64_list":
        ok = isinstance(v, list)
        if ok:
            for x in v:
                _check_kind(x, "i64")
    elif kind == "str_list":
        ok = isinstance(v, list) and all(isinstance(x, str) for x in v)
    elif kind == "ids":
        ok = isinstance(v, list)
        # Fast path: a flat list of ints (the common 64k-token prompt) is checked in C.
        if ok and not all(type(x) is int for x in v):
            for x in v:
                if isinstance(x, list):
                    for y in x:
                        _check_kind(y, "i64")
                else:
                    _check_kind(x, "i64")
    elif kind == "str_or_list":
        ok = isinstance(v, str) or (isinstance(v, list) and all(isinstance(x, str) for x in v))
    elif kind == "bool_or_list":
        ok = isinstance(v, bool) or (isinstance(v, list) and all(isinstance(x, bool) for x in v))
    else:  # i64_or_list
        ok = _is_int(v) or (isinstance(v, list) and all(_is_int(x) for x in v))
    if not ok:
        raise ContractError(f"invalid type: {_unexpected(v)}, expected {expected}")


def check_sampling_params(sp: Any) -> None:
    """SGLang's contract for one `sampling_params` object: unknown keys are refused."""
    if not isinstance(sp, dict):
        raise ContractError(f"invalid type: {_unexpected(sp)}, expected struct SamplingParams")
    for key, value in sp.items():
        kind = SAMPLING_PARAM_FIELDS.get(key)
        if kind is None:
            listed = ", ".join(f"`{f}`" for f in SAMPLING_PARAM_FIELDS)
            raise ContractError(f"unknown field `{key}`, expected one of {listed}")
        _check_kind(value, kind)


def check_generate_body(body: Any) -> None:
    if not isinstance(body, dict):
        raise ContractError(f"invalid type: {_unexpected(body)}, expected struct GenerateRequest")
    for key, kind in GENERATE_FIELDS.items():
        if key in body:
            _check_kind(body[key], kind)
    sp = body.get("sampling_params")
    if isinstance(sp, list):
        for one in sp:
            check_sampling_params(one)
    elif sp is not None:
        check_sampling_params(sp)


# --------------------------------------------------------------------------------------------
# Answers in SGLang's shapes: JSON, SSE and error bodies
# --------------------------------------------------------------------------------------------


def _dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def _json(obj: Any, status: int = 200) -> web.Response:
    # As bytes: SGLang's JSON answers say `application/json`, without aiohttp's `; charset=utf-8`.
    return web.Response(body=_dumps(obj).encode(), status=status, content_type="application/json")


def _sse(obj: Any) -> bytes:
    return b"data: " + _dumps(obj).encode() + b"\n\n"


def _bad_request_validation(message: str) -> web.Response:
    """SGLang's RequestValidationError handler: FastAPI's 422 turned into a 400 ErrorResponse."""
    return _json(
        {"object": "error", "message": message, "type": "Bad Request", "param": None, "code": 400}, 400
    )


def _openai_error(message: str, status: int = 400, err_type: str = "BadRequestError") -> web.Response:
    """SGLang's OpenAIServingBase.create_error_response."""
    return _json(
        {"object": "error", "message": message, "type": err_type, "param": None, "code": status}, status
    )


async def _read_json(request: web.Request) -> tuple[Any, bytes, web.Response | None]:
    """(parsed body, raw body, error response if it is not JSON). As SGLang's FastAPI does, a
    body without `Content-Type: application/json` is not parsed at all: 400, whatever it holds."""
    raw = await request.read()
    if request.content_type != "application/json":
        return (
            None,
            raw,
            _bad_request_validation(
                "1 validation error:\n  {'type': 'dataclass_type', 'loc': ('body',), 'msg': 'Input should "
                f"be a dictionary or an instance of GenerateReqInput', 'input': {raw[:200]!r}}}"
            ),
        )
    try:
        body = json.loads(raw) if raw else None
    except (ValueError, UnicodeDecodeError) as e:
        return None, raw, _bad_request_validation(f"1 validation error:\n  JSON decode error: {e}")
    if body is None:
        return None, raw, _bad_request_validation("1 validation error:\n  body: Field required")
    return body, raw, None
