"""Options several commands share (the policy's: backend, tokenizer, parsers, store, CA), so
`run`, `proxy` and `rollout` read them the same way."""

from __future__ import annotations

from pathlib import Path

import click

from polar_mitm.backends.parsers import (
    REASONING_PARSERS,
    TOOL_PARSERS,
    check_reasoning_parser,
    check_tool_parser,
)
from polar_mitm.backends.policy import PolicyConfig

BACKEND_HELP = "SGLang server URL [env POLAR_MITM_BACKEND; default http://127.0.0.1:30000]"
TOKENIZER_HELP = (
    "Hugging Face tokenizer directory [env POLAR_MITM_TOKENIZER; default: the server's /model_info]"
)
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


def policy_options(f):
    f = click.option(
        "--backend", envvar="POLAR_MITM_BACKEND", default="http://127.0.0.1:30000", help=BACKEND_HELP
    )(f)
    f = click.option("--tokenizer", envvar="POLAR_MITM_TOKENIZER", default=None, help=TOKENIZER_HELP)(f)
    f = click.option(
        "--tool-parser",
        default=None,
        callback=_parser_name(check_tool_parser),
        help=f"SGLang tool-call parser name ({', '.join(sorted(TOOL_PARSERS))}; 'none' to disable) "
        "[default: server's]",
    )(f)
    f = click.option(
        "--reasoning-parser",
        default=None,
        callback=_parser_name(check_reasoning_parser),
        help=f"SGLang reasoning parser name ({', '.join(sorted(REASONING_PARSERS))}; 'none' to disable) "
        "[default: server's]",
    )(f)
    f = click.option(
        "--history",
        type=click.Choice(["splice", "template"]),
        default="splice",
        show_default=True,
        help="splice: echoed replies become the exact sampled ids; template: render history canonically.",
    )(f)
    f = click.option(
        "--max-tokens-cap", type=int, default=None, help="Clamp the max_tokens harnesses ask for."
    )(f)
    f = click.option(
        "--first-token-timeout",
        type=float,
        default=None,
        help="Seconds to wait for the backend's first token (a long prompt on a busy engine) before "
        "the turn fails and the harness is told to retry; in chat backend mode, for the whole reply; "
        f"0 waits forever [default: {PolicyConfig().first_token_timeout:g}]",
    )(f)
    f = click.option(
        "--idle-timeout",
        type=float,
        default=None,
        help="Seconds of backend silence between streamed tokens before the turn fails (its tokens "
        f"are kept as an 'error' turn); 0 waits forever [default: {PolicyConfig().idle_timeout:g}]",
    )(f)
    f = click.option(
        "--backend-timeout",
        type=float,
        default=None,
        help="Sets both --first-token-timeout and --idle-timeout (either one given too wins).",
    )(f)
    f = click.option(
        "--db", envvar="POLAR_MITM_DB", default="polar-mitm.sqlite", show_default=True, help=DB_HELP
    )(f)
    f = click.option("--certs", type=click.Path(path_type=Path), default=None, help="CA directory.")(f)
    return f


def make_policy_config(
    backend,
    tokenizer,
    tool_parser,
    reasoning_parser,
    history,
    max_tokens_cap,
    first_token_timeout=None,
    idle_timeout=None,
    backend_timeout=None,
):
    timeouts = {
        "first_token_timeout": first_token_timeout if first_token_timeout is not None else backend_timeout,
        "idle_timeout": idle_timeout if idle_timeout is not None else backend_timeout,
    }
    return PolicyConfig(
        backend_url=backend,
        tokenizer=tokenizer,
        tool_parser=tool_parser,
        reasoning_parser=reasoning_parser,
        history=history,
        max_tokens_cap=max_tokens_cap,
        **{k: v for k, v in timeouts.items() if v is not None},
    )
