"""Side calls of the new recipes' harnesses, as they send them, are tagged (not stored as a
second trajectory): the request bodies are cut down from real captures."""

import pytest

from polar_mitm import recipes
from polar_mitm.providers import openai_chat
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


@pytest.mark.parametrize(
    "recipe,parse,body,path,tag",
    [
        ("kilo", responses.parse_request, KILO_TITLE, "/v1/responses", "title"),
        ("aider", openai_chat.parse_request, AIDER_COMMIT, "/v1/chat/completions", "commit-message"),
        ("kimi-cli", openai_chat.parse_request, KIMI_COMPACTION, "/v1/chat/completions", "compaction"),
    ],
)
def test_side_calls_are_tagged(recipe, parse, body, path, tag):
    r = recipes.get(recipe)
    assert r.tag(parse(body), path) == tag
    # ...and the harness's main turn is not.
    main = (
        dict(body, input=body["input"][1:]) if "input" in body else dict(body, messages=body["messages"][1:])
    )
    assert r.tag(parse(main), path) is None
