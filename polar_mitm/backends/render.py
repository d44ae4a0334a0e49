"""Prompt rendering and splicing, as pure functions over a tokenizer.

Splice: when a request repeats an earlier assistant reply, the prompt is that earlier turn's
exact token sequence (prompt + sampled ids) followed by the new messages rendered alone. Turns
are therefore append-only by construction, and rendering costs grow with the new messages of a
turn, not with the whole context.

Matching an echoed reply to the turn that sampled it uses a hash chain over normalized messages
(`conversation_hashes`): volatile parts (cache markers, tool-call ids, whitespace, reasoning that
some harnesses drop) are left out, so the same conversation always hashes the same.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from polar_mitm.backends.tokenizer import Tokenizer
from polar_mitm.neutral import Message, Tool

_SENTINEL = "\u2063polar-splice\u2063"


def _message_key(m: Message) -> str:
    calls = [[c.name, c.arguments if c.raw is None else c.raw] for c in m.tool_calls]
    return json.dumps([m.role, m.content.strip(), calls], sort_keys=True, ensure_ascii=False)


def extend_hash(prev: str, message: Message) -> str:
    """The hash of a conversation one message longer than the one `prev` identifies."""
    return hashlib.sha256(prev.encode() + b"\x00" + _message_key(message).encode()).hexdigest()[:32]


def conversation_hashes(messages: list[Message], tools: list[Tool]) -> list[str]:
    """h[i] identifies the conversation made of the first i messages (and the tool set)."""
    h = hashlib.sha256(
        json.dumps([t.model_dump() for t in tools], sort_keys=True, ensure_ascii=False).encode()
    ).hexdigest()[:32]
    out = [h]
    for m in messages:
        h = extend_hash(h, m)
        out.append(h)
    return out


def render_full(
    tok: Tokenizer, messages: list[Message], tools: list[Tool], template_kwargs: dict[str, Any]
) -> list[int]:
    text = tok.render(
        [m.to_template() for m in messages],
        tools=[t.to_template() for t in tools] or None,
        add_generation_prompt=True,
        **template_kwargs,
    )
    return tok.encode(text)


class SpliceError(ValueError):
    """The template does not render new messages independently of the history."""


def render_continuation(
    tok: Tokenizer,
    new_messages: list[Message],
    prev_output_ids: list[int],
    template_kwargs: dict[str, Any],
) -> list[int]:
    """Token ids that follow an earlier turn's sampled ids to form the new prompt.

    Renders a stand-in conversation (one user and one assistant message) with and without the
    new messages; the difference is what the template puts after an assistant reply. The glue
    between the sampled ids and that difference is what the template writes after the reply's
    content: its end-of-turn marker (unless the model already sampled it) and any separator.
    """
    stand_in = [{"role": "user", "content": "u"}, {"role": "assistant", "content": _SENTINEL}]
    before = tok.render(stand_in, add_generation_prompt=False, **template_kwargs)
    after = tok.render(
        stand_in + [m.to_template() for m in new_messages], add_generation_prompt=True, **template_kwargs
    )
    if not after.startswith(before):
        raise SpliceError("chat template re-renders history when messages are appended")
    end = before.rfind(_SENTINEL)
    if end < 0:
        raise SpliceError("chat template dropped the assistant content")
    closing = before[end + len(_SENTINEL) :]  # e.g. "<|im_end|>\n"
    glue = closing
    if prev_output_ids and prev_output_ids[-1] in tok.eos_token_ids:
        eos_text = tok.decode([prev_output_ids[-1]])
        if closing.startswith(eos_text):
            glue = closing[len(eos_text) :]
    return tok.encode(glue + after[len(before) :])


def generation_opens_reasoning(tok: Tokenizer, template_kwargs: dict[str, Any]) -> bool:
    """Whether the template's generation prompt already opens a <think> block."""
    text = tok.render([{"role": "user", "content": "u"}], add_generation_prompt=True, **template_kwargs)
    tail = text.rstrip()
    return tail.endswith("<think>")
