"""Side calls through the real proxy under the generic recipe, as `polar-mitm run -- python
script.py` sets it up for a script driving Claude Code through the Agent SDK: the requests'
user agent brings Claude Code's rules, and an untagged call shaped like a side call is flagged."""

from __future__ import annotations

import logging

from polar_mitm.store.reader import read_turns
from tests.support.helpers import MESSAGES_URL
from tests.unit.test_recipe_side_calls import CC_MAIN, CC_TITLE, CC_UA


async def post(stack, body, headers):
    async with stack.client() as c:
        r = await c.post(MESSAGES_URL, json=dict(body, stream=False), headers={"x-api-key": "k", **headers})
    assert r.status_code == 200, r.text
    return r.json()


def tags(stack) -> list[str | None]:
    return [t.tag for t in read_turns(stack.db, session="s-test")]


async def test_generic_recipe_stores_claude_codes_title_call_as_a_side_call(make_stack):
    stack = await make_stack(recipe="generic")
    await post(stack, CC_MAIN, CC_UA)
    await post(stack, CC_TITLE, CC_UA)
    assert tags(stack) == [None, "title"]
    assert stack.proxy.gateway.side_call_suspects == 0


async def test_an_unrecognised_side_call_is_stored_as_main_and_flagged_once(make_stack, caplog):
    stack = await make_stack(recipe="generic")
    anonymous = {"user-agent": "python-httpx/0.28"}
    with caplog.at_level(logging.WARNING, logger="polar_mitm.proxy.gateway"):
        await post(stack, CC_MAIN, anonymous)
        await post(stack, CC_TITLE, anonymous)
        await post(stack, CC_TITLE, anonymous)
    assert tags(stack) == [None, None, None]
    assert stack.proxy.gateway.side_call_suspects == 2
    said = [r.getMessage() for r in caplog.records if "looks like a side call" in r.getMessage()]
    assert len(said) == 1 and "a structured-output schema" in said[0] and "no tools" in said[0]
