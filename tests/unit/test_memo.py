"""Reading a conversation's requests with its ItemMemo: messages repeated from the last two
requests are shared, not read again, and nothing read differs from reading alone."""

from __future__ import annotations

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from polar_mitm.backends.render import conversation_hashes
from polar_mitm.providers import anthropic, fields, openai_chat
from polar_mitm.providers.base import ItemMemo
from polar_mitm.providers.fields import InvalidRequest
from polar_mitm.proxy import gateway as gateway_module
from polar_mitm.proxy.gateway import Gateway


def _call(n) -> dict:
    return {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {"n": n}}


def _anthropic(*messages) -> bytes:
    return orjson.dumps(
        {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "go"}, *messages]}
    )


def _read(raw: bytes, memo: ItemMemo | None, parse=anthropic.parse_request):
    """A request read as the gateway reads it: the memo begun, and settled once read whole."""
    body, by_orjson = fields.read_body(raw)
    assert by_orjson
    if memo is not None:
        memo.begin()
    req = parse(body, memo=memo)
    if memo is not None:
        memo.settle()
    return req


def test_a_repeated_message_is_shared_and_a_new_one_read():
    memo = ItemMemo()
    one = _read(_anthropic({"role": "assistant", "content": [_call(1)]}), memo)
    two = _read(
        _anthropic({"role": "assistant", "content": [_call(1)]}, {"role": "user", "content": "more"}), memo
    )
    assert two.messages[0] is one.messages[0] and two.messages[1] is one.messages[1]
    assert two.messages[2].content == "more"
    assert conversation_hashes(two.messages, [])[:3] == conversation_hashes(one.messages, [])


@pytest.mark.parametrize("first,then", [(1, 1.0), (1.0, 1), (1, True), (True, 1), (0, False), (0.0, -0.0)])
def test_values_equal_in_python_but_not_in_json_are_read_again(first, then):
    """1 == 1.0 == True in Python; a tool call's arguments render differently in a prompt."""
    memo = ItemMemo()
    _read(_anthropic({"role": "assistant", "content": [_call(first)]}), memo)
    again = _read(_anthropic({"role": "assistant", "content": [_call(then)]}), memo)
    got = again.messages[1].tool_calls[0].arguments["n"]
    assert type(got) is type(then) and repr(got) == repr(then)


def test_a_side_call_between_turns_keeps_the_conversation():
    memo = ItemMemo()
    turn = _read(_anthropic({"role": "assistant", "content": [_call(1)]}), memo)
    _read(
        orjson.dumps({"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "title?"}]}),
        memo,
    )
    later = _read(_anthropic({"role": "assistant", "content": [_call(1)]}), memo)
    assert later.messages[1] is turn.messages[1]


def test_a_request_that_fails_leaves_the_memo_as_it_was():
    memo = ItemMemo()
    _read(_anthropic({"role": "assistant", "content": [_call(1)]}), memo)
    held = (dict(memo.last), dict(memo.before), memo.size)
    with pytest.raises(InvalidRequest):
        _read(
            _anthropic({"role": "assistant", "content": [_call(2)]}, {"role": "robot", "content": "x"}), memo
        )
    assert (memo.last, memo.before, memo.size) == held
    memo.begin()  # the next request: what the failed one read is dropped
    assert memo.now == {}


def test_openai_chat_messages_are_shared_too():
    memo = ItemMemo()
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    one = _read(orjson.dumps({"model": "m", "messages": msgs}), memo, openai_chat.parse_request)
    two = _read(
        orjson.dumps({"model": "m", "messages": [*msgs, {"role": "user", "content": "v"}]}),
        memo,
        openai_chat.parse_request,
    )
    assert two.messages[:2] == one.messages and all(
        a is b for a, b in zip(two.messages[:2], one.messages, strict=True)
    )


def test_the_gateway_keeps_memos_within_its_bytes(monkeypatch):
    monkeypatch.setattr(gateway_module, "MEMO_BYTES", 800)
    gw = Gateway(None, default_session="default")  # type: ignore[arg-type] - memos need no policy
    for session in ("a", "b", "c"):
        memo = gw._memo(session, anthropic, 300)
        memo.read([{"text": "x" * 290}], lambda i, item: item)
        memo.settle()
        gw._memo_bytes += memo.size
    assert list(gw._memos) == [("b", "anthropic"), ("c", "anthropic")]  # "a" made room
    assert gw._memo_bytes == sum(m.size for m in gw._memos.values())
    assert gw._memo(("c"), anthropic, 10) is gw._memos[("c", "anthropic")]


TOOLS = [
    {
        "name": "Bash",
        "description": "Run a command",
        "input_schema": {"type": "object", "properties": {"n": {"type": "integer", "default": 1}}},
    },
    {"name": "Read", "description": "Read a file", "input_schema": {"type": "object", "properties": {}}},
]


def test_tools_are_shared_and_their_hash_known_by_identity():
    memo = ItemMemo()
    body = {"model": "m", "max_tokens": 8, "tools": TOOLS, "messages": [{"role": "user", "content": "go"}]}
    one = _read(orjson.dumps(body), memo)
    two = _read(
        orjson.dumps({**body, "messages": [*body["messages"], {"role": "user", "content": "more"}]}), memo
    )
    assert all(a is b for a, b in zip(two.tools, one.tools, strict=True))
    alone = anthropic.parse_request(body)  # read without the memo: other objects, the same hash
    assert conversation_hashes(two.messages, two.tools)[:2] == conversation_hashes(
        alone.messages, alone.tools
    )
    # A tool whose default differs only as 1.0 differs from 1: read again, hashed again.
    changed = [
        {
            **TOOLS[0],
            "input_schema": {"type": "object", "properties": {"n": {"type": "integer", "default": 1.0}}},
        },
        TOOLS[1],
    ]
    three = _read(orjson.dumps({**body, "tools": changed}), memo)
    assert three.tools[0] is not one.tools[0] and three.tools[1] is one.tools[1]
    assert (
        conversation_hashes(three.messages, three.tools)[0] != conversation_hashes(one.messages, one.tools)[0]
    )


def test_a_tool_field_set_anew_is_hashed_anew():
    tools = anthropic.parse_request({"model": "m", "max_tokens": 8, "tools": TOOLS, "messages": []}).tools
    before = conversation_hashes([], tools)[0]
    tools[1].description = "Read a file, carefully"
    assert conversation_hashes([], tools)[0] != before


@given(st.lists(st.lists(st.integers(0, 6), max_size=8), max_size=6))
def test_the_memos_size_is_the_text_it_holds_whatever_the_requests(conversations):
    """Counted as keys come, not summed again each turn: always the bytes of the JSON texts held
    by the last two requests (repeats within a request counted once)."""
    memo = ItemMemo()
    for picks in conversations:
        _read(_anthropic(*({"role": "assistant", "content": [_call(n)]} for n in picks)), memo)
        held = sum(len(k[1]) for k in memo.before) + sum(len(k[1]) for k in memo.last)
        assert memo.size == held
