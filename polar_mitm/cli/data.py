"""The offline commands: export, stats, show, reward, check-logprobs. `app.py` lists each
of `COMMANDS` in its `LAZY`.

Thin click wrappers; the work happens in `export`, `show` and `source`.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import sqlite3
import sys
from collections.abc import Callable
from itertools import islice
from pathlib import Path
from typing import Any
from urllib.parse import quote

import click

from polar_mitm.reconstruct.breaks import TokenText
from polar_mitm.reconstruct.export import (
    FORMATS,
    REWARD_TO,
    SinkOptions,
    compute_stats,
    iter_trajectories,
)
from polar_mitm.reconstruct.export import export as export_rows
from polar_mitm.reconstruct.report import render_table, rollout_reports
from polar_mitm.reconstruct.show import find_rows, render_header, render_list, render_sequence
from polar_mitm.reconstruct.source import Selection, check_session, parse_since, set_reward
from polar_mitm.reconstruct.trajectory import TOOL_PARSE_POLICIES
from polar_mitm.strategies import Normalize, Strategy, choices

F = Callable[..., Any]


def _require_db(db: Path, selection: Selection | None = None) -> Path:
    """The store, which must exist, and must hold the session the selection names."""
    if not db.is_file():
        raise click.ClickException(f"no database at {db} (pass --db PATH or set POLAR_MITM_DB)")
    if selection is not None and selection.session is not None:
        try:
            check_session(db, selection.session)
        except KeyError as e:
            raise click.ClickException(str(e.args[0])) from None
    return db


def _db_option(f: F) -> F:
    return click.option(
        "--db",
        type=click.Path(dir_okay=False, path_type=Path),
        envvar="POLAR_MITM_DB",
        default=Path("polar-mitm.sqlite"),
        show_default=True,
        show_envvar=True,
        help="The SQLite store the proxy recorded into (the default is also `run`'s and `proxy`'s).",
    )(f)


def _tokenizer_option(help: str) -> Callable[[F], F]:
    return click.option(
        "--tokenizer",
        type=click.Path(exists=True, path_type=Path),
        envvar="POLAR_MITM_TOKENIZER",
        show_envvar=True,
        help=help,
    )


def _parse_since(ctx: click.Context, param: click.Parameter, value: str | None) -> float | None:
    if value is None:
        return None
    try:
        return parse_since(value)
    except ValueError as e:
        raise click.BadParameter(str(e)) from None


def _selection_options(f: F) -> F:
    options = [
        click.option("--session", help="Only this session."),
        click.option("--task", help="Only sessions of this task id."),
        click.option(
            "--since",
            callback=_parse_since,
            metavar="WHEN",
            help="Only turns created at or after WHEN: unix seconds or ISO date/time (local unless it has an offset).",
        ),
        click.option(
            "--include-side-calls/--no-include-side-calls",
            default=False,
            help="Keep turns tagged as side calls (title generation, routers, …). Default: leave them out.",
        ),
        click.option(
            "--include-aborted",
            is_flag=True,
            help="Keep turns whose status is not 'ok' (aborted, error).",
        ),
        click.option("--rollout", help="Only the samples of this rollout (see `polar-mitm rollout`)."),
    ]
    for option in reversed(options):
        f = option(f)

    @functools.wraps(f)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        kwargs["selection"] = Selection(
            session=kwargs.pop("session"),
            task=kwargs.pop("task"),
            since=kwargs.pop("since"),
            include_side_calls=kwargs.pop("include_side_calls"),
            include_aborted=kwargs.pop("include_aborted"),
            rollout=kwargs.pop("rollout"),
        )
        return f(*args, **kwargs)

    return wrapper


def _load_text(tokenizer: Path | None) -> TokenText | None:
    if tokenizer is None:
        return None
    try:
        return TokenText.load(tokenizer)
    except (ValueError, OSError) as e:
        raise click.ClickException(f"cannot load tokenizer {tokenizer}: {e}") from None


def _guarded(f: F) -> F:
    """Turn store errors into messages a user can act on, and a reader that went away (`| head`)
    into a quiet exit, as `cat` makes one."""

    @functools.wraps(f)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return f(*args, **kwargs)
        except BrokenPipeError:
            # Nothing more can be written, and Python's flush at exit must not try again either.
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            sys.exit(128 + signal.SIGPIPE)
        except sqlite3.DatabaseError as e:
            raise click.ClickException(f"cannot read the store {kwargs.get('db')}: {e}") from None
        except OSError as e:
            raise click.ClickException(str(e)) from None

    return wrapper


@click.command()
@_db_option
@click.option(
    "--strategy",
    type=click.Choice(choices(Strategy)),
    default=Strategy.PREFIX_MERGE.value,
    show_default=True,
    help="prefix-merge: one row per trajectory; per-request: one row per generation.",
)
@click.option(
    "--format",
    "fmt",
    type=click.Choice(list(FORMATS)),
    help="Output format. Default: jsonl if --out ends in .jsonl, else parquet.",
)
@click.option("--out", required=True, help="Output file ('-' for standard output with --format jsonl).")
@_selection_options
@_tokenizer_option(
    "Tokenizer directory, to classify breaks (retokenization vs other) in the metadata, and to render "
    "harvested (text-only) sessions with its chat template into rows (metadata retokenized: true)."
)
@click.option(
    "--group-normalize",
    type=click.Choice(choices(Normalize)),
    default=None,
    help="Add a GRPO advantage per rollout sample: std = (reward - group mean) / group std; "
    "loo = reward - mean of the group's other samples.",
)
@click.option(
    "--reward-to",
    type=click.Choice(REWARD_TO),
    default="all",
    show_default=True,
    help="Which rows of a session get its reward: all of them, or the main agent's only (subagent, "
    "compaction and side rows then have none). Each row's role and parent_id say which is which.",
)
@click.option(
    "--tool-parse-failures",
    type=click.Choice(TOOL_PARSE_POLICIES),
    default="keep",
    show_default=True,
    help="What a trainer gets of a turn whose tool calls the proxy's tool parser could not read "
    "(invalid JSON, an unclosed block, no name, an unknown tool, arguments against the tool's "
    "schema): keep it as it is (the tool_parse column and metadata name the failure), mask its "
    "sampled tokens (loss_mask 0), or zero the reward of its whole session.",
)
@click.option("--quiet", "-q", is_flag=True, help="No progress bar and no summary.")
@_guarded
def export(
    db: Path,
    strategy: str,
    fmt: str | None,
    out: str,
    selection: Selection,
    tokenizer: Path | None,
    group_normalize: str | None,
    reward_to: str,
    tool_parse_failures: str,
    quiet: bool,
) -> None:
    """Export recorded turns as training rows (parquet or JSON lines).

    Every row has the columns trajectory_id, session_id, task_id, prompt_ids, response_ids,
    loss_mask, response_logprobs, num_turns, turn_ids, finish_reason, reward, metadata, for
    rollout samples group_id, sample_index, status, reward_detail and advantage (null elsewhere),
    and role (main, subagent, compaction, side) with parent_id (the row it came from), and
    tool_parse (null, ok, or the first tool-call parse failure of the turns the row trains).
    Side calls and turns that did not finish 'ok' are left out unless asked for. Rows of samples
    that failed (sandbox, evaluator) or were cancelled are kept with loss_mask 0 and reward 0.

    \b
    Examples:
      polar-mitm export --db runs.sqlite --strategy prefix-merge --format parquet --out traj.parquet
      polar-mitm export --db runs.sqlite --strategy per-request --out turns.parquet
      polar-mitm export --db runs.sqlite --format jsonl --out traj.jsonl --task swe-123
      polar-mitm export --db sft.sqlite --format sft-jsonl --out sft.jsonl
      polar-mitm export --db sft.sqlite --format parquet --tokenizer ./qwen3-tok --out sft.parquet
      polar-mitm export --db runs.sqlite --rollout ro_1a2b --group-normalize std --out groups.parquet
    """
    db = _require_db(db, selection)
    if fmt is None:
        fmt = "jsonl" if out == "-" or out.endswith((".jsonl", ".json")) else "parquet"
    if out == "-" and fmt == "parquet":
        raise click.UsageError("parquet cannot go to standard output; pass --out FILE")
    stats = export_rows(
        db,
        out,
        strategy=strategy,
        fmt=fmt,
        selection=selection,
        text=_load_text(tokenizer),
        options=SinkOptions(tokenizer=str(tokenizer) if tokenizer else None),
        quiet=quiet,
        normalize=group_normalize,  # type: ignore[arg-type]
        reward_to=reward_to,  # type: ignore[arg-type]
        tool_parse_failures=tool_parse_failures,
    )
    if not quiet:
        ratio = stats.merge_ratio
        click.echo(
            f"wrote {stats.trajectories} {strategy} rows from {stats.turns} turns of {len(stats.sessions)} "
            f"sessions ({stats.merged_tokens:,} tokens, {stats.trained_tokens:,} trained"
            + (f", {ratio:.2f} turns per row" if ratio else "")
            + f") to {out}",
            err=True,
        )


@click.command()
@_db_option
@_selection_options
@_tokenizer_option("Tokenizer directory, to tell retokenization breaks from other breaks.")
@click.option("--json", "as_json", is_flag=True, help="Print the numbers as one JSON object.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar.")
@_guarded
def stats(db: Path, selection: Selection, tokenizer: Path | None, as_json: bool, quiet: bool) -> None:
    """Summarize a store as prefix-merge sees it.

    Reports turns, trajectories, the merge ratio (turns ÷ trajectories), the trainer-token ratio
    (tokens of per-request rows ÷ tokens of merged rows), retries dropped, branches, breaks by
    class (template, retokenization, other; unknown without --tokenizer) and mismatches
    (prompts that rewrote sampled tokens, unconfirmed store hints, logprob count errors).
    For rollouts, a table per task: samples, usable samples, mean reward, pass@1, pass@k, groups
    whose rewards are all equal (no GRPO signal), failures by cause and seconds per stage.

    \b
    Examples:
      polar-mitm stats --db runs.sqlite
      polar-mitm stats --db runs.sqlite --since 2025-06-01 --json
    """
    db = _require_db(db, selection)
    result = compute_stats(db, selection=selection, text=_load_text(tokenizer), quiet=quiet or as_json)
    tasks = rollout_reports(db, selection.rollout)
    if selection.task:
        tasks = [t for t in tasks if t.task_id == selection.task]
    if as_json:
        click.echo(json.dumps({**result.to_dict(), "tasks": [t.to_dict() for t in tasks]}, indent=2))
    else:
        click.echo(result.render())
        if tasks:
            click.echo()
            click.echo(render_table(tasks, title="rollout samples by task"))


@click.command()
@_db_option
@click.argument("trajectory_id", required=False)
@_tokenizer_option("Tokenizer directory, to show text instead of token ids.")
@click.option(
    "--strategy", type=click.Choice(choices(Strategy)), default=Strategy.PREFIX_MERGE.value, show_default=True
)
@click.option(
    "--include-side-calls/--no-include-side-calls",
    default=False,
    help="Keep side calls (title generation, …).",
)
@click.option("--include-aborted", is_flag=True, help="Keep turns whose status is not 'ok'.")
@click.option(
    "--color/--no-color", default=None, help="Colour trained tokens. Default: when stdout is a terminal."
)
@click.option("--limit", default=50, show_default=True, help="Rows to list when no TRAJECTORY_ID is given.")
@_guarded
def show(
    db: Path,
    trajectory_id: str | None,
    tokenizer: Path | None,
    strategy: str,
    include_side_calls: bool,
    include_aborted: bool,
    color: bool | None,
    limit: int,
) -> None:
    """Show a trajectory's sequence with the trained tokens highlighted.

    TRAJECTORY_ID may be a trajectory id (the id of its last turn), any turn id (the row holding
    it) or a session id (all its rows). Without it, list the rows. Trained tokens (loss_mask 1)
    are green on a terminal and between « and » otherwise; without --tokenizer token ids are shown.

    \b
    Examples:
      polar-mitm show --db runs.sqlite
      polar-mitm show --db runs.sqlite 3f2a9c-turn-7 --tokenizer ~/models/Qwen3-8B
    """
    db = _require_db(db)
    selection = Selection(include_side_calls=include_side_calls, include_aborted=include_aborted)
    if trajectory_id is None:
        rows = list(islice(iter_trajectories(db, strategy=strategy, selection=selection), limit))
        click.echo(render_list(rows) if rows else "no trajectories")
        return
    text = _load_text(tokenizer)
    try:
        rows = find_rows(db, trajectory_id, strategy=strategy, selection=selection, text=text)
    except KeyError as e:
        raise click.ClickException(str(e.args[0])) from None
    if not rows:
        raise click.ClickException(
            f"{trajectory_id!r} is in the store but in no row (a side call or aborted turn? "
            "try --include-side-calls / --include-aborted)"
        )
    use_color = sys.stdout.isatty() if color is None else color
    for i, row in enumerate(rows):
        if i:
            click.echo()
        click.echo(render_header(row))
        click.echo()
        click.echo(
            render_sequence(row, decode=text.decode if text else None, color=use_color), color=use_color
        )
    from polar_mitm.reconstruct.viewers import running_url

    if (url := running_url(db)) is not None:
        for row in rows:
            query = "" if strategy == Strategy.PREFIX_MERGE else f"?strategy={strategy}"
            click.echo(f"view: {url}/trajectory/{quote(row.trajectory_id, safe='')}{query}", err=True)


@click.command()
@_db_option
@click.option("--session", required=True, help="The session the reward is for.")
@click.option("--value", type=float, help="The outcome reward, e.g. 1.0.")
@click.option("--clear", is_flag=True, help="Remove the session's reward instead.")
@_guarded
def reward(db: Path, session: str, value: float | None, clear: bool) -> None:
    """Attach an outcome reward to a session; every trajectory of it carries it on export.

    \b
    Examples:
      polar-mitm reward --db runs.sqlite --session run-42 --value 1.0
      polar-mitm reward --db runs.sqlite --session run-42 --clear
    """
    db = _require_db(db)
    if clear == (value is not None):
        raise click.UsageError("pass exactly one of --value or --clear")
    try:
        set_reward(db, session, None if clear else value)
    except KeyError as e:
        raise click.ClickException(str(e.args[0])) from None
    click.echo(f"session {session}: reward {'cleared' if clear else value}", err=True)


@click.command("check-logprobs")
@click.option(
    "--model",
    "model_dir",
    required=True,
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    help="The trainer's weights (a Hugging Face model directory): the ones that sampled the rows.",
)
@click.option(
    "--parquet",
    "parquets",
    multiple=True,
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="Exported rows (repeatable). Without it, rows are read from --db.",
)
@_db_option
@click.option(
    "--strategy", type=click.Choice(choices(Strategy)), default=Strategy.PREFIX_MERGE.value, show_default=True
)
@_selection_options
@click.option("--tolerance", type=float, default=1e-3, show_default=True, help="Absolute logprob difference.")
@click.option(
    "--max-over",
    type=float,
    default=0.01,
    show_default=True,
    help="Fail (exit 1) when more than this share of trained tokens is over the tolerance.",
)
@click.option("--temperature", type=float, default=1.0, show_default=True, help="The sampling temperature.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as one JSON object.")
@_guarded
def check_logprobs(
    model_dir: Path,
    parquets: tuple[Path, ...],
    db: Path,
    strategy: str,
    selection: Selection,
    tolerance: float,
    max_over: float,
    temperature: float,
    as_json: bool,
) -> None:
    """Train/inference agreement: the trainer's logprob of every trained token (one forward pass
    over prompt_ids + response_ids) against the engine's response_logprobs.

    Reports max and mean absolute difference and the share of tokens over --tolerance, per row.
    Exits 1 when more than --max-over of them are over it, and 2, loudly, when rows look
    misaligned (most tokens off: an off-by-one, other weights, another temperature). Needs the
    [hf] extra (torch, transformers).
    """
    try:
        from polar_mitm.fake.hf import load_causal_lm
        from polar_mitm.reconstruct.agreement import Misaligned, check, render
    except ImportError as e:
        raise click.ClickException(
            f"check-logprobs needs torch and transformers (pip install 'polar-mitm[hf]'): {e}"
        ) from None
    if parquets:
        import pyarrow.parquet as pq

        rows: Any = (r for p in parquets for r in pq.read_table(p).to_pylist())
    else:
        rows = (
            t.to_row()
            for t in iter_trajectories(_require_db(db, selection), strategy=strategy, selection=selection)
        )
    try:
        report = check(load_causal_lm(model_dir), rows, tolerance=tolerance, temperature=temperature)
    except Misaligned as e:
        click.echo(f"polar-mitm check-logprobs: MISALIGNED: {e}", err=True)
        sys.exit(2)
    click.echo(json.dumps(report.as_dict()) if as_json else render(report))
    if report.over > max_over:
        click.echo(
            f"polar-mitm check-logprobs: {report.over:.2%} of trained tokens over {tolerance:g} "
            f"(allowed {max_over:.2%})",
            err=True,
        )
        sys.exit(1)


COMMANDS = [export, stats, show, reward, check_logprobs]
