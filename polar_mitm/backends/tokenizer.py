"""The policy's tokenizer at run time: text ⇄ token ids, and chat messages → prompt text.

Loads a Hugging Face tokenizer directory (`tokenizer.json`, `tokenizer_config.json`, optionally
`chat_template.jinja` and `generation_config.json`) with the `tokenizers` library and renders its
chat template with jinja2 the way transformers' `apply_chat_template(tokenize=False)` does, without
importing transformers. Special-token strings inside text encode to their single ids, and decoding
gives exactly what transformers' decode gives.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _RustTokenizer

from polar_mitm.once import once

# Names a message's reasoning arrives under; templates read the first. transformers aliases them too.
_REASONING_FIELDS = ("reasoning_content", "reasoning", "thinking")
# End-of-turn tokens of ChatML models, counted as EOS whenever the vocabulary has them.
_CHATML_EOS = ("<|im_end|>", "<|endoftext|>")


class Tokenizer:
    """A loaded tokenizer directory. Build one with `Tokenizer.load(path)`, which caches per path."""

    path: str
    eos_token_ids: frozenset[int]
    vocab_size: int

    def __init__(self, path: str | Path) -> None:
        path = Path(path)
        if path.is_file() and path.name == "tokenizer.json":
            path = path.parent
        if not path.is_dir():
            raise ValueError(
                f"Tokenizer directory {str(path)!r} does not exist. Pass a Hugging Face tokenizer directory "
                "(with tokenizer.json and tokenizer_config.json), e.g. one built by `ensure_tokenizer()`."
            )
        tokenizer_file = path / "tokenizer.json"
        if not tokenizer_file.is_file():
            present = sorted(p.name for p in path.iterdir())[:10]
            raise ValueError(
                f"Tokenizer directory {str(path)!r} has no tokenizer.json (found: {present}). Only fast "
                "(tokenizers-library) tokenizers are supported; save one with "
                "`AutoTokenizer.from_pretrained(...).save_pretrained(dir)`."
            )
        self.path = str(path)
        self._rust = _RustTokenizer.from_file(str(tokenizer_file))
        self._config: dict[str, Any] = _read_json(path / "tokenizer_config.json")
        self._generation_config: dict[str, Any] = _read_json(path / "generation_config.json")
        self._chat_template = _find_chat_template(path, self._config)

        self.vocab_size = self._rust.get_vocab_size(with_added_tokens=True)
        self.eos_token_ids = frozenset(self._eos_ids())

    @classmethod
    def load(cls, path: str | Path) -> Tokenizer:
        """The tokenizer in directory `path`, loaded once per resolved path and shared afterwards.
        Single-flight (`polar_mitm.once`): loading a 150k vocabulary takes a second of a core, and
        the callers that come meanwhile wait for that one load instead of each starting their own
        (other directories load meanwhile)."""
        resolved = Path(path).expanduser().resolve()
        if resolved.name == "tokenizer.json" and resolved.is_file():
            resolved = resolved.parent
        return _load(resolved)

    def ready(self) -> Tokenizer:
        """Compile the chat template now (once per template text in the process), so that the
        first render does not: call it where the load runs, off an event loop. A template that
        does not compile says so at its first render."""
        if self._chat_template is not None:
            with contextlib.suppress(jinja2.TemplateError):
                _compile(self._chat_template)
        return self

    def __repr__(self) -> str:
        return f"Tokenizer({self.path!r}, vocab_size={self.vocab_size})"

    # --- text ⇄ ids -------------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; no BOS/EOS is added, special-token strings become their single ids."""
        return self._rust.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Text of `ids`, as transformers' `decode` gives it."""
        text = self._rust.decode(list(ids), skip_special_tokens=skip_special_tokens)
        if self._config.get("clean_up_tokenization_spaces") is True:
            text = _clean_up_tokenization(text)
        return text

    def decode_each(self, ids: Sequence[int]) -> list[str]:
        """The text of each id on its own, as `decode([i])` gives it (in one batch: the library
        decodes it on every core)."""
        texts = self._rust.decode_batch([[i] for i in ids], skip_special_tokens=False)
        if self._config.get("clean_up_tokenization_spaces") is True:
            texts = [_clean_up_tokenization(t) for t in texts]
        return texts

    def entries(self) -> list[str]:
        """Every vocabulary entry, added tokens too (in the model's byte-level alphabet)."""
        return list(self._rust.get_vocab(with_added_tokens=True))

    def count(self, text: str) -> int:
        """How many tokens `text` encodes to."""
        return len(self.encode(text))

    def token_id(self, token: str) -> int | None:
        """The id of one vocabulary entry (e.g. "<|im_end|>"), or None if it is not in the vocabulary."""
        return self._rust.token_to_id(token)

    def id_to_token(self, i: int) -> str | None:
        """The vocabulary entry of id `i` (in the model's byte-level alphabet), or None."""
        return self._rust.id_to_token(i)

    @cached_property
    def added_ids(self) -> frozenset[int]:
        """Ids of the added tokens (`<|im_start|>`, ...): the tokenizer splits them out of a text
        before anything else, so the text between two of them is tokenized on its own."""
        return frozenset(self._rust.get_added_tokens_decoder())

    @cached_property
    def turn_ends(self) -> tuple[tuple[str, int], ...]:
        """(text, id) of the end-of-turn special tokens a prompt can be cut right after with the
        ids on both sides unchanged (see `render.PrefixCache`): special tokens matched in the raw
        text anywhere (not normalized first, not whole words only) that no other added token
        contains."""
        added = self._rust.get_added_tokens_decoder()
        contents = [t.content for t in added.values()]
        out = []
        for i in sorted(self.eos_token_ids):
            t = added.get(i)
            if t is None or not t.special or t.normalized or t.single_word or not t.content:
                continue
            if sum(t.content in c for c in contents) == 1:
                out.append((t.content, i))
        return tuple(out)

    # --- chat template ----------------------------------------------------------------------

    @property
    def chat_template(self) -> str | None:
        return self._chat_template

    def render(
        self,
        messages: list[dict],
        tools: list[dict] | None = None,
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> str:
        """The prompt text for `messages`, as `apply_chat_template(tokenize=False)` renders it.

        `template_kwargs` reach the template as variables (e.g. `enable_thinking=False`).
        """
        template = self._template()
        variables: dict[str, Any] = {**self._special_tokens_map, **template_kwargs}
        return template.render(
            messages=[_alias_reasoning(m) for m in messages],
            tools=tools,
            documents=variables.pop("documents", None),
            add_generation_prompt=add_generation_prompt,
            **variables,
        )

    def _template(self) -> jinja2.Template:
        if self._chat_template is None:
            raise ValueError(
                f"Tokenizer directory {self.path!r} has no chat template: expected chat_template.jinja or "
                "a `chat_template` entry in tokenizer_config.json."
            )
        return _compile(self._chat_template)

    @cached_property
    def _special_tokens_map(self) -> dict[str, Any]:
        # transformers passes the tokenizer's special tokens that are set; unset ones stay undefined.
        out: dict[str, Any] = {}
        for name in (
            "bos_token",
            "eos_token",
            "unk_token",
            "sep_token",
            "pad_token",
            "cls_token",
            "mask_token",
        ):
            token = _token_content(self._config.get(name))
            if token is not None:
                out[name] = token
        extra = self._config.get("additional_special_tokens")
        if extra:
            out["additional_special_tokens"] = [_token_content(t) for t in extra]
        return out

    def _eos_ids(self) -> set[int]:
        ids: set[int] = set()
        eos = _token_content(self._config.get("eos_token"))
        if eos is not None and (i := self.token_id(eos)) is not None:
            ids.add(i)
        for token in _CHATML_EOS:
            if (i := self.token_id(token)) is not None:
                ids.add(i)
        generation_eos = self._generation_config.get("eos_token_id")
        if isinstance(generation_eos, int):
            ids.add(generation_eos)
        elif isinstance(generation_eos, list):
            ids.update(i for i in generation_eos if isinstance(i, int))
        return ids


@once
def _load(directory: Path) -> Tokenizer:
    return Tokenizer(directory)


@once
def _compile(template: str) -> jinja2.Template:
    """A chat template compiled (~50 ms for Qwen's, more on a loaded machine), once per text."""
    return _jinja_environment().from_string(template)


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e
    return data if isinstance(data, dict) else {}


def _find_chat_template(directory: Path, config: Mapping[str, Any]) -> str | None:
    # A chat_template.jinja beside the config wins, as in transformers.
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": "..."}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def _token_content(token: Any) -> str | None:
    # tokenizer_config stores special tokens either as strings or as serialized AddedToken dicts.
    if isinstance(token, dict):
        token = token.get("content")
    return token if isinstance(token, str) else None


def _alias_reasoning(message: Any) -> Any:
    if not isinstance(message, Mapping):
        return message
    reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


def _clean_up_tokenization(text: str) -> str:
    # The legacy English clean-up transformers applies when a config asks for it.
    for before, after in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't")):
        text = text.replace(before, after)
    for suffix in ("'m", "'s", "'ve", "'re"):
        text = text.replace(" " + suffix, suffix)
    return text


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | str | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # jinja's own tojson escapes HTML characters; chat templates expect plain json.dumps.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}…{% endgeneration %}`, which some templates use to mark assistant spans for
    transformers' assistant-token masks; here it renders its body unchanged."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


def _jinja_environment() -> ImmutableSandboxedEnvironment:
    # Chat templates ship with models and are untrusted code: the sandbox is not optional.
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols, _GenerationTag]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env
