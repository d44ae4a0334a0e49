"""The names of how stored turns become training rows, one enum each, spelled once: the row
strategy (`export --strategy`, `rollout --strategy`, `submit --builder`, the service's wire
`builder`, the viewer's `?strategy=`) and the GRPO advantage normalization (`--group-normalize`,
the service's `?normalize=`). Core floor: the wire models (`api.py`) and `reconstruct/` both read
them, and the command-line choices are made from them.
"""

from __future__ import annotations

from enum import StrEnum


class Strategy(StrEnum):
    """How a session's turns become rows."""

    PREFIX_MERGE = "prefix-merge"  # one row per trajectory: turns that extend each other merged
    PER_REQUEST = "per-request"  # one row per generation


class Normalize(StrEnum):
    """How a group's rewards become advantages."""

    STD = "std"  # (reward - group mean) / group std
    LOO = "loo"  # reward - mean of the group's other samples


def choices(enum: type[StrEnum]) -> list[str]:
    """The values of `enum`, in order: a click.Choice's or an error message's list."""
    return [e.value for e in enum]
