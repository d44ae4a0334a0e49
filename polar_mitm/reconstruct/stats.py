"""Counters a reconstruction run keeps, and how `polar-mitm stats` prints them.

Selection, the strategies and the export loop each add to one `ReconstructStats`; nothing here
reads the database.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from polar_mitm.reconstruct.trajectory import Trajectory
from polar_mitm.store.queries import ToolParseRate


@dataclass
class ReconstructStats:
    """What happened to every turn on its way to rows."""

    turns_read: int = 0  # turns the store yielded for the filters
    side_calls_excluded: int = 0  # tag set (title, router, ...) and --no-include-side-calls
    not_ok_excluded: int = 0  # status aborted / error and no --include-aborted
    turns: int = 0  # turns that entered a strategy
    sessions: set[str] = field(default_factory=set)
    per_request_tokens: int = 0  # Σ len(prompt) + len(output): what per-request rows hold
    sampled_tokens: int = 0  # Σ len(output) of the turns that entered
    trajectories: int = 0
    merged_tokens: int = 0  # Σ row lengths (prompt_ids + response_ids) of the rows produced
    trained_tokens: int = 0  # Σ loss_mask
    rewarded_trajectories: int = 0
    retries_dropped: int = 0  # identical prompt ids: all but one kept (prefix-merge)
    branches: int = 0  # extra rows created where two turns extend the same sequence
    breaks: Counter[str] = field(default_factory=Counter)  # class → count (prefix-merge)
    mismatches: Counter[str] = field(default_factory=Counter)  # kind → count
    # The tool parser per harness (`stats` only: the store's `tool_parse_rates`).
    tool_parse: list[ToolParseRate] = field(default_factory=list)
    # Untagged turns of generic-recipe sessions that look like side calls, judged over the whole
    # session (`source.side_call_suspects`): turn id -> the signs. Stored and exported as main.
    side_call_suspects: dict[str, list[str]] = field(default_factory=dict)

    def add_row(self, row: Trajectory) -> None:
        self.trajectories += 1
        self.merged_tokens += row.num_tokens
        self.trained_tokens += row.num_trained
        if row.reward is not None:
            self.rewarded_trajectories += 1

    @property
    def merge_ratio(self) -> float | None:
        """Turns per row: 1.0 for per-request; the average chain length for prefix-merge."""
        return self.turns / self.trajectories if self.trajectories else None

    @property
    def trainer_token_ratio(self) -> float | None:
        """Tokens a trainer reads per-request ÷ tokens it reads from these rows."""
        return self.per_request_tokens / self.merged_tokens if self.merged_tokens else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "sessions": len(self.sessions),
            "turns_read": self.turns_read,
            "side_calls_excluded": self.side_calls_excluded,
            "not_ok_excluded": self.not_ok_excluded,
            "turns": self.turns,
            "trajectories": self.trajectories,
            "merge_ratio": _round(self.merge_ratio),
            "per_request_tokens": self.per_request_tokens,
            "merged_tokens": self.merged_tokens,
            "trainer_token_ratio": _round(self.trainer_token_ratio),
            "sampled_tokens": self.sampled_tokens,
            "trained_tokens": self.trained_tokens,
            "rewarded_trajectories": self.rewarded_trajectories,
            "retries_dropped": self.retries_dropped,
            "branches": self.branches,
            "breaks": dict(sorted(self.breaks.items())),
            "mismatches": {"total": sum(self.mismatches.values()), **dict(sorted(self.mismatches.items()))},
            "tool_parse": [r.model_dump() for r in self.tool_parse],
            "side_call_suspects": dict(self.side_call_suspects),
        }

    def render(self) -> str:
        """The human-readable report."""
        d = self.to_dict()
        excluded = []
        if self.side_calls_excluded:
            excluded.append(f"{self.side_calls_excluded} side calls")
        if self.not_ok_excluded:
            excluded.append(f"{self.not_ok_excluded} aborted/error")
        lines = [
            f"sessions             {d['sessions']}",
            f"turns                {d['turns']}"
            + (f"  (of {self.turns_read} read; excluded {', '.join(excluded)})" if excluded else ""),
            f"trajectories         {d['trajectories']}",
            f"merge ratio          {_fmt(d['merge_ratio'])}  turns per trajectory",
            f"trainer-token ratio  {_fmt(d['trainer_token_ratio'])}  "
            f"per-request tokens {self.per_request_tokens:,} ÷ merged tokens {self.merged_tokens:,}",
            f"sampled tokens       {self.sampled_tokens:,}  (trained: {self.trained_tokens:,})",
            f"rewarded             {self.rewarded_trajectories} of {self.trajectories} trajectories",
            f"retries dropped      {self.retries_dropped}",
            f"branches             {self.branches}",
            "breaks               "
            + (", ".join(f"{k} {v}" for k, v in d["breaks"].items()) if self.breaks else "0"),
            f"mismatches           {d['mismatches']['total']}"
            + (
                "  (" + ", ".join(f"{k} {v}" for k, v in sorted(self.mismatches.items())) + ")"
                if self.mismatches
                else ""
            ),
        ]
        for r in self.tool_parse:
            kinds = ", ".join(f"{k} {v}" for k, v in sorted(r.failures.items()))
            lines.append(
                f"tool parse           {r.harness or '-'} / {r.parser}: {r.failed_turns} of {r.turns} turns failed "
                f"({r.failed_turns / r.turns:.1%})" + (f": {kinds}" if kinds else "")
            )
        if self.side_call_suspects:
            lines.append(f"side-call suspects   {self.suspects_warning()}")
        return "\n".join(lines)

    def suspects_warning(self) -> str:
        n = len(self.side_call_suspects)
        signs = sorted({s for v in self.side_call_suspects.values() for s in v})
        return (
            f"{n} untagged turn{'s' * (n != 1)} of generic-recipe sessions look like side calls "
            f"over the whole session ({'; '.join(signs)}) and are rows like main turns; run with "
            "the harness's recipe (--recipe), or give it a side_calls rule"
        )


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 4)


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"
