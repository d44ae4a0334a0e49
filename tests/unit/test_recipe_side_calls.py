"""Side calls of the new recipes' harnesses, as they send them, are tagged (not stored as a
second trajectory): the request bodies are cut down from real captures."""

import pytest
from hypothesis import given
from hypothesis import strategies as st
from multidict import MultiDict

from polar_mitm import recipes
from polar_mitm.providers import anthropic, openai_chat
from polar_mitm.providers import openai_responses as responses

KILO_TITLE = {
    "model": "gpt-5.4-nano",
    "input": [
        {
            "role": "developer",
            "content": "You are a title generator. You output ONLY a thread title. Nothing else.\n\n<task>\n"
            "Generate a brief title that would help the user find this conversation later.",
        },
        {"role": "user", "content": [{"type": "input_text", "text": "Create out.txt containing hi"}]},
    ],
    "stream": True,
}
AIDER_COMMIT = {
    "model": "gpt-4o-mini",
    "messages": [
        {
            "role": "system",
            "content": "You are an expert software engineer that generates concise, one-line Git commit "
            "messages based on the provided diffs.\nReview the provided context and diffs",
        },
        {"role": "user", "content": "diff --git a/out.txt b/out.txt\n+hi"},
    ],
    "stream": True,
}
KIMI_COMPACTION = {
    "model": "kimi-k2-turbo-preview",
    "messages": [
        {"role": "system", "content": "You are a helpful assistant that compacts conversation context."},
        {"role": "user", "content": "The above is a list of messages in an agent conversation."},
    ],
}

# gptme 0.35.1's title, asked after each reply of its main loop (the main loop is Chat Completions).
GPTME_TITLE = {
    "instructions": "Generate concise conversation titles.",
    "input": [
        {
            "role": "user",
            "content": "Your task: Create a 2-4 word title for this conversation.\n\nConversation:\n"
            "User: Create out.txt containing hi\n",
        }
    ],
    "model": "gpt-5-mini",
    "store": False,
}


@pytest.mark.parametrize(
    "recipe,parse,body,path,tag",
    [
        ("kilo", responses.parse_request, KILO_TITLE, "/v1/responses", "title"),
        ("aider", openai_chat.parse_request, AIDER_COMMIT, "/v1/chat/completions", "commit-message"),
        ("kimi-cli", openai_chat.parse_request, KIMI_COMPACTION, "/v1/chat/completions", "compaction"),
        ("gptme", responses.parse_request, GPTME_TITLE, "/v1/responses", "title"),
    ],
)
def test_side_calls_are_tagged(recipe, parse, body, path, tag):
    r = recipes.get(recipe)
    assert r.tag(parse(body), path) == tag
    # ...and the harness's main turn is not.
    if "instructions" in body:  # the system prompt in its own field
        main = {k: v for k, v in body.items() if k != "instructions"}
    else:
        main = (
            dict(body, input=body["input"][1:])
            if "input" in body
            else dict(body, messages=body["messages"][1:])
        )
    assert r.tag(parse(main), path) is None


# Claude Code 2.1.332, as the Claude Agent SDK for Python runs it: the session-title call (a
# one-shot structured answer from the small model, no tools) and a turn of the main loop.
CC_UA = {"User-Agent": "claude-cli/2.1.332 (external, sdk-py)", "x-app": "cli"}
CC_IDENTITY = {"type": "text", "text": "You are Claude Code, Anthropic's official CLI for Claude."}
CC_TITLE = {
    "model": "claude-haiku-4-5-20251001",
    "max_tokens": 512,
    "system": [
        CC_IDENTITY,
        {
            "type": "text",
            "text": "You are naming a coding session. Read the user's first message and reply with a "
            "title of 3 to 7 words in sentence case that says what the session is about.",
        },
    ],
    "messages": [{"role": "user", "content": [{"type": "text", "text": "Create out.txt containing hi"}]}],
    "output_config": {
        "format": {
            "type": "json_schema",
            "schema": {
                "type": "object",
                "properties": {"title": {"type": "string"}},
                "required": ["title"],
                "additionalProperties": False,
            },
        }
    },
    "metadata": {"user_id": "user_0f3a_account__session_5b1c"},
    "stream": True,
}
CC_MAIN = {
    "model": "claude-sonnet-4-5-20250929",
    "max_tokens": 32000,
    "system": [
        CC_IDENTITY,
        {
            "type": "text",
            "text": "You are an interactive agent that helps users with software engineering tasks.",
            "cache_control": {"type": "ephemeral"},
        },
    ],
    "messages": [{"role": "user", "content": [{"type": "text", "text": "Create out.txt containing hi"}]}],
    "tools": [
        {
            "name": "Bash",
            "description": "Executes a given bash command",
            "input_schema": {
                "type": "object",
                "properties": {"command": {"type": "string"}},
                "required": ["command"],
            },
        }
    ],
    "metadata": {"user_id": "user_0f3a_account__session_5b1c"},
    "stream": True,
}
PATH = "/v1/messages?beta=true"


def test_claude_code_titles_are_tagged_in_the_new_wording_and_the_old():
    r = recipes.get("claude-code")
    assert r.tag(anthropic.parse_request(CC_TITLE), PATH) == "title"
    old = dict(CC_TITLE, system="Generate a concise, sentence-case title (3-7 words) for this session.")
    assert r.tag(anthropic.parse_request(old), PATH) == "title"
    assert r.tag(anthropic.parse_request(CC_MAIN), PATH) is None


def test_claude_code_side_calls_are_known_by_their_shape_whatever_their_text():
    """No tools, a schema and a small max_tokens: a one-shot side call, not a loop turn."""
    r = recipes.get("claude-code")
    reworded = dict(CC_TITLE, system="Summarise the user's request as JSON.")
    assert r.tag(anthropic.parse_request(reworded), PATH) == "side"
    # Each part of the shape alone is not enough: a main turn may lack tools, or ask for JSON.
    no_schema = {k: v for k, v in reworded.items() if k != "output_config"}
    assert r.tag(anthropic.parse_request(no_schema), PATH) is None
    assert r.tag(anthropic.parse_request(dict(reworded, max_tokens=32000)), PATH) is None
    with_tools = dict(reworded, tools=CC_MAIN["tools"])
    assert r.tag(anthropic.parse_request(with_tools), PATH) is None


def test_the_generic_recipe_applies_claude_codes_rules_to_requests_from_claude_code():
    """`run -- python script.py` picks the generic recipe; the Agent SDK's requests carry the
    CLI's user agent, so its title call is still tagged."""
    tagger = recipes.Tagger("generic")
    title = anthropic.parse_request(CC_TITLE)
    assert tagger(title, PATH, CC_UA) == "title"
    assert tagger(title, PATH, {"user-agent": "claude-cli/2.1.197 (external, cli)"}) == "title"
    assert tagger(title, PATH, {"X-App": "cli"}) == "title"
    assert tagger(title, PATH, {"user-agent": "python-httpx/0.28"}) is None
    # A user agent sent twice (a wrapper adding its own): either value shows the sender.
    assert (
        tagger(title, PATH, MultiDict([("User-Agent", "wrapper/1"), ("user-agent", "claude-cli/2.1.332")]))
        == "title"
    )
    assert tagger(anthropic.parse_request(CC_MAIN), PATH, CC_UA) is None
    # A named recipe keeps to its own rules.
    assert recipes.Tagger("aider")(title, PATH, CC_UA) is None


def test_an_untagged_call_shaped_like_a_side_call_shows_its_signs():
    tagger = recipes.Tagger("generic")
    main, title = anthropic.parse_request(CC_MAIN), anthropic.parse_request(CC_TITLE)
    assert tagger.signs(main, "s1") == []  # sets the session's main shape
    assert tagger.signs(main, "s1") == []
    signs = tagger.signs(title, "s1")
    assert recipes.looks_like_side_call(signs)
    assert "a structured-output schema" in signs and "max_tokens 512" in signs
    assert any("no tools" in s for s in signs) and any("claude-haiku" in s for s in signs)
    # Another session has its own main shape; before any, only the request itself speaks.
    assert tagger.signs(title, "s2") == ["a structured-output schema", "max_tokens 512"]
    # A main turn that only changed model (a user's /model) is one sign: not flagged.
    other = anthropic.parse_request(dict(CC_MAIN, model="claude-opus-4-5"))
    assert not recipes.looks_like_side_call(tagger.signs(other, "s1"))


_WORDS = st.sampled_from(["title", "summar", "diff", "x", "commit"])


@given(
    rule=st.fixed_dictionaries(
        {},
        optional={
            "system_contains": _WORDS,
            "user_contains": _WORDS,
            "path_contains": st.sampled_from(["/v1/messages", "count", "/v1"]),
            "has_schema": st.booleans(),
            "has_tools": st.booleans(),
            "max_tokens_at_most": st.integers(0, 100),
        },
    ),
    system=st.lists(_WORDS, max_size=2),
    users=st.lists(_WORDS, max_size=2),
    tools=st.booleans(),
    schema=st.booleans(),
    max_tokens=st.none() | st.integers(0, 200),
    path=st.sampled_from(["/v1/messages", "/v1/messages/count_tokens", "/v1/chat"]),
)
def test_a_rule_matches_when_every_condition_it_gives_holds(
    rule, system, users, tools, schema, max_tokens, path
):
    """The short-circuit reading of a rule is the plain one: all its conditions, one at least."""
    from polar_mitm.neutral import ChatRequest, Message, Sampling, Tool

    req = ChatRequest(
        style="anthropic",
        messages=[Message(role="system", content=t) for t in system]
        + [Message(role="user", content=t) for t in users],
        tools=[Tool(name="t", description="", parameters={})] if tools else [],
        sampling=Sampling(max_tokens=max_tokens, json_schema={"type": "object"} if schema else None),
    )
    conds = []
    if "has_tools" in rule:
        conds.append(tools == rule["has_tools"])
    if "max_tokens_at_most" in rule:
        conds.append(max_tokens is not None and max_tokens <= rule["max_tokens_at_most"])
    if "system_contains" in rule:
        conds.append(rule["system_contains"] in "\n".join(system))
    if "user_contains" in rule:
        conds.append(bool(users) and rule["user_contains"] in users[-1])
    if "path_contains" in rule:
        conds.append(rule["path_contains"] in path)
    if "has_schema" in rule:
        conds.append(schema == rule["has_schema"])
    assert recipes.SideCall(tag="t", **rule).matches(req, path) == (bool(conds) and all(conds))


def test_a_session_judged_whole_finds_the_title_call_that_came_first():
    """The proxy judges a call as it arrives, against the main calls seen so far: a title call that
    comes first has none to compare with. Judged over the whole session, it stands out (no tools,
    another model than the main loop's), while the main calls do not."""
    from polar_mitm.recipes.side_calls import session_suspects

    title = anthropic.parse_request(
        {"model": "small", "max_tokens": 4096, "messages": [{"role": "user", "content": "title this"}]}
    )
    main = anthropic.parse_request(CC_MAIN)
    tagger = recipes.Tagger("generic")
    assert not recipes.looks_like_side_call(tagger.signs(title, "s"))  # as it arrived: nothing to say
    [(index, signs)] = session_suspects([title, main, main])
    assert index == 0 and any("no tools" in s for s in signs) and any("'small'" in s for s in signs)
    assert session_suspects([main, main]) == []
