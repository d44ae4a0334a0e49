"""Looking at rows: a trajectory decoded with its trained tokens highlighted, or a list of rows.

Pure rendering over `Trajectory` objects; finding the rows is `find_rows`, which merges only the
one session that holds the asked-for id.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

import click
import numpy as np

from polar_mitm.reconstruct.breaks import TokenText
from polar_mitm.reconstruct.export import iter_trajectories
from polar_mitm.reconstruct.source import Selection
from polar_mitm.reconstruct.trajectory import Trajectory
from polar_mitm.store.queries import session_of_turn
from polar_mitm.strategies import Strategy

# Brackets around trained spans when there is no colour to show them.
TRAINED_OPEN, TRAINED_CLOSE = "«", "»"


def find_rows(
    path: str | Path,
    ident: str,
    *,
    strategy: str = Strategy.PREFIX_MERGE,
    selection: Selection | None = None,
    text: TokenText | None = None,
) -> list[Trajectory]:
    """Rows for `ident`: a trajectory id, else the first row holding that turn, else (a session
    id) every row of the session. KeyError if the store has no such id."""
    session = session_of_turn(path, ident)
    if session is None:
        raise KeyError(f"no trajectory, turn or session {ident!r} in {path}")
    selection = replace(selection or Selection(), session=session)
    rows = list(iter_trajectories(path, strategy=strategy, selection=selection, text=text))
    if ident == session:
        return rows
    exact = [r for r in rows if r.trajectory_id == ident]
    return exact or [r for r in rows if ident in r.turn_ids][:1]


def _spans(mask: np.ndarray) -> list[tuple[int, int, bool]]:
    """Runs of equal mask as (start, end, trained)."""
    if len(mask) == 0:
        return []
    edges = np.flatnonzero(np.diff(mask.astype(np.int8))) + 1
    starts = [0, *edges.tolist()]
    ends = [*edges.tolist(), len(mask)]
    return [(s, e, bool(mask[s])) for s, e in zip(starts, ends, strict=True)]


def render_sequence(
    row: Trajectory,
    *,
    decode: Callable[[Sequence[int]], str] | None = None,
    color: bool = False,
) -> str:
    """The row's whole sequence: decoded text if `decode` is given, else token ids; trained
    spans green (with `color`) or between « and »."""

    def show(ids: np.ndarray, trained: bool) -> str:
        if len(ids) == 0:
            return ""
        body = decode(ids.tolist()) if decode is not None else " ".join(map(str, ids.tolist()))
        if color:
            return click.style(body, fg="green", bold=True) if trained else click.style(body, dim=True)
        return f"{TRAINED_OPEN}{body}{TRAINED_CLOSE}" if trained else body

    sep = "" if decode is not None else " "
    parts = [show(row.prompt_ids, False)]
    for s, e, trained in _spans(row.loss_mask):
        parts.append(show(row.response_ids[s:e], trained))
    return sep.join(p for p in parts if p)


def _abridge(ids: Sequence[str], keep: int = 3) -> str:
    if len(ids) <= 2 * keep:
        return ", ".join(ids)
    return ", ".join([*ids[:keep], "…", *ids[-keep:]])


def render_header(row: Trajectory) -> str:
    meta = json.loads(row.metadata)
    fields = [
        ("trajectory", row.trajectory_id),
        ("session", row.session_id),
        ("task", row.task_id or "-"),
        ("turns", f"{row.num_turns}  ({_abridge(row.turn_ids)})"),
        ("tokens", f"{row.num_tokens}  (prompt {len(row.prompt_ids)}, trained {row.num_trained})"),
        ("finish", row.finish_reason),
        ("reward", "-" if row.reward is None else f"{row.reward:g}"),
    ]
    if meta.get("branched_from"):
        fields.append(
            ("branched from", f"{meta['branched_from']} (trained from token {meta['trained_from']})")
        )
    for b in meta.get("breaks", []):
        fields.append(("break", f"{b['class']} at token {b['common_prefix']} vs {b['vs_turn']} ({b['at']})"))
    width = max(len(k) for k, _ in fields)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in fields)


def render_list(rows: Sequence[Trajectory]) -> str:
    """One line per row: id, session, turns, tokens, trained tokens, reward, finish reason."""
    header = ("trajectory_id", "session_id", "turns", "tokens", "trained", "reward", "finish")
    table = [header] + [
        (
            r.trajectory_id,
            r.session_id,
            str(r.num_turns),
            str(r.num_tokens),
            str(r.num_trained),
            "-" if r.reward is None else f"{r.reward:g}",
            r.finish_reason,
        )
        for r in rows
    ]
    widths = [max(len(line[i]) for line in table) for i in range(len(header))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip() for line in table
    )
