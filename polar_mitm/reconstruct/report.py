"""What a rollout produced, per task: samples, mean reward, pass@1, pass@k, failures by cause,
time per stage, and whether a group carries any GRPO signal. Read from the store, so `rollout`
and `stats` print the same numbers.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from polar_mitm.store.rollouts import SampleInfo, read_samples

STAGE_COLUMNS = ("starting", "ready", "running", "scoring")


def passed(reward: float | None) -> bool:
    return reward is not None and reward >= 1.0


def cause_class(s: SampleInfo) -> str:
    """A failure's kind: the cause up to its first colon (`sandbox start`, `evaluator`, …)."""
    return (s.cause or s.status).split(":", 1)[0].strip()


@dataclass
class TaskReport:
    task_id: str
    groups: int = 0
    samples: int = 0  # final attempts
    usable: int = 0  # completed or agent_timeout
    rewards: list[float] = field(default_factory=list)
    passes: int = 0
    groups_all_equal: int = 0  # groups whose usable rewards are all equal: no GRPO signal
    retries: int = 0
    failures: Counter[str] = field(default_factory=Counter)
    stage_seconds: dict[str, list[float]] = field(default_factory=dict)
    k: int = 0  # the largest group size

    @property
    def mean_reward(self) -> float | None:
        return sum(self.rewards) / len(self.rewards) if self.rewards else None

    @property
    def pass_at_1(self) -> float | None:
        return self.passes / self.usable if self.usable else None

    @property
    def pass_at_k(self) -> float | None:
        """Whether any usable sample passed (k = the group's size), averaged over groups."""
        return self._any_passed / self.groups if self.groups and self.usable else None

    _any_passed: int = 0

    def stage_mean(self, stage: str) -> float | None:
        xs = self.stage_seconds.get(stage) or []
        return sum(xs) / len(xs) if xs else None

    def to_dict(self) -> dict:
        return {
            "task_id": self.task_id,
            "groups": self.groups,
            "samples": self.samples,
            "usable": self.usable,
            "mean_reward": self.mean_reward,
            "pass@1": self.pass_at_1,
            f"pass@{self.k}": self.pass_at_k,
            "groups_all_equal": self.groups_all_equal,
            "retries": self.retries,
            "failures": dict(self.failures),
            "seconds_per_stage": {s: self.stage_mean(s) for s in STAGE_COLUMNS},
        }


def task_reports(samples: Iterable[SampleInfo]) -> list[TaskReport]:
    by_group: dict[str, list[SampleInfo]] = {}
    for s in samples:
        by_group.setdefault(s.group_id, []).append(s)
    reports: dict[str, TaskReport] = {}
    for members in by_group.values():
        r = reports.setdefault(members[0].task_id, TaskReport(members[0].task_id))
        r.groups += 1
        final = [s for s in members if s.status != "retried"]
        r.retries += len(members) - len(final)
        r.samples += len(final)
        r.k = max(r.k, len(final))
        usable = [s for s in final if s.trainable]
        r.usable += len(usable)
        rewards = [s.reward or 0.0 for s in usable]
        r.rewards += rewards
        r.passes += sum(passed(s.reward) for s in usable)
        r._any_passed += any(passed(s.reward) for s in usable)
        if len(rewards) > 1 and len(set(rewards)) == 1:
            r.groups_all_equal += 1
        for s in final:
            if not s.trainable:
                r.failures[cause_class(s)] += 1
            elif s.status == "agent_timeout":
                r.failures["agent timeout"] += 1
            for stage, secs in json.loads(s.timings or "{}").items():
                r.stage_seconds.setdefault(stage, []).append(float(secs))
    return sorted(reports.values(), key=lambda r: r.task_id)


def rollout_reports(path: str | Path, rollout: str | None = None) -> list[TaskReport]:
    return task_reports(read_samples(path, rollout=rollout).values())


def _fmt(x: float | None, pct: bool = False) -> str:
    if x is None:
        return "-"
    return f"{100 * x:.0f}%" if pct else f"{x:.2f}"


def render_table(reports: list[TaskReport], *, title: str = "rollout") -> str:
    """A plain-text table (one line per task), for terminals and logs alike."""
    headers = ["task", "samples", "usable", "mean reward", "pass@1", "pass@k", "no signal", "failures"]
    headers += [f"{s} s" for s in STAGE_COLUMNS]
    rows = []
    for r in reports:
        fails = ", ".join(f"{k} {v}" for k, v in sorted(r.failures.items())) or "-"
        rows.append(
            [
                r.task_id,
                str(r.samples),
                str(r.usable),
                _fmt(r.mean_reward),
                _fmt(r.pass_at_1, True),
                f"{_fmt(r.pass_at_k, True)} (k={r.k})",
                f"{r.groups_all_equal}/{r.groups}",
                fails + (f"; {r.retries} retried" if r.retries else ""),
                *[_fmt(r.stage_mean(s)) for s in STAGE_COLUMNS],
            ]
        )
    widths = [max(len(h), *(len(row[i]) for row in rows)) if rows else len(h) for i, h in enumerate(headers)]
    line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)).rstrip()  # noqa: E731
    out = [title, line(headers), line(["-" * w for w in widths])]
    out += [line(row) for row in rows]
    return "\n".join(out)
