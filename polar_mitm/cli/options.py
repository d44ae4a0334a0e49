"""Options several commands share (the policy's: backend, tokenizer, parsers, store, CA), so
`run`, `proxy` and `rollout` read them the same way.

Options that configure a model are made from the model's fields (`model_options`): every field is
an option (named after the field unless its `Flag` names it otherwise), typed, bounded and
defaulted by the field, and only the options given are passed on (the field's own default holds
otherwise). The policy's are `PolicyConfig`'s (`policy_options`, `make_policy_config`); the
pipeline's sizes are `RolloutOptions`' (`cli/rollout.py`'s `worker_options`), the server's are
`ServerConfig`'s (`cli/service.py`'s `server_options`). A new field is
a new option; a `Flag` only adds what the field cannot say (help, an environment variable, a check).
"""

from __future__ import annotations

import types
import typing
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import annotated_types
import click
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from polar_mitm.backends.parsers import (
    REASONING_PARSERS,
    TOOL_PARSERS,
    check_reasoning_parser,
    check_tool_parser,
)
from polar_mitm.policy.config import PolicyConfig

DB_HELP = "SQLite database of sessions and turns [env POLAR_MITM_DB; default polar-mitm.sqlite]"


def _parser_name(check):
    """A callback refusing, at start-up, a parser name we do not implement (the error lists ours)."""

    def callback(ctx, param, value):
        try:
            check(value)
        except ValueError as e:
            raise click.BadParameter(str(e)) from None
        return value

    return callback


@dataclass(frozen=True)
class Flag:
    """What the command line adds to one field of a model."""

    help: str
    name: str | None = None  # the option, when not --field-name
    envvar: str | None = None
    default: str | None = None  # how the default reads in --help, when not the field's value
    callback: Callable[..., Any] | None = None
    multiple: bool = False  # given several times (the callback, or the model, joins the values)
    switch: bool = False  # a bool field given bare (--polar-api), not with a value
    type: click.ParamType | None = None  # when the annotation cannot say it (a directory that exists)
    metavar: str | None = None


def _join_urls(ctx, param, value):
    """`--backend` given several times (or POLAR_MITM_BACKEND with several URLs): one field,
    the URLs separated by commas; None when not given."""
    urls = [u for v in value or () for u in v.replace(",", " ").split()]
    return ",".join(urls) if urls else None


FLAGS: dict[str, Flag] = {
    "backend_url": Flag(
        "SGLang server or router URL; give it several times for several engines without a router "
        "(each conversation pinned to one by its routing key; a dead engine's conversations move)",
        name="--backend",
        envvar="POLAR_MITM_BACKEND",
        callback=_join_urls,
        multiple=True,
    ),
    "backend_api_key": Flag(
        "API key of the engines (their --api-key), sent as 'Authorization: Bearer' on every call; "
        "prefer the environment variable: a value on the command line is visible to other users in ps",
        envvar="POLAR_MITM_BACKEND_API_KEY",
        default="none",
    ),
    "backend_kind": Flag(
        "Which engine's API: sglang (/generate), vllm (/v1/completions with token-id prompts, "
        "return_token_ids; vLLM >= 0.10.2), vllm-generate (vLLM's token-in, token-out "
        "/inference/v1/generate: no prompt echo, weight versions in every reply; vLLM >= 0.32 with "
        "--enable-scale-out), auto (SGLang's /model_info, else vLLM's /v1/models: vllm)."
    ),
    "context_length": Flag(
        "The model's context length, when the backend reports none (given, it wins over the backend's).",
        default="the backend's /get_server_info or /v1/models",
    ),
    "backend_wait": Flag(
        "Seconds to wait at start-up for a router to have a worker (503 no_workers) before giving up."
    ),
    "engine_dead_after": Flag(
        "While a turn waits on the engine (its first token, or a silence mid-stream), the engine's "
        "liveness is probed (SGLang: /health_generate); failing it this many seconds fails the turn "
        "with a retryable error (and with several --backend URLs moves the conversation). Also bounds "
        "each request for the model info; 0: no probing."
    ),
    "engine_probe_interval": Flag("Seconds between those liveness probes."),
    "tokenizer": Flag(
        "Hugging Face tokenizer directory",
        envvar="POLAR_MITM_TOKENIZER",
        default="the server's /model_info",
    ),
    "tool_parser": Flag(
        f"SGLang tool-call parser name ({', '.join(sorted(TOOL_PARSERS))}; 'none' to disable)",
        default="the server's",
        callback=_parser_name(check_tool_parser),
    ),
    "reasoning_parser": Flag(
        f"SGLang reasoning parser name ({', '.join(sorted(REASONING_PARSERS))}; 'none' to disable)",
        default="the server's",
        callback=_parser_name(check_reasoning_parser),
    ),
    "history": Flag(
        "splice: echoed replies become the exact sampled ids; template: render history canonically."
    ),
    "backend_mode": Flag(
        "render: polar-mitm renders the prompt and calls /generate; chat: the server renders it "
        "(/v1/chat/completions, returning token ids) and replies arrive whole."
    ),
    "default_max_tokens": Flag("Tokens to sample when a harness asks for no limit."),
    "max_tokens_cap": Flag("Clamp the max_tokens harnesses ask for.", default="no cap"),
    "max_request_bytes": Flag(
        "Largest request body a harness may send; a larger one gets a 413 in its provider's "
        "error shape, unread.",
        default="32 MiB",
    ),
    "max_session_bytes_in_flight": Flag(
        "Request body bytes one session may have in the proxy's memory at once, over all its "
        "connections; a request that would pass it gets a 413 naming it, unread (a sandbox's huge "
        "bodies cost the proxy at most this).",
        default="64 MiB",
    ),
    "ping_interval": Flag("Seconds between keep-alive events while a reply is generated."),
    "first_token_timeout": Flag(
        "Seconds to wait for the backend's first token (a long prompt on a busy engine) before "
        "the turn fails and the harness is told to retry; for the whole reply when it comes whole "
        "(chat backend mode, --backend-stream whole); "
        "0 waits forever"
    ),
    "idle_timeout": Flag(
        "Seconds of backend silence between streamed tokens before the turn fails (its tokens "
        "are kept as an 'error' turn); 0 waits forever"
    ),
    "backend_stream": Flag(
        "How replies come from the backend. stream: streamed as sampled; whole: in one piece, the "
        "harness kept alive with pings meanwhile; auto: stream when the server streams "
        "incrementally (SGLang's --incremental-streaming-output), else whole (SGLang's default "
        "cumulative chunks cost O(n^2) for an n-token reply)."
    ),
    "prefix_cache_tokens": Flag(
        "Tokens of rendered prompt prefixes kept across sessions (a prompt's system prompt and "
        "tools, and its first turn through its last end-of-turn token), so what many sessions "
        "share is tokenized once (least recently used out first); 0: off."
    ),
    "chunk_interval": Flag(
        "Seconds between reply events while a reply streams from the backend: chunks arriving "
        "meanwhile go to the harness together (the last at once); 0 sends each as it arrives."
    ),
}


def _click_type(field: str, annotation: Any, metadata: Iterable[Any] = ()) -> click.ParamType:
    """The click type of a field's annotation (`X | None` reads as X: None is the field's default);
    an int with a lower bound (`Field(ge=1)`) is a click.IntRange, refused on the command line."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    origin = typing.get_origin(annotation)
    if origin in (list, tuple) and args:  # an option given several times: each value's type
        return _click_type(field, args[0], metadata)
    if origin is typing.Literal:
        return click.Choice([str(a) for a in typing.get_args(annotation)])
    if origin in (typing.Union, types.UnionType) and len(args) == 1:
        return _click_type(field, args[0], metadata)
    if annotation is int:
        low = [m.ge for m in metadata if isinstance(m, annotated_types.Ge) and isinstance(m.ge, int)]
        if low:
            return click.IntRange(min=low[0])
    if annotation in (str, int, float, bool):
        return click.types.convert_type(annotation)
    raise TypeError(f"{field}: no command-line type for {annotation!r}; declare one in cli/options.py")


def _option(field: str, info: FieldInfo, flags: dict[str, Flag]) -> Callable[[Any], Any]:
    flag = flags.get(field, Flag(field.replace("_", " ").capitalize() + "."))
    default = flag.default if flag.default is not None else info.default
    env = f"env {flag.envvar}; " if flag.envvar else ""
    if flag.switch:  # a bare flag: given means True, and its help needs no default
        kind, said = None, flag.help + (f" [env {flag.envvar}]" if flag.envvar else "")
    else:
        kind = flag.type or _click_type(field, info.annotation, info.metadata)
        said = f"{flag.help} [{env}default: {default}]"
    return click.option(
        flag.name or "--" + field.replace("_", "-"),
        field,
        type=kind,
        is_flag=flag.switch,
        default=None,  # not given: the field's own default
        envvar=flag.envvar,
        callback=flag.callback,
        multiple=flag.multiple,
        metavar=flag.metavar,
        help=said,
    )


# Not a field: a shorthand that sets both timeouts.
BACKEND_TIMEOUT = click.option(
    "--backend-timeout",
    type=float,
    default=None,
    help="Sets both --first-token-timeout and --idle-timeout (either one given too wins).",
)


def model_options(
    model: type[BaseModel], flags: dict[str, Flag], fields: Iterable[str] | None = None
) -> Callable[[Any], Any]:
    """A decorator adding `fields` of `model` (all of them when None) as options, in that order;
    each passes None when not given (see `given`)."""
    names = list(model.model_fields) if fields is None else list(fields)

    def decorate(f):
        for field in reversed(names):
            f = _option(field, model.model_fields[field], flags)(f)
        return f

    return decorate


def given(options: dict[str, Any], fields: Iterable[str]) -> dict[str, Any]:
    """Take `fields` out of a command's keyword arguments: those given on the command line (not
    None), to pass to the model, whose own defaults hold for the rest."""
    return {f: v for f in fields if (v := options.pop(f, None)) is not None}


def policy_options(f):
    """Every PolicyConfig field as an option (in the field order), then --backend-timeout, --db, --certs."""
    f = click.option("--certs", type=click.Path(path_type=Path), default=None, help="CA directory.")(f)
    f = click.option(
        "--db", envvar="POLAR_MITM_DB", default="polar-mitm.sqlite", show_default=True, help=DB_HELP
    )(f)
    f = BACKEND_TIMEOUT(f)
    return model_options(PolicyConfig, FLAGS)(f)


def make_policy_config(backend_timeout: float | None = None, **options: Any) -> PolicyConfig:
    """The PolicyConfig of `policy_options`' values: every option given sets its field."""
    unknown = set(options) - set(PolicyConfig.model_fields)
    if unknown:
        raise TypeError(f"not PolicyConfig fields: {', '.join(sorted(unknown))}")
    if backend_timeout is not None:
        for field in ("first_token_timeout", "idle_timeout"):
            if options.get(field) is None:
                options[field] = backend_timeout
    return PolicyConfig(**{k: v for k, v in options.items() if v is not None})


def split_listen(value: str, example: str = "127.0.0.1:8080") -> tuple[str, int]:
    """A `--listen HOST:PORT` value as (host, port): brackets of an IPv6 host stripped, an empty
    host meaning 127.0.0.1; a click error naming the option when it is not HOST:PORT."""
    host, _, port = value.rpartition(":")
    if not port.isdigit() or not 0 <= int(port) <= 65535:
        raise click.BadParameter(f"{value!r} is not HOST:PORT (e.g. {example})", param_hint="--listen")
    return host.strip("[]") or "127.0.0.1", int(port)


def listen_option(ctx: click.Context, param: click.Parameter, value: str) -> tuple[str, int]:
    """`split_listen` as a click callback."""
    return split_listen(value)
