"""Hypothesis strategies shared by the property tests: any JSON value, biased towards what the
parsers of harness requests and tool schemas branch on."""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

from polar_mitm.providers import fields

# Words the parsers branch on, so mutations reach the branches and not only the fallbacks.
WORDS = [
    "text", "image", "document", "thinking", "tool_use", "tool_result", "server_tool_use", "function",
    "custom", "local_shell", "namespace", "message", "reasoning", "function_call",
    "function_call_output", "custom_tool_call", "local_shell_call", "compaction", "compaction_trigger",
    "item_reference", "input_text", "output_text", "refusal", "input_image", "json_schema",
    "json_object", "auto", "any", "none", "required", "tool", "user", "assistant", "system",
    "developer", "model", "enabled", "AUTO", "ANY", "OBJECT", "object", "string", "array",
]  # fmt: skip
KEYS = [
    "type", "name", "text", "content", "role", "input", "input_schema", "parameters", "description",
    "tools", "tool_choice", "messages", "contents", "parts", "functionCall", "functionResponse",
    "args", "arguments", "tool_calls", "tool_call_id", "call_id", "id", "output", "stream",
    "max_tokens", "max_output_tokens", "temperature", "response_format", "text", "format",
    "generationConfig", "responseJsonSchema", "thinkingConfig", "systemInstruction", "system",
    "properties", "items", "enum", "anyOf", "$ref", "required", "encrypted_content", "summary",
]  # fmt: skip
SURROGATES = ["\ud800", "a\udfffb", "\udc00\ud800"]


def deep(depth: int = fields.MAX_DEPTH + 5) -> Any:
    """A list nested `depth` deep (too deep for the gateway by default)."""
    v: Any = "x"
    for _ in range(depth):
        v = [v]
    return v


leaves = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.sampled_from(WORDS + SURROGATES),
)
json_values = st.recursive(
    leaves,
    lambda children: (
        st.lists(children, max_size=3)
        | st.dictionaries(st.sampled_from(KEYS) | st.text(max_size=6), children, max_size=3)
    ),
    max_leaves=8,
)
