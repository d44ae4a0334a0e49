"""`polar-mitm rollout`: tasks × samples through the pipeline, a table per task, groups as parquet."""

from __future__ import annotations

import asyncio
import shlex
import sys
from pathlib import Path

import click

from polar_mitm.cli.options import Flag, given, make_policy_config, model_options, policy_options
from polar_mitm.rollout.options import (
    LIMIT_FIELDS,
    VERDICT_FIELDS,
    WORKER_FIELDS,
    RolloutOptions,
    default_workers,
)
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
        "Run even where the runtime cannot enforce the sandboxes' limits (Apptainer without cgroups "
        "or mke2fs, a Docker daemon without a cgroup): say so and go on, instead of refusing to "
        "start (where something else bounds the whole job: a batch scheduler's cgroup, say).",
        switch=True,
    ),
    "home_size": Flag(
        "MiB of the harness's HOME per sample (a tmpfs in Docker, a file system image in Apptainer); 0: "
        "a host directory, unbounded."
    ),
}
limit_options = model_options(RolloutOptions, LIMIT_FLAGS, LIMIT_FIELDS)
egress_allow_option = click.option(
    "--egress-allow",
    "egress_allow",
    multiple=True,
    metavar="HOST[,HOST...]",
    help="Hosts (names, or *.suffix) every sandbox, agent and verifier, may reach even where they "
    "resolve to a private or reserved address: a package mirror on your network. Nothing else is "
    "widened; loopback stays refused. Repeatable.",
)


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
@egress_allow_option
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
    tasks, harness, harness_cmd, runtime, samples, db, certs, out, strategy, group_normalize, **policy
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
    from polar_mitm.harness.install import HarnessNotInstalled
    from polar_mitm.harness.preflight import EXIT_CONFIG, PreflightError
    from polar_mitm.reconstruct.report import render_table, rollout_reports
    from polar_mitm.rollout.progress import Progress
    from polar_mitm.rollout.run import run_rollout
    from polar_mitm.sandbox.base import RuntimeUnavailable, SandboxError

    loaded = _load(tasks, harness)
    opts = _options(harness_cmd, runtime, samples, policy)
    egress_allow = policy.pop("egress_allow")

    def started(pipeline, url: str) -> None:
        click.echo(
            f"rollout {pipeline.rollout_id}: {len(loaded)} tasks × {samples} samples · {harness} · "
            f"{runtime} · proxy {url} · db {db}",
            err=True,
        )

    try:
        with Progress() as progress:
            result = asyncio.run(
                run_rollout(
                    loaded,
                    harness=harness,
                    policy=make_policy_config(**policy),
                    options=opts,
                    db=db,
                    certs_dir=certs,
                    egress_allow=egress_allow,
                    on_start=started,
                    on_change=progress.update,
                    own_process=True,  # this process is the rollout: see long_lived_heap
                )
            )
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
    title = f"rollout {result.rollout_id} ({result.seconds:.1f} s)"
    click.echo(render_table(rollout_reports(db, result.rollout_id), title=title), err=True)
    if out is not None:
        stats = result.export(out, strategy=strategy, normalize=group_normalize)
        click.echo(f"wrote {stats.trajectories} rows ({len(stats.sessions)} samples) to {out}", err=True)
    why = result.unusable()
    if why is not None and not result.interrupted:
        click.echo(f"polar-mitm: rollout {result.rollout_id}: {why}", err=True)
        sys.exit(EXIT_NOTHING_USABLE)


def _load(tasks, harness: str) -> list:
    """The tasks named, and the harness known: a click error naming the option otherwise."""
    from polar_mitm import recipes
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
    return loaded


def _options(harness_cmd: str | None, runtime: str, samples: int, policy: dict) -> RolloutOptions:
    """The rollout's options out of the command line's (taken out of `policy`, which keeps the
    policy's own)."""
    env: dict[str, str] = {}
    for item in policy.pop("extra_env"):
        k, sep, v = item.partition("=")
        if not sep or not k:
            raise click.BadParameter(f"{item!r} is not KEY=VALUE", param_hint="--env")
        env[k] = v
    user = policy.pop("harness_user")
    return RolloutOptions(
        harness_cmd=shlex.split(harness_cmd) if harness_cmd else None,
        runtime=runtime,
        samples=samples,
        early_stop=policy.pop("early_stop"),
        agent_timeout=policy.pop("agent_timeout"),
        total_timeout=policy.pop("total_timeout"),
        env=env,
        keep_workdirs=policy.pop("keep_workdirs"),
        harness_user=None if user in ("root", "0", "0:0") else user,
        **given(policy, WORKER_FIELDS),  # the pipeline's sizes, out of the policy's options
        **given(policy, VERDICT_FIELDS),
        **given(policy, LIMIT_FIELDS),
    )
