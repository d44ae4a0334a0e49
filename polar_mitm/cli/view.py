"""`polar-mitm view`: serve the viewer, listed in `app.py`'s `LAZY`."""

from __future__ import annotations

import asyncio
import signal
import webbrowser
from pathlib import Path

import click

from polar_mitm.cli.options import split_listen
from polar_mitm.netaddr import is_loopback
from polar_mitm.reconstruct.viewers import register as _register
from polar_mitm.reconstruct.viewers import running_url  # noqa: F401  (show asks it)


def _listen(ctx: click.Context, param: click.Parameter, value: str) -> tuple[str, int]:
    return split_listen(value, "127.0.0.1:8790")


@click.command()
@click.option(
    "--db",
    type=click.Path(dir_okay=False, path_type=Path),
    envvar="POLAR_MITM_DB",
    default=Path("polar-mitm.sqlite"),
    show_default=True,
    show_envvar=True,
    help="The store to show (it may appear later: pages say so until it does).",
)
@click.option(
    "--server",
    envvar="POLAR_MITM_SERVER",
    default=None,
    help="A rollout service (`polar-mitm serve`) to watch on the live page; its token found as "
    "`submit` finds it (POLAR_MITM_SERVICE_TOKEN, else the token file serve writes).",
)
@click.option(
    "--listen",
    default="127.0.0.1:8790",
    show_default=True,
    callback=_listen,
    help="HOST:PORT to serve on (port 0: any free one). Loopback only unless --insecure-listen.",
)
@click.option(
    "--insecure-listen",
    is_flag=True,
    help="Allow a non-loopback --listen: anyone who reaches it reads every prompt and reply in the store.",
)
@click.option(
    "--tokenizer",
    type=click.Path(path_type=Path),
    envvar="POLAR_MITM_TOKENIZER",
    show_envvar=True,
    help="Tokenizer directory, to show text instead of token ids (pages say so when it is missing).",
)
@click.option("--open", "open_browser", is_flag=True, help="Open the sessions page in a browser.")
def view(
    db: Path,
    server: str | None,
    listen: tuple[str, int],
    insecure_listen: bool,
    tokenizer: Path | None,
    open_browser: bool,
) -> None:
    """A local web page over the store: sessions, trajectories as the trainer reads them (tokens
    coloured by loss mask, shaded by logprob), turns, rollout groups, plots, and with --server the
    live rollout service.

    \b
    Examples:
      polar-mitm view --db runs.sqlite --tokenizer ~/models/Qwen3-8B --open
      polar-mitm view --db rollouts.sqlite --server http://127.0.0.1:8700
    """
    from polar_mitm.auth import find_token
    from polar_mitm.view.server import ViewConfig, Viewer, allowed_hosts

    host, port = listen
    if not is_loopback(host) and not insecure_listen:
        raise click.UsageError(
            f"--listen {host}:{port} is not a loopback address: the viewer shows every prompt and reply "
            "in the store to whoever reaches it. Pass --insecure-listen to serve it there anyway."
        )
    config = ViewConfig(
        db=db,
        server=server,
        service_token=find_token() if server else None,
        tokenizer=tokenizer,
        allowed_hosts=allowed_hosts(host),
    )

    async def main() -> None:
        viewer = Viewer(config)
        try:
            url = await viewer.start(host, port)
        except OSError as e:
            raise click.ClickException(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
        _register(db, url)
        click.echo(
            f"polar-mitm view on {url}/sessions · db {db}" + (f" · service {server}" if server else ""),
            err=True,
        )
        if not db.is_file():
            click.echo(f"polar-mitm view: no database at {db} yet; pages say so until it exists", err=True)
        if open_browser:
            webbrowser.open(f"{url}/sessions")
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        try:
            await stop.wait()
        finally:
            _register(db, url, remove=True)
            await viewer.stop()

    asyncio.run(main())


COMMANDS = [view]
