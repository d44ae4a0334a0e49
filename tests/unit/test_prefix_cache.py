"""The cross-session prefix cache: the first block of a prompt (system prompt and tools) is
tokenized once, and the ids are exactly those the whole prompt encodes to, for every tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from polar_mitm.backends.engine_api import ids_json
from polar_mitm.backends.render import PrefixCache, PromptIds, render_full
from polar_mitm.backends.tokenizer import Tokenizer
from polar_mitm.neutral import Message, Tool, ToolCall

LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)


@pytest.fixture(scope="session")
def metaspace_tokenizer_dir(tmp_path_factory) -> Path:
    """A SentencePiece-style BPE (Metaspace, ▁ prepended only at the start of the input) with a
    Llama 3 chat template: encoding the text after a special token on its own would differ."""
    from tokenizers import Tokenizer as Rust
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tk = Rust(models.BPE(unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tk.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    specials = ["<unk>", "<|begin_of_text|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>"]
    corpus = ["You are a helpful assistant. List the files, then run the tests and report."] * 50
    tk.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=300, special_tokens=specials))
    d = tmp_path_factory.mktemp("metaspace")
    tk.save(str(d / "tokenizer.json"))
    config = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>", "chat_template": LLAMA3_TEMPLATE}
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    return d


SYSTEM = "You are a coding agent.\n\nRules:\n- be brief <|im_end|> is text here\n- ünïcödé ✓ " * 20
TOOLS = [
    Tool(
        name="Bash", description="Run a command", parameters={"type": "object", "properties": {"command": {}}}
    ),
    Tool(name="Read", description="Read a file"),
]


def conversations(system: str) -> list[tuple[list[Message], list[Tool]]]:
    call = ToolCall(id="c1", name="Bash", arguments={"command": "ls"})
    return [
        ([Message(role="system", content=system), Message(role="user", content="list the files")], TOOLS),
        ([Message(role="system", content=system), Message(role="user", content="  leading spaces")], TOOLS),
        ([Message(role="system", content=system), Message(role="user", content="\nnewline first")], []),
        ([Message(role="user", content="no system prompt")], TOOLS),
        ([Message(role="user", content="nothing shared at all")], []),
        (
            [
                Message(role="system", content=system),
                Message(role="user", content="go"),
                Message(role="assistant", content="ok", tool_calls=[call]),
                Message(role="tool", content="a.txt\nb.txt", tool_call_id="c1"),
            ],
            TOOLS,
        ),
    ]


@pytest.mark.parametrize("kind", ["qwen", "tiny", "metaspace"])
def test_cached_prefixes_give_the_ids_a_full_render_gives(kind, request):
    fixture = {
        "qwen": "qwen_tokenizer_dir",
        "tiny": "tiny_tokenizer_dir",
        "metaspace": "metaspace_tokenizer_dir",
    }
    tok = Tokenizer.load(request.getfixturevalue(fixture[kind]))
    assert tok.turn_ends  # the cache has a boundary to cut at
    cache = PrefixCache()
    for system in (SYSTEM, SYSTEM + " (another prompt)"):
        for rnd in range(2):  # the first round fills the cache, the second reads it
            for messages, tools in conversations(system):
                for kw in ({}, {"enable_thinking": False}):
                    want = render_full(tok, messages, tools, kw)
                    got = render_full(tok, messages, tools, kw, cache)
                    assert got == want, (kind, rnd, kw, messages[0].content[:20])
                    if isinstance(got, PromptIds):  # its serialized form, as sent to the backend
                        assert got.serialized() == ids_json(want)
    assert cache.hits > cache.misses > 0


def test_the_text_after_the_cut_is_encoded_as_inside_the_whole_prompt(metaspace_tokenizer_dir):
    # Why the rest is encoded behind its boundary token: on its own it would gain a leading ▁.
    tok = Tokenizer.load(metaspace_tokenizer_dir)
    text = "<|start_header_id|>system<|end_header_id|>be brief<|eot_id|>run the tests"
    cut = text.index("<|eot_id|>") + len("<|eot_id|>")
    assert tok.encode(text[:cut]) + tok.encode(text[cut:]) != tok.encode(text)
    cache = PrefixCache()
    assert cache.encode(tok, text) == tok.encode(text) == cache.encode(tok, text)
    assert (cache.misses, cache.hits) == (1, 1)


def test_sessions_sharing_a_system_prompt_and_tools_tokenize_it_once(qwen_tokenizer_dir):
    tok = Tokenizer.load(qwen_tokenizer_dir)
    cache = PrefixCache()
    system = "You are a coding agent. Be brief. " * 50
    for i in range(5):
        msgs = [Message(role="system", content=system), Message(role="user", content=f"task {i}")]
        render_full(tok, msgs, TOOLS, {}, cache)
    assert (cache.misses, cache.hits) == (1, 4)
    other_tools = [Tool(name="Write")]
    render_full(
        tok,
        [Message(role="system", content=SYSTEM), Message(role="user", content="x")],
        other_tools,
        {},
        cache,
    )
    assert cache.misses == 2  # other tools: another first block


def test_the_cache_is_bounded_by_tokens_least_recently_used_out_first(qwen_tokenizer_dir):
    tok = Tokenizer.load(qwen_tokenizer_dir)
    one = len(render_full(tok, [Message(role="system", content="p0 " * 200)], [], {}))
    cache = PrefixCache(max_tokens=int(one * 2.5))

    def turn1(prompt: str) -> None:  # one end-of-turn token: one kept prefix a prompt
        render_full(tok, [Message(role="system", content=prompt * 200)], [], {}, cache)

    turn1("p0 ")
    turn1("p1 ")
    turn1("p0 ")  # p0 is now the most recently used
    turn1("p2 ")  # evicts p1
    assert cache.size <= cache.max_tokens and len(cache._items) == 2
    hits = cache.hits
    turn1("p0 ")
    assert cache.hits == hits + 1
    turn1("p1 ")
    assert cache.misses == 4
    off = PrefixCache(max_tokens=0)
    turn1_ids = render_full(tok, [Message(role="system", content="x")], [], {}, off)
    assert turn1_ids == render_full(tok, [Message(role="system", content="x")], [], {}) and off.size == 0


def test_samples_of_one_task_encode_only_what_follows_their_shared_first_turn(qwen_tokenizer_dir):
    """The prompt through its last end-of-turn token is kept too: another sample of the task
    (same system prompt, tools and instruction) encodes only the generation prompt after it; a
    sample of another task still reuses the first block, which that hit kept in use."""
    tok = Tokenizer.load(qwen_tokenizer_dir)
    system = "You are a coding agent. Be brief. " * 50
    task = "Fix the failing test in tests/test_x.py. " * 40

    def first_turn(instruction: str) -> list[int]:
        msgs = [Message(role="system", content=system), Message(role="user", content=instruction)]
        return render_full(tok, msgs, TOOLS, {}, cache)

    one = len(render_full(tok, [Message(role="system", content=system)], TOOLS, {}))
    cache = PrefixCache(max_tokens=int(one * 2.9))  # the first block and one task's first turn
    want = render_full(
        tok, [Message(role="system", content=system), Message(role="user", content=task)], TOOLS, {}
    )
    assert first_turn(task) == want and (cache.misses, cache.hits, len(cache._items)) == (1, 0, 2)
    calls: list[str] = []
    encode = tok.encode
    tok.encode = lambda text: calls.append(text) or encode(text)  # type: ignore[method-assign]
    got = first_turn(task)
    assert got == want and isinstance(got, PromptIds) and got.serialized() == ids_json(want)
    assert cache.hits == 1 and calls == ["<|im_end|>\n<|im_start|>assistant\n"]  # the rest only
    calls.clear()
    other = first_turn("Another task entirely.")
    assert cache.hits == 2 and all(len(c) < 100 for c in calls), calls  # from the first block on
    assert other == render_full(tok, [Message(role="system", content=system), Message(role="user", content="Another task entirely.")], TOOLS, {})  # fmt: skip
    # The cache holds two prompts' worth: the other task's first turn pushed out the first one's,
    # but not the first block, which both hits kept in use.
    assert len(cache._items) == 2 and cache.size <= cache.max_tokens
    first_turn("Another task entirely.")
    assert cache.hits == 3
