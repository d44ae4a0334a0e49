"""Rollouts in the store: `rollouts`, `rollout_groups` and `samples` (migration m002).

A sample is one attempt of one harness run on one task, and it IS a session: its turns are the
session's turns. A retried sample keeps its failed attempts as rows of their own (status
`retried`), so every turn in the store stays explained. `RolloutLog` is the async writer the
pipeline uses (on the proxy's connection); `read_samples` is the synchronous reader of exports
and stats.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from polar_mitm import redact
from polar_mitm.outcomes import FINAL, TRAINABLE
from polar_mitm.store.connection import connect
from polar_mitm.store.writer import Store


class RolloutLog:
    """Writes a rollout's progress through the proxy's store connection."""

    def __init__(self, store: Store):
        self.store = store

    async def begin_rollout(self, rollout_id: str, config: dict[str, Any]) -> None:
        """Record a rollout and its configuration, with the values of its extra environment
        (`env`, from `--env`) redacted."""
        if isinstance(config.get("env"), dict):
            config = {**config, "env": redact.env_values(config["env"])}
        await self.store.write(
            (
                "INSERT INTO rollouts (id, created_at, config) VALUES (?, ?, ?)",
                (rollout_id, time.time(), json.dumps(config, default=str)),
            )
        )

    async def end_rollout(self, rollout_id: str, status: str) -> None:
        await self.store.write(
            ("UPDATE rollouts SET ended_at = ?, status = ? WHERE id = ?", (time.time(), status, rollout_id))
        )

    async def add_group(
        self, group_id: str, rollout_id: str, task_id: str, num_samples: int, task: str
    ) -> None:
        await self.store.write(
            (
                "INSERT INTO rollout_groups (id, rollout_id, task_id, num_samples, task, created_at)"
                " VALUES (?, ?, ?, ?, ?, ?)",
                (group_id, rollout_id, task_id, num_samples, task, time.time()),
            )
        )

    async def end_group(self, group_id: str, status: str) -> None:
        await self.store.write(
            (
                "UPDATE rollout_groups SET ended_at = ?, status = ? WHERE id = ?",
                (time.time(), status, group_id),
            )
        )

    async def add_sample(self, session_id: str, group_id: str, index: int, attempt: int, status: str) -> None:
        await self.store.write(
            (
                "INSERT INTO samples (session_id, group_id, sample_index, attempt, status, created_at)"
                " VALUES (?, ?, ?, ?, ?, ?)",
                (session_id, group_id, index, attempt, status, time.time()),
            )
        )

    async def turn_ids(self, session_id: str) -> list[str]:
        """The session's turns so far, oldest first (a multi-step sample's turns by step)."""
        rows = await self.store.query("SELECT id FROM turns WHERE session_id = ? ORDER BY seq", (session_id,))
        return [r[0] for r in rows]

    async def finish_sample(
        self,
        session_id: str,
        *,
        status: str,
        reward: float | None,
        cause: str | None = None,
        detail: dict[str, Any] | None = None,
        exit_code: int | None = None,
        timings: dict[str, float] | None = None,
    ) -> None:
        """Record a sample's end, and its reward on its session (so `export` puts it on every row)."""
        if status not in FINAL:
            raise ValueError(f"not a final sample status: {status!r}")
        now = time.time()
        await self.store.write(
            (
                "UPDATE samples SET status = ?, cause = ?, reward = ?, reward_detail = ?, exit_code = ?,"
                " timings = ?, ended_at = ? WHERE session_id = ?",
                (
                    status,
                    cause,
                    reward,
                    json.dumps(detail, default=str) if detail is not None else None,
                    exit_code,
                    json.dumps(timings or {}),
                    now,
                    session_id,
                ),
            ),
            (
                "UPDATE sessions SET reward = ?, exit_code = ?, ended_at = COALESCE(ended_at, ?) WHERE id = ?",
                (reward, exit_code, now, session_id),
            ),
        )


@dataclass(frozen=True)
class SampleInfo:
    """One attempt of a `rollout` sample as its store (the `samples` table) keeps it: what the
    export and the viewer read to group, reward and mask rows. The service's samples are
    `store.service.SampleRow`; on the wire, `api.SampleView`."""

    session_id: str
    rollout_id: str
    group_id: str
    task_id: str
    sample_index: int
    attempt: int
    status: str
    cause: str | None
    reward: float | None
    reward_detail: str | None
    timings: str

    @property
    def trainable(self) -> bool:
        return self.status in TRAINABLE


def read_samples(path: str | Path, *, rollout: str | None = None) -> dict[str, SampleInfo]:
    """Every sample (attempt) in the store by session id; of one rollout when given."""
    db = connect(path)
    try:
        sql = (
            "SELECT s.session_id, g.rollout_id, s.group_id, g.task_id, s.sample_index, s.attempt, s.status,"
            " s.cause, s.reward, s.reward_detail, s.timings FROM samples s JOIN rollout_groups g ON g.id = s.group_id"
        )
        args: tuple[Any, ...] = ()
        if rollout:
            sql += " WHERE g.rollout_id = ?"
            args = (rollout,)
        return {
            r[0]: SampleInfo(*r)
            for r in db.execute(sql + " ORDER BY s.group_id, s.sample_index, s.attempt", args)
        }
    finally:
        db.close()
