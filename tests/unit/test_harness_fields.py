"""The request fields this month's harnesses send every turn are read or quietly ignored (each for
a reason written beside KNOWN_FIELDS), never warned about on every turn; other forms of the same
fields that would change what the policy sees are still said. Bodies as the harnesses send them."""

import pytest

from polar_mitm.providers import anthropic, openai_chat, openai_responses

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize(
    "extra",
    [
        {"preserve_thinking": True},  # Qwen Code 0.24 on DashScope
        {"thinking": {"type": "enabled", "keep": "all"}, "prompt_cache_key": "session_1"},  # Kimi Code 2.1.0
        {"session_id": "s1", "reasoning": {"effort": "medium"}},  # OpenRouter (hermes-agent)
        {"search_parameters": {"mode": "off"}},  # Grok CLI 0.0.34
    ],
)
def test_chat_completions_fields_of_current_harnesses_are_not_said(extra):
    assert openai_chat.unknown_fields({**CHAT, **extra}) == []


@pytest.mark.parametrize(
    "extra,thinking",
    [
        ({"thinking": {"type": "enabled", "keep": "all"}}, True),
        ({"thinking": {"type": "disabled"}}, False),
        ({"reasoning": {"enabled": False}}, False),
        ({"reasoning": {"effort": "high"}}, True),
        ({"reasoning": {"effort": "none"}}, False),
        ({"reasoning": {"exclude": True}}, None),
        # Qwen's own switch wins over the others.
        ({"enable_thinking": False, "thinking": {"type": "enabled"}}, False),
    ],
)
def test_moonshot_thinking_and_openrouter_reasoning_are_read_as_the_thinking_switch(extra, thinking):
    assert openai_chat.parse_request({**CHAT, **extra}).thinking is thinking


def test_server_side_compaction_is_quiet_and_other_context_editing_is_said():
    # OpenClaw 2026.9 on OpenAI Responses and on Anthropic Messages.
    body = {"model": "m", "input": [], "context_management": [{"type": "compaction", "compact_threshold": 9}]}
    assert openai_responses.unknown_fields(body) == []
    other = {"model": "m", "input": [], "context_management": [{"type": "truncate"}]}
    assert openai_responses.unknown_fields(other) == ["context_management"]
    edits = {"edits": [{"type": "compact_20260112", "trigger": {"type": "input_tokens", "value": 9}}]}
    assert anthropic.unknown_fields({"model": "m", "context_management": edits}) == []
    clears = {"edits": [*edits["edits"], {"type": "clear_tool_uses_20250919"}]}
    assert anthropic.unknown_fields({"model": "m", "context_management": clears}) == ["context_management"]
