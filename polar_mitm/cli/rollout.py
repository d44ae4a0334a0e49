"""`polar-mitm rollout`: tasks × samples through the pipeline, a table per task, groups as parquet."""

from __future__ import annotations

import asyncio
import shlex
import shutil
import sys
import tempfile
from pathlib import Path

import click

from polar_mitm.cli.options import Flag, given, make_policy_config, model_options, policy_options
from polar_mitm.rollout.options import LIMIT_FIELDS, WORKER_FIELDS, RolloutOptions, default_workers
from polar_mitm.sandbox import RUNTIMES
from polar_mitm.strategies import Normalize, Strategy, choices

EXIT_INTERRUPTED = 130
EXIT_NOTHING_USABLE = 3  # every sample failed or was cancelled: nothing to train on


def task_options(f):
    """The options `rollout` and `submit` share: which harness, where, how many, how long."""
    for opt in reversed(
        [
            click.argument("tasks", nargs=-1, required=True, type=click.Path(path_type=Path)),
            click.option(
                "--harness",
                required=True,
                help="Harness recipe, e.g. claude-code, codex, mini-swe-agent (`polar-mitm recipes` lists them).",
            ),
            click.option(
                "--harness-cmd",
                default=None,
                help="The harness command instead of the recipe's, with an {instruction} placeholder "
                "(split like a shell line): --harness-cmd 'claude -p {instruction} --allowedTools Bash'.",
            ),
            click.option("--runtime", type=click.Choice(RUNTIMES), default="docker", show_default=True),
            click.option(
                "--samples",
                "-n",
                type=click.IntRange(min=1),
                default=1,
                show_default=True,
                help="Samples per task (the group size).",
            ),
            click.option(
                "--early-stop",
                type=click.IntRange(min=1),
                default=None,
                help="Cancel a group's remaining samples once K usable ones are in.",
            ),
            click.option(
                "--agent-timeout",
                type=float,
                default=None,
                help="Seconds per harness run [default: each task's].",
            ),
            click.option(
                "--total-timeout",
                type=float,
                default=None,
                help="Seconds per sample, sandbox start to score [default: each task's].",
            ),
        ]
    ):
        f = opt(f)
    return f


# The pipeline's sizes (WORKER_FIELDS), for `rollout` and for every node: RolloutOptions' fields.
WORKER_FLAGS = {
    "retries": Flag("Retries per sample after a sandbox failure."),
    "init_workers": Flag("Sandboxes starting at once.", default=str(default_workers()[0])),
    "run_workers": Flag("Harnesses running at once.", default=f"by CPUs, {default_workers()[1]} here"),
    "postrun_workers": Flag("Samples scored at once.", default=str(default_workers()[2])),
    "ready_size": Flag("Warm sandboxes kept ready.", default="--run-workers"),
}
worker_options = model_options(RolloutOptions, WORKER_FLAGS, WORKER_FIELDS)
# How a verdict becomes the trainer's number: RolloutOptions' fields too.
VERDICT_FIELDS = ("reward_key", "mask_egress_refused")
VERDICT_FLAGS = {
    "reward_key": Flag(
        "The number a trainer gets from a multi-key reward.json: one of its keys, or mean, min or "
        "max of them all, where the task names none (every key is kept in reward_detail).",
        default="'reward', else the only key, else mean",
    ),
    "mask_egress_refused": Flag(
        "Fail (mask) a sample whose verifier had network requests refused, instead of training on "
        "the 0 its tests wrote; the refused hosts are in reward_detail.egress_refused either way."
    ),
}
verdict_options = model_options(RolloutOptions, VERDICT_FLAGS, VERDICT_FIELDS)
LIMIT_FLAGS = {
    "memory": Flag("MiB of memory per sample's sandbox when its task names none; 0: no limit."),
    "cpus": Flag("CPUs per sample's sandbox when its task names none; 0: no limit."),
    "pids": Flag("Processes a sample's sandbox may hold at once."),
    "tmp_size": Flag(
        "MiB of /tmp per sample's sandbox (a tmpfs in Docker, a file system image in Apptainer); 0: the "
        "image's /tmp."
    ),
    "allow_unenforced_limits": Flag(
        "Run even where the runtime cannot enforce the memory, CPU and pids limits (Apptainer without "
        "cgroups): say so and go on, instead of refusing to start (where something else bounds the "
        "whole job: a batch scheduler's cgroup, say)."
    ),
    "home_size": Flag(
        "MiB of the harness's HOME per sample (a tmpfs in Docker, a file system image in Apptainer); 0: "
        "a host directory, unbounded."
    ),
}
limit_options = model_options(RolloutOptions, LIMIT_FLAGS, LIMIT_FIELDS)


@click.command()
@task_options
@policy_options
@click.option(
    "--out", type=click.Path(path_type=Path), default=None, help="Write the groups here as parquet."
)
@click.option(
    "--strategy", type=click.Choice(choices(Strategy)), default=Strategy.PREFIX_MERGE.value, show_default=True
)
@click.option(
    "--group-normalize",
    type=click.Choice(choices(Normalize)),
    default=Normalize.STD.value,
    show_default=True,
    help="The advantage column: std = (r - mean) / std; loo = r - mean of the others.",
)
@worker_options
@verdict_options
@limit_options
@click.option(
    "--env",
    "extra_env",
    multiple=True,
    metavar="KEY=VALUE",
    help="Extra environment for every harness (repeatable).",
)
@click.option(
    "--egress-allow",
    "egress_allow",
    multiple=True,
    metavar="HOST[,HOST...]",
    help="Hosts (names, or *.suffix) every sandbox, agent and verifier, may reach even where they "
    "resolve to a private or reserved address: a package mirror on your network. Nothing else is "
    "widened; loopback stays refused. Repeatable.",
)
@click.option(
    "--keep-workdirs", is_flag=True, help="Keep each sample's host directory (logs, HOME) after it ends."
)
@click.option(
    "--harness-user",
    default="1000:1000",
    show_default=True,
    metavar="UID:GID|root",
    help="Who the harness runs as in a container (its workdir and HOME are handed to that user); "
    "'root' for tasks that need to install packages. Capabilities are dropped either way.",
)
def rollout(
    tasks,
    harness,
    harness_cmd,
    runtime,
    samples,
    db,
    certs,
    out,
    strategy,
    group_normalize,
    early_stop,
    agent_timeout,
    total_timeout,
    extra_env,
    egress_allow,
    keep_workdirs,
    harness_user,
    **policy,
) -> None:
    """Run each task SAMPLES times in a fresh sandbox with an unmodified harness, score every
    sample with the task's own tests, and write the groups for GRPO.

    \b
    polar-mitm rollout tasks/ --harness claude-code --runtime docker --samples 8 \\
        --backend http://127.0.0.1:30000 --tokenizer ./qwen3-tok --tool-parser qwen25 \\
        --db runs.sqlite --out groups.parquet

    TASKS are Harbor / Terminal-Bench task directories (or a folder of them), JSON lines of
    SWE-bench-shaped rows, or plain .toml / .yaml / .json task files. Every harness call goes
    through one proxy and is recorded token-exactly; each sample is one session in --db.
    In Docker a sample has no network but its own channel to the proxy, no capabilities, and
    runs as --harness-user; --env values are stored redacted (their names are kept).
    Live progress goes to stderr; at the end a table per task (samples, mean reward, pass@1,
    pass@k, groups without signal, failures by cause, seconds per stage) and, with --out, the
    parquet (one row per trajectory with group_id, sample_index, status, reward, advantage).
    Ctrl-C stops every sandbox and records the unfinished samples as cancelled.
    """
    from polar_mitm import recipes
    from polar_mitm.harness.install import HarnessNotInstalled
    from polar_mitm.harness.preflight import EXIT_CONFIG, PreflightError, check_policy
    from polar_mitm.proxy.embedded import PolarProxy, ProxyConfig
    from polar_mitm.reconstruct.report import render_table, rollout_reports
    from polar_mitm.rollout.pipeline import Pipeline, new_token
    from polar_mitm.rollout.progress import Progress
    from polar_mitm.sandbox import make_runtime
    from polar_mitm.sandbox.base import RuntimeUnavailable, SandboxError
    from polar_mitm.tasks import TaskFileError, load_tasks

    try:
        loaded = load_tasks(tasks)
    except TaskFileError as e:
        raise click.ClickException(str(e)) from None
    if not loaded:
        raise click.ClickException(f"no tasks in {', '.join(map(str, tasks))}")
    try:
        recipes.get(harness)
    except KeyError as e:
        raise click.BadParameter(str(e.args[0]), param_hint="--harness") from None
    env: dict[str, str] = {}
    for item in extra_env:
        k, sep, v = item.partition("=")
        if not sep or not k:
            raise click.BadParameter(f"{item!r} is not KEY=VALUE", param_hint="--env")
        env[k] = v
    opts = RolloutOptions(
        harness=harness,
        harness_cmd=shlex.split(harness_cmd) if harness_cmd else None,
        runtime=runtime,
        samples=samples,
        early_stop=early_stop,
        agent_timeout=agent_timeout,
        total_timeout=total_timeout,
        env=env,
        keep_workdirs=keep_workdirs,
        harness_user=None if harness_user in ("root", "0", "0:0") else harness_user,
        **given(policy, WORKER_FIELDS),  # the pipeline's sizes, out of the policy's options
        **given(policy, VERDICT_FIELDS),
        **given(policy, LIMIT_FIELDS),
    )
    rt = make_runtime(runtime)
    if runtime == "apptainer":  # an image's one-time conversion, and how long it took, shows in the progress
        import logging

        logging.getLogger("polar_mitm.apptainer").setLevel(logging.INFO)
    work_dir = Path(tempfile.mkdtemp(prefix="polar-rollout-"))
    proxy = PolarProxy(
        ProxyConfig(
            db=db,
            certs_dir=certs,
            default_session="rollout-unattributed",
            token=new_token(),
            recipe=harness,
            egress_allow=[h for item in egress_allow for h in item.split(",") if h.strip()],
            policy=make_policy_config(**policy),
            own_process=True,  # this process is the rollout: see long_lived_heap
        )
    )

    async def go():
        # Before anything starts: a clear error when the runtime, the backend or the tokenizer
        # cannot work (one line, not a minute of harness retries).
        await rt.check()
        proxy.config.model_info = await check_policy(proxy.config.policy)  # kept: not asked again
        await proxy.start()
        try:
            with Progress() as progress:
                pipeline = Pipeline(opts, proxy, rt, work_dir=work_dir, on_change=progress.update)
                click.echo(
                    f"rollout {pipeline.rollout_id}: {len(loaded)} tasks × {samples} samples · {harness} · "
                    f"{runtime} · proxy {proxy.url} · db {db}",
                    err=True,
                )
                return await pipeline.run(loaded)
        finally:
            await proxy.stop()

    try:
        result = asyncio.run(go())
    except PreflightError as e:
        click.echo(f"polar-mitm: {e}", err=True)
        sys.exit(EXIT_CONFIG)
    except KeyboardInterrupt:
        click.echo(
            "polar-mitm: rollout interrupted; sandboxes stopped, unfinished samples recorded as cancelled",
            err=True,
        )
        sys.exit(EXIT_INTERRUPTED)
    except (RuntimeUnavailable, HarnessNotInstalled, SandboxError, ValueError) as e:
        raise click.ClickException(str(e)) from None
    finally:
        if not keep_workdirs:
            shutil.rmtree(work_dir, ignore_errors=True)
    click.echo(
        render_table(
            rollout_reports(db, result.rollout_id),
            title=f"rollout {result.rollout_id} ({result.seconds:.1f} s)",
        ),
        err=True,
    )
    if out is not None:
        from polar_mitm.reconstruct.export import export
        from polar_mitm.reconstruct.source import Selection

        stats = export(
            db,
            out,
            strategy=strategy,
            fmt="parquet",
            selection=Selection(rollout=result.rollout_id),
            normalize=group_normalize,
            quiet=True,
        )
        click.echo(f"wrote {stats.trajectories} rows ({len(stats.sessions)} samples) to {out}", err=True)
    why = result.unusable()
    if why is not None and not result.interrupted:
        click.echo(f"polar-mitm: rollout {result.rollout_id}: {why}", err=True)
        sys.exit(EXIT_NOTHING_USABLE)
