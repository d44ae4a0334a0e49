"""`polar-mitm serve`, `node` and `submit`: the rollout service from the command line."""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path
from typing import TYPE_CHECKING

import click

from polar_mitm.cli.options import (
    Flag,
    given,
    make_policy_config,
    model_options,
    policy_options,
    split_listen,
)
from polar_mitm.cli.rollout import (
    egress_allow_option,
    limit_options,
    task_options,
    verdict_options,
    worker_options,
)
from polar_mitm.netaddr import is_loopback
from polar_mitm.rollout.options import LIMIT_FIELDS, VERDICT_FIELDS, WORKER_FIELDS
from polar_mitm.service.config import ServerConfig
from polar_mitm.strategies import Strategy, choices

if TYPE_CHECKING:
    from polar_mitm.client import RolloutClient

SERVER_HELP = "The rollout server [env POLAR_MITM_SERVER; default http://127.0.0.1:8700]"
TOKEN_HELP = (
    "The control token [env POLAR_MITM_SERVICE_TOKEN; default: read from --token-file]. "
    "A token on the command line is visible to other users in `ps`: prefer the env or a file."
)
TOKEN_FILE_HELP = (
    "Read the control token from this file [env POLAR_MITM_SERVICE_TOKEN_FILE; default "
    "~/.config/polar-mitm/service-token, which `serve` writes]."
)


def token_options(f):
    """--token and --token-file: how `submit` and `node` find the operator's token."""
    f = click.option(
        "--token-file",
        envvar="POLAR_MITM_SERVICE_TOKEN_FILE",
        type=click.Path(dir_okay=False, path_type=Path),
        default=None,
        help=TOKEN_FILE_HELP,
    )(f)
    return click.option("--token", envvar="POLAR_MITM_SERVICE_TOKEN", default=None, help=TOKEN_HELP)(f)


def client_token(token: str | None, token_file: Path | None) -> str:
    """The operator's token for `submit` and `node`, or a one-line error saying where to put it."""
    from polar_mitm import auth

    try:
        found = auth.find_token(token, token_file)
    except auth.TokenFileError as e:
        raise click.ClickException(str(e)) from None
    if found is None:
        raise click.ClickException(
            f"no control token: {auth.token_file(token_file)} does not exist (`serve` writes it there); "
            "set POLAR_MITM_SERVICE_TOKEN or pass --token-file"
        )
    return found


def node_options(f):
    """A node's sizes: the pipeline's and its sandboxes' limits, its verdict options and the hosts
    its sandboxes may reach (`rollout`'s options), and how many samples it holds."""
    f = egress_allow_option(f)
    f = verdict_options(f)
    f = limit_options(f)
    f = click.option(
        "--capacity",
        type=click.IntRange(min=1),
        default=None,
        help="Samples in flight per node [init + run workers].",
    )(f)
    return worker_options(f)


# The server's options: ServerConfig's fields (the rest, retries and dispatches, keep their defaults).
SERVER_FIELDS = ("allow_local_runtime", "task_root", "callback_allow", "polar_api", "max_body_mb",
                 "max_result_mb", "node_timeout", "deadline_grace")  # fmt: skip
SERVER_FLAGS = {
    "allow_local_runtime": Flag(
        "Accept tasks with runtime 'local': their harness (and harness_cmd) runs on the nodes' "
        "hosts as the node's user, unsandboxed.",
        switch=True,
    ),
    "task_root": Flag(
        "Accept task_path requests for paths under DIR (resolved); inline tasks' Dockerfiles and "
        "tests must lie under it too. Without it the server reads no path a client names.",
        type=click.Path(exists=True, file_okay=False, path_type=Path),
        metavar="DIR",
        default="none",
    ),
    "callback_allow": Flag(
        "Accept callback_url on this host (repeatable, or comma-separated); none without it.",
        multiple=True,
        metavar="HOST",
        default="none",
    ),
    "polar_api": Flag(
        "Serve Polar's rollout API too (POST /rollout/task/submit, GET /nodes, /admin/inference/*, …) "
        "for trainers built on Polar, under a secret path derived from the control token: it prints "
        "the base URL (http://HOST:PORT/SECRET) to give them. See docs/polar.md.",
        switch=True,
    ),
    "max_body_mb": Flag(
        "Largest request body; larger ones are refused (413) before they are read.",
        type=click.FloatRange(min=0.01),
    ),
    "max_result_mb": Flag(
        "Largest sample report from a registered node (its trajectories' rows).",
        type=click.FloatRange(min=0.01),
    ),
    "node_timeout": Flag("Seconds without a heartbeat before a node is lost."),
    "deadline_grace": Flag(
        "Seconds past a sample's timeout before the server gives it up on its node (queued again,"
        " or failed at the dispatch limit)."
    ),
}
server_options = model_options(ServerConfig, SERVER_FLAGS, SERVER_FIELDS)


def server_token(token: str | None, token_file: Path | None) -> tuple[str, str]:
    """`serve`'s control token (given, else its token file's, written when missing), and a note
    saying which."""
    from polar_mitm import auth

    if token:
        return token, "control token given"
    path = auth.token_file(token_file)
    try:
        found, created = auth.ensure_token_file(path)
    except auth.TokenFileError as e:
        raise click.ClickException(str(e)) from None
    return found, f"control token {'written to' if created else 'read from'} {path}"


@click.command()
@click.option("--listen", default="127.0.0.1:8700", show_default=True, help="HOST:PORT of the HTTP API.")
@click.option(
    "--insecure-listen",
    is_flag=True,
    help="Allow a --listen address other machines reach: the API has no TLS, so its token crosses "
    "the network in clear (prefer loopback and a tunnel).",
)
@click.option(
    "--token",
    envvar="POLAR_MITM_SERVICE_TOKEN",
    default=None,
    help="Require this control token [env POLAR_MITM_SERVICE_TOKEN]. On the command line it is "
    "visible to other users in `ps`: prefer the env or --token-file.",
)
@click.option(
    "--token-file",
    envvar="POLAR_MITM_SERVICE_TOKEN_FILE",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="The control token's file, created 0600 with a new token when missing (when no --token is "
    "given) [env POLAR_MITM_SERVICE_TOKEN_FILE; default ~/.config/polar-mitm/service-token, where "
    "submit, node and the client read it].",
)
@server_options
@click.option(
    "--nodes",
    type=click.IntRange(min=0),
    default=1,
    show_default=True,
    help="Gateway nodes to start (local, or Ray actors with --ray).",
)
@click.option(
    "--ray",
    "ray_address",
    default=None,
    metavar="ADDRESS|auto|local",
    help="Place the nodes as Ray actors on this cluster (auto: the one running here; local: a Ray of"
    " this server's own, on 127.0.0.1 only).",
)
@node_options
@policy_options
def serve(
    listen, insecure_listen, token, token_file, nodes, ray_address, capacity, db, certs, **options
) -> None:
    """The rollout server and its gateway nodes.

    \b
    polar-mitm serve --backend http://127.0.0.1:30000 --db rollouts.sqlite
    polar-mitm serve --ray auto --nodes 4 --backend http://10.0.0.5:30000

    Trainers submit TaskRequests to the HTTP API (POST /v1/tasks; the schema is at
    /openapi.json) or with `polar-mitm submit` / polar_mitm.client, and get scored groups back.
    The nodes run the samples (sandbox, harness through their proxy, evaluator) with the policy
    options given here; more nodes join from anywhere with `polar-mitm node --server URL`.
    State is in --db: a restarted server loses no task and no finished sample.

    Only the holder of the control token drives it. Without --token (or its env) the token is
    read from --token-file, or generated there (0600) on first use; `submit`, `node` and
    polar_mitm.client read the same file. Nodes get a narrower credential derived from it.
    """
    from polar_mitm.service.node_config import NodeConfig
    from polar_mitm.service.ray_nodes import RayUnavailable
    from polar_mitm.service.run import CannotListen, serve_rollouts

    host, port = split_listen(listen, "127.0.0.1:8700")
    if not is_loopback(host) and not insecure_listen:
        raise click.ClickException(
            f"--listen {listen} is reachable from other machines and the API has no TLS (its token would "
            "cross the network in clear): listen on 127.0.0.1 and tunnel, or pass --insecure-listen"
        )
    token, token_note = server_token(token, token_file)
    config = ServerConfig(db=db, token=token, **given(options, SERVER_FIELDS))
    workers = given(options, WORKER_FIELDS)  # the pipeline's sizes, out of the policy's options
    limits = given(options, LIMIT_FIELDS)  # the sandboxes' limits given, RolloutOptions' for the rest
    verdict, egress_allow = given(options, VERDICT_FIELDS), options.pop("egress_allow")
    node = NodeConfig(server="", db=str(db), certs_dir=certs, policy=make_policy_config(**options),
                      capacity=capacity, limits=limits, verdict=verdict, egress_allow=egress_allow,
                      **workers)  # fmt: skip

    async def main() -> None:
        try:
            async with serve_rollouts(
                config, host=host, port=port, nodes=nodes, ray_address=ray_address, node=node
            ) as service:
                where = f"{nodes} {'Ray ' if ray_address else ''}nodes"
                click.echo(
                    f"polar-mitm rollout server on {service.url} · db {db} · {where} · {token_note}", err=True
                )
                if service.server.polar is not None:
                    # The capability itself: whoever reads it drives the Polar API (docs/threat-model.md).
                    click.echo(f"polar API on {service.server.polar_url}", err=True)
                await asyncio.Event().wait()
        except (CannotListen, RayUnavailable) as e:
            raise click.ClickException(str(e)) from None

    _run_until_signal(main())


@click.command()
@click.option("--server", envvar="POLAR_MITM_SERVER", default="http://127.0.0.1:8700", help=SERVER_HELP)
@token_options
@click.option(
    "--node-token-file",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    help="Join with the node credential in this file instead of the control token [env "
    "POLAR_MITM_NODE_TOKEN: the credential itself]; `node --print-credential` prints it.",
)
@click.option(
    "--print-credential",
    is_flag=True,
    help="Print the node credential of the control token (it can only register nodes) and exit.",
)
@click.option("--node-id", default=None, help="This node's id [default: host name + random suffix].")
@click.option(
    "--config",
    "config_file",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    help="A node configuration (JSON, as `serve` writes for its local nodes); other options are ignored.",
)
@node_options
@policy_options
def node(
    server,
    token,
    token_file,
    node_token_file,
    print_credential,
    node_id,
    config_file,
    capacity,
    db,
    certs,
    **policy,
) -> None:
    """A gateway node for a rollout server, on this machine.

    \b
    polar-mitm node --server http://10.0.0.2:8700 --backend http://10.0.0.5:30000

    It registers, takes samples when it has room, runs them (sandbox, harness through its own
    proxy, evaluator), and reports each sample's rows; its turns are in --db on this machine.
    It sends only the node credential (derived from the control token, or given alone), which
    registers and nothing else, then the key the server issued to this node.
    """
    import os

    from polar_mitm import auth
    from polar_mitm.service.node import GatewayNode, NodeConfig

    if config_file is not None:
        gw = GatewayNode(
            NodeConfig.model_validate_json(config_file.read_text()).model_copy(update={"own_process": True})
        )
        config_file.unlink(missing_ok=True)  # written for this process alone
        _run_until_signal(gw.run())
        return
    credential = os.environ.get(auth.NODE_TOKEN_ENV)
    if node_token_file is not None:
        credential = auth.read_token_file(node_token_file)
    if credential is None or print_credential:
        credential = auth.node_token(client_token(token, token_file))
    if print_credential:
        click.echo(credential)
        return
    workers = given(policy, WORKER_FIELDS)  # the pipeline's sizes, out of the policy's options
    limits = given(policy, LIMIT_FIELDS)  # the sandboxes' limits given, RolloutOptions' for the rest
    verdict, egress_allow = given(policy, VERDICT_FIELDS), policy.pop("egress_allow")
    fields = dict(
        server=server, node_token=credential, db=str(db), certs_dir=certs, policy=make_policy_config(**policy),
        capacity=capacity, own_process=True, limits=limits, verdict=verdict, egress_allow=egress_allow,
        **workers,
    )  # fmt: skip
    if node_id:
        fields["node_id"] = node_id
    gw = GatewayNode(NodeConfig(**fields))

    async def main() -> None:
        try:
            await gw.start()
        except OSError as e:
            raise click.ClickException(f"cannot reach the server {server}: {e}") from None
        click.echo(
            f"polar-mitm node {gw.node_id} · server {server} · proxy {gw.proxy.url} · db {db}", err=True
        )
        # Started and registered already: serve (gw.run() would start it, and register, again).
        try:
            await gw.serve()
        finally:
            await asyncio.shield(gw.stop())

    _run_until_signal(main())


def _run_until_signal(coro) -> None:
    """Run until Ctrl-C or SIGTERM; both stop cleanly."""

    async def wrapped() -> None:
        task = asyncio.current_task()
        loop = asyncio.get_running_loop()
        assert task is not None
        loop.add_signal_handler(signal.SIGTERM, task.cancel)
        try:
            await coro
        except asyncio.CancelledError:
            pass

    try:
        asyncio.run(wrapped())
    except KeyboardInterrupt:
        pass


@click.command()
@task_options
@click.option("--server", envvar="POLAR_MITM_SERVER", default="http://127.0.0.1:8700", help=SERVER_HELP)
@token_options
@click.option("--priority", type=int, default=0, show_default=True)
@click.option(
    "--builder", type=click.Choice(choices(Strategy)), default=Strategy.PREFIX_MERGE.value, show_default=True
)
@click.option("--callback-url", default=None, help="POST each finished group here (retried with backoff).")
@click.option(
    "--id-prefix", default="", help="Prefix each task id (ids are unique per server: e.g. 'epoch3-')."
)
@click.option("--wait", is_flag=True, help="Block until every group is in, with progress.")
@click.option(
    "--out", type=click.Path(path_type=Path), default=None, help="With --wait: write the groups as parquet."
)
def submit(
    tasks,
    harness,
    harness_cmd,
    runtime,
    samples,
    server,
    token,
    token_file,
    priority,
    early_stop,
    agent_timeout,
    total_timeout,
    builder,
    callback_url,
    id_prefix,
    wait,
    out,
) -> None:
    """Submit tasks to a rollout server.

    \b
    polar-mitm submit tasks/ --harness codex --runtime docker --samples 8 \\
        --server http://127.0.0.1:8700 --wait --out groups.parquet

    TASKS are read here (Harbor directories, SWE-bench JSON lines, task files) and sent inline;
    paths inside them (tests/, Dockerfiles) must be readable by the nodes too (one machine, or a
    shared file system). Prints each task id; with --wait, progress and a table per task.
    """
    import shlex

    import httpx

    from polar_mitm.client import RolloutClient, RolloutError
    from polar_mitm.tasks import TaskFileError, load_tasks

    if out is not None and not wait:
        raise click.UsageError("--out needs --wait")
    try:
        loaded = load_tasks(tasks)
    except TaskFileError as e:
        raise click.ClickException(str(e)) from None
    opts = dict(
        runtime=runtime, priority=priority, early_stop_min_usable=early_stop, agent_timeout_seconds=agent_timeout,
        timeout_seconds=total_timeout, builder=builder, callback_url=callback_url,
        harness_cmd=shlex.split(harness_cmd) if harness_cmd else None,
    )  # fmt: skip
    client = RolloutClient(server, token=client_token(token, token_file))
    ids = []
    try:
        for t in loaded:
            given = {k: v for k, v in opts.items() if v is not None}
            ids.append(client.submit(t, samples=samples, harness=harness, task_id=id_prefix + t.id, **given))
            click.echo(ids[-1])
        if wait:
            _collect(client, ids, out)
    except RolloutError as e:
        raise click.ClickException(f"{server}: {e}") from None
    except (httpx.HTTPError, OSError) as e:
        raise click.ClickException(f"cannot reach {server}: {e}") from None
    finally:
        client.close()


def _collect(client: RolloutClient, ids: list[str], out: Path | None) -> None:
    """`submit --wait`: a line per group as it comes in, then the groups' rows to `out`."""
    from polar_mitm.outcomes import trainable

    groups = []
    t0 = time.monotonic()
    for g in client.wait(ids):
        groups.append(g)
        usable = [o.reward or 0.0 for o in g.outcomes if trainable(o.status)]
        mean = f"{sum(usable) / len(usable):.2f}" if usable else "-"
        failed = len(g.outcomes) - len(usable)
        click.echo(
            f"[{len(groups)}/{len(ids)}] {g.task_id}: {g.state} · {len(usable)}/{len(g.outcomes)} usable"
            f" · mean reward {mean} · {failed} failed or cancelled · {len(g.samples)} rows"
            f" · {time.monotonic() - t0:.0f} s",
            err=True,
        )
    if out is not None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        tables = [pq.read_table(pa.BufferReader(client.parquet(i))) for i in ids]
        pq.write_table(pa.concat_tables(tables), str(out), compression="zstd")
        click.echo(f"wrote {sum(t.num_rows for t in tables)} rows of {len(ids)} groups to {out}", err=True)


COMMANDS = [serve, node, submit]
