"""Thin adapters from the rollout service to trainers (`slime`, `verl`, `trl`). Each imports its
trainer lazily: with the trainer installed it returns the trainer's own types, without it plain
objects with the same fields (so the adapters are testable, and importable, anywhere).

A sample may have several rows (prefix-merge breaks: a subagent, a compaction). A trainer whose
API takes several sequences per sample gets every trained row (`trained_rows`); one that takes
exactly one gets the row the user chooses (`chosen_row`: the main agent's by default), and the
rows left out are counted where that trainer logs metrics. docs/training.md says which is which.
"""

from __future__ import annotations

from collections.abc import Iterable

from polar_mitm.client import Sample

# What a one-row trainer may be given of a sample: the last row of an agent role, or the last row.
ROW_CHOICES = ("main", "subagent", "compaction", "last")


def check_row_choice(row: str) -> str:
    if row not in ROW_CHOICES:
        raise ValueError(f"row {row!r}: choose one of {', '.join(ROW_CHOICES)} (the row a sample gives)")
    return row


def rows_by_sample(rows: Iterable[Sample]) -> dict[int, list[Sample]]:
    """A group's rows by sample index, each sample's in the service's order."""
    out: dict[int, list[Sample]] = {}
    for r in rows:
        out.setdefault(r.index, []).append(r)
    return out


def chosen_row(rows: list[Sample], row: str = "main") -> Sample | None:
    """The one row of a sample a one-row trainer gets: its last row of role `row` ("last": its
    last row whatever the role); a sample with no row of that role gives its last row. None: the
    sample has no row (the harness never called the model)."""
    check_row_choice(row)
    if row != "last":
        of_role = [r for r in rows if r.role == row]
        if of_role:
            return of_role[-1]
    return rows[-1] if rows else None


def trained_rows(rows: list[Sample]) -> list[Sample]:
    """The rows of a sample a trainer taking several should get: those with a trained token, or
    (a sample with none: failed, masked) its last row alone, so that no sample goes missing."""
    trained = [r for r in rows if any(r.loss_mask)]
    return trained or rows[-1:]
