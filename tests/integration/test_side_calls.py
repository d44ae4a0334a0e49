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


async def post_as(stack, session: str, body, headers) -> None:
    import httpx

    url = stack.proxy.session_url(session)
    async with httpx.AsyncClient(proxy=url, verify=str(stack.proxy.ca.cert), timeout=30) as c:
        r = await c.post(MESSAGES_URL, json=dict(body, stream=False), headers={"x-api-key": "k", **headers})
    assert r.status_code == 200, r.text


async def test_each_session_is_tagged_by_the_recipe_it_was_issued_with(make_stack):
    """A node's proxy has no recipe: each sample's session carries its own (the pipeline issues
    it with its spec's), so the same call is a side call where its harness's rules say so and not
    where another harness runs. Before, every recipe's rules applied to every session."""
    stack = await make_stack()  # no recipe: a node's proxy
    for session, recipe in (("s-claude", "claude-code"), ("s-aider", "aider"), ("s-unsaid", None)):
        stack.proxy.issue_session(session, recipe)
        await post_as(stack, session, CC_TITLE, CC_UA)
    tags = {t.session_id: t.tag for t in read_turns(stack.db)}
    assert tags == {"s-claude": "title", "s-aider": None, "s-unsaid": "title"}
    stack.proxy.revoke_session("s-claude")  # the session's recipe goes with it
    assert stack.proxy.side.tagger.recipe_of("s-claude") is None


# An untagged title call that comes first, before any main call (OpenCode's): nothing to compare
# it with as it arrives, so only the whole session shows it for what it is.
FIRST_TITLE = {
    "model": "small-model",
    "max_tokens": 4096,
    "system": "Write a short title for this conversation.",
    "messages": [{"role": "user", "content": "Create out.txt containing hi"}],
}


async def test_generic_sessions_are_judged_again_over_the_whole_session_in_stats_and_export(
    make_stack, tmp_path, caplog
):
    from polar_mitm.reconstruct.export import compute_stats, export

    stack = await make_stack(recipe="generic")
    await stack.proxy.store.ensure_session("g1", harness="generic")
    anonymous = {"user-agent": "python-httpx/0.28"}
    for body in (FIRST_TITLE, CC_MAIN, CC_MAIN):
        await post_as(stack, "g1", body, anonymous)
    assert stack.proxy.gateway.side_call_suspects == 0  # not seen as it arrived
    [title, *_] = [t.id for t in read_turns(stack.db, session="g1")]
    stats = compute_stats(stack.db, quiet=True)
    assert list(stats.side_call_suspects) == [title]
    assert "model 'small-model'" in " ".join(stats.side_call_suspects[title])
    assert "side-call suspects" in stats.render()
    with caplog.at_level(logging.WARNING, logger="polar_mitm.export"):
        exported = export(stack.db, tmp_path / "rows.parquet", quiet=True)
    assert list(exported.side_call_suspects) == [title]
    assert any("look like side calls over the whole session" in r.getMessage() for r in caplog.records)
