"""Property tests: mutated requests of every API style always get an answer in the style's shape.

Valid bodies (tests/support/helpers.VALID_REQUESTS) are mutated a few edits at a time: a value replaced by
any JSON value (lone surrogates, NaN and the words the parsers branch on among them) or by a list
nested too deep, a key dropped or added, a list item repeated or dropped, or the bytes cut,
spliced or doubled. Two properties:

- parsing (fast, most examples): `fields.loads` then the style's `parse_request` either gives a
  ChatRequest whose text everything downstream can hash, tokenize and store, or raises the 400
  `InvalidRequest`, never anything else;
- the gateway (fewer examples, in-process with a fake backend): the status is one a harness
  expects, the body is JSON in the style's own shape (or the style's SSE), and a 4xx stores
  nothing while a reply stores its turn.

Derandomized (the same examples every run) and bounded, so CI spends a few seconds here. A body
that fails is worth keeping in tests/integration/fuzz_corpus/ (`<style>--<what>.json`, the exact bytes).
"""

from __future__ import annotations

import asyncio
import copy
import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from polar_mitm import sse
from polar_mitm.backends.render import conversation_hashes
from polar_mitm.neutral import ChatRequest, ProviderError
from polar_mitm.providers import STYLES, fields
from polar_mitm.providers.base import ItemMemo
from polar_mitm.providers.fields import InvalidRequest
from tests.support.helpers import VALID_REQUESTS, error_message
from tests.support.rig import STYLE_ENDPOINTS, start_gateway_rig
from tests.support.strategies import KEYS, deep, json_values

STYLE_NAMES = sorted(VALID_REQUESTS)
PARSE_EXAMPLES = 500  # per style
GATEWAY_EXAMPLES = 150  # per style


def _nodes(v: Any, path: tuple = ()) -> list[tuple]:
    """Every path into v (the root included)."""
    out = [path]
    if isinstance(v, dict):
        for k, x in v.items():
            out += _nodes(x, (*path, k))
    elif isinstance(v, list):
        for i, x in enumerate(v):
            out += _nodes(x, (*path, i))
    return out


def _at(v: Any, path: tuple) -> Any:
    for p in path:
        v = v[p]
    return v


@st.composite
def mutated(draw, style: str) -> bytes:
    """The style's valid body after 1-3 edits, as the bytes a client would send."""
    body = copy.deepcopy(VALID_REQUESTS[style])
    for _ in range(draw(st.integers(1, 3))):
        path = draw(st.sampled_from(_nodes(body)))
        op = draw(st.sampled_from(["replace"] * 4 + ["drop"] * 2 + ["add"] * 2 + ["repeat", "nest"]))
        parent = _at(body, path[:-1]) if path else None
        if op == "replace" and path:
            parent[path[-1]] = draw(json_values)
        elif op == "drop" and path:
            del parent[path[-1]]
        elif op == "add" and isinstance(node := _at(body, path), dict):
            node[draw(st.sampled_from(KEYS))] = draw(json_values)
        elif op == "nest" and path:
            parent[path[-1]] = deep()
        elif op == "repeat" and isinstance(parent, list):
            parent.insert(path[-1], copy.deepcopy(parent[path[-1]]))
        elif op == "replace":
            body = draw(json_values)  # the whole body
    raw = json.dumps(body).encode()  # lone surrogates go out as \ud800 escapes, NaN as NaN
    cut = draw(st.sampled_from([None] * 12 + ["cut", "splice", "double"]))
    if cut is not None and raw:
        i = draw(st.integers(0, len(raw) - 1))
        if cut == "cut":
            raw = raw[:i]
        elif cut == "splice":
            raw = raw[:i] + draw(st.binary(min_size=1, max_size=3)) + raw[i:]
        else:
            raw = raw + raw
    return raw


def _path(style: str) -> str:
    return STYLE_ENDPOINTS[style][1]


def _safe_downstream(req: ChatRequest) -> None:
    """What the policy does with a parsed request first: hash it and encode its text."""
    conversation_hashes(req.messages, req.tools)
    json.dumps(req.model_dump(), ensure_ascii=False).encode("utf-8")


# ---- parsing -------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("style", STYLE_NAMES)
@settings(max_examples=PARSE_EXAMPLES, deadline=None, derandomize=True, database=None)
@given(data=st.data())
def test_a_mutated_body_parses_or_is_a_400_naming_a_field(style, data):
    raw = data.draw(mutated(style))
    module = STYLES[style]
    try:
        req = module.parse_request(fields.loads(raw), path=_path(style))
    except InvalidRequest as e:
        assert e.status == 400 and e.message
        status, body = module.render_error(e)
        assert status == 400 and body["error"]["message"] == e.message
        return
    except ProviderError as e:  # other provider errors are fine only as 400s
        assert e.status == 400, e.message
        return
    _safe_downstream(req)


def _parsed(module, raw: bytes, style: str, memo=None) -> tuple[str, str]:
    """What a style reads from raw (its neutral request written out exactly), or its error."""
    if memo is not None:
        memo.begin()  # as the gateway reads a request: begun, and settled once read whole
    try:
        req = module.parse_request(fields.loads(raw), path=_path(style), memo=memo)
    except ProviderError as e:
        return "error", e.message
    if memo is not None:
        memo.settle()
    return "request", json.dumps(req.model_dump(), allow_nan=True)


@pytest.mark.slow
@pytest.mark.parametrize("style", STYLE_NAMES)
@settings(max_examples=150, deadline=None, derandomize=True, database=None)
@given(data=st.data())
def test_a_conversation_reads_the_same_with_its_memo_as_without(style, data):
    """Requests read one after another with one ItemMemo, as the gateway reads a session's, give
    exactly what each gives read alone: the memo's messages are reused only where their JSON is
    the same (1, 1.0 and true told apart), and a request that fails leaves the memo as it was."""
    module = STYLES[style]
    memo = ItemMemo()
    for _ in range(4):
        raw = data.draw(mutated(style))
        by_orjson = True
        try:
            by_orjson = fields.read_body(raw)[1]
        except InvalidRequest:
            pass
        assert _parsed(module, raw, style, memo if by_orjson else None) == _parsed(module, raw, style)


# ---- through the gateway -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gateway(tmp_path_factory, qwen_tokenizer_dir):
    """(run, rig): a GatewayRig on an event loop of its own, which `run` drives, for hypothesis'
    synchronous examples."""
    runner = asyncio.Runner()
    rig, close = runner.run(start_gateway_rig(tmp_path_factory.mktemp("fuzz"), qwen_tokenizer_dir))
    yield runner.run, rig
    runner.run(close())
    runner.close()


OK_REPLY = {
    "anthropic": lambda b: b["type"] == "message" and isinstance(b["content"], list),
    "openai-chat": lambda b: isinstance(b["choices"][0]["message"], dict),
    "openai-responses": lambda b: b["object"] == "response" and isinstance(b["output"], list),
    "gemini": lambda b: isinstance(b["candidates"][0]["content"], dict),
}
# 200: a reply; 400/413: the request; 503/529: the backend, retryable.
STATUSES = {200, 400, 413, 503, 529}


@pytest.mark.slow
@pytest.mark.parametrize("style", STYLE_NAMES)
@settings(
    max_examples=GATEWAY_EXAMPLES,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(data=st.data())
def test_the_gateway_answers_a_mutated_body_in_the_styles_shape(gateway, style, data):
    run, rig = gateway
    raw = data.draw(mutated(style))
    before = run(rig.turns())
    status, ctype, body = run(rig.post(style, raw))
    after = run(rig.turns())
    assert status in STATUSES, (status, body[:500])
    if status != 200:
        error_message(style, status, ctype, body)
        assert after == before, "a refused request stored a turn"
        return
    if ctype.startswith("text/event-stream"):
        assert sse.json_events(body) or body.startswith(b"{"), body[:500]
        return
    assert OK_REPLY[style](json.loads(body)), body[:500]
    assert after == before + 1


def _depth_by_hand(raw: bytes) -> int:
    """A JSON text's bracket depth, read byte by byte (strings and their escapes skipped)."""
    depth = deepest = 0
    in_string = escaped = False
    for b in raw:
        if in_string:
            if escaped:
                escaped = False
            elif b == 0x5C:
                escaped = True
            elif b == 0x22:
                in_string = False
        elif b == 0x5C:
            escaped = not escaped  # a backslash outside a string still escapes what follows
        elif b == 0x22 and not escaped:
            in_string = True
        else:
            escaped = False
            if b in b"[{":
                depth += 1
                deepest = max(deepest, depth)
            elif b in b"]}":
                depth -= 1
    return deepest


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(st.lists(st.sampled_from([b"[", b"]", b"{", b"}", b'"', b"\\", b"a", b" "]), min_size=0, max_size=400))
def test_nesting_depth_matches_reading_byte_by_byte(parts):
    from polar_mitm.providers.fields import nesting_depth

    raw = b"[" * 129 + b"".join(parts)  # past the count shortcut
    assert nesting_depth(raw) == _depth_by_hand(raw)


# Where 64-bit integers end, where floats lose integers, and zeros.
_EDGE_NUMBERS = [
    2**53 + 1,
    2**63 - 1,
    2**63,
    2**64 - 1,
    2**64,
    -(2**63),
    -(2**63) - 1,
    10**30,
    0,
    -0.0,
    1e308,
]


def _read(reader, raw: bytes) -> tuple[str, str]:
    """What a reader makes of raw: its value written back exactly (1 and 1.0, NaN and key order
    told apart), or its error."""
    try:
        return "value", json.dumps(reader(raw), allow_nan=True)
    except InvalidRequest as e:
        return "error", e.message


@pytest.mark.slow
@settings(max_examples=600, deadline=None, derandomize=True, database=None)
@given(
    json_values
    | st.builds(lambda n: deep(n), st.integers(min_value=1, max_value=1100))
    | st.lists(st.sampled_from(_EDGE_NUMBERS) | st.integers(-(2**66), 2**66) | st.floats(), max_size=3),
    st.booleans(),
    st.sampled_from([None, "cut", "junk", "latin1"]),
)
def test_loads_reads_every_body_as_json_does(value, ascii_only, damage):
    """The orjson fast path of `fields.loads` gives the very values (and types) `json` gives, and
    the same error where `json`'s reading refuses the body: big integers, NaN, lone surrogate
    escapes, nesting past the limit, cut or non-UTF-8 bodies among the inputs."""
    raw = json.dumps(value, ensure_ascii=ascii_only, allow_nan=True).encode("utf-8", "surrogatepass")
    if damage == "cut":
        raw = raw[: len(raw) // 2]
    elif damage == "junk":
        raw += b" x"
    elif damage == "latin1":
        raw = b'["\xe9"]'
    fast = _read(fields.loads, raw)
    exact = _read(lambda r: fields._loads_exactly(r, fields.MAX_DEPTH), raw)
    assert fast == exact
