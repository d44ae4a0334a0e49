"""The side-call rules' memo of system prompts is shared by the whole process: whatever order
many prompts and rules are asked in (more prompts than it keeps), each answer is the one a
plain `needle in prompt` gives."""

import random

from polar_mitm.neutral import ChatRequest, Message
from polar_mitm.recipes import CallText


def test_the_system_prompt_memo_answers_as_the_text_does_in_any_order():
    rng = random.Random(7)
    words = ["title", "commit", "summar", "You are", "git", "diff", "x" * 50]
    prompts = [" ".join(rng.sample(words, 3)) + f" #{i}" for i in range(80)]
    needles = [*words, "#1", "#79", "absent"]
    for _ in range(2000):
        system, needle = rng.choice(prompts), rng.choice(needles)
        req = ChatRequest(style="anthropic", messages=[Message(role="system", content=system)])
        assert CallText(req).system_contains(needle) is (needle in system), (system, needle)
