"""The trajectory row every strategy produces and every export format writes.

One `Trajectory` is one training example: the token sequence a trainer feeds the model, split
into an untrained prefix (`prompt_ids`) and the rest (`response_ids`), with a `loss_mask` that is
1 exactly on tokens the model sampled and `response_logprobs` that hold the engine's logprob there
(0.0 elsewhere). `TRAJECTORY_SCHEMA` is the parquet contract every export follows, column for column (docs/data.md
lists and explains its columns).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa

TOKEN_DTYPE = np.dtype("<i4")
MASK_DTYPE = np.dtype("i1")
LOGPROB_DTYPE = np.dtype("<f4")

TRAJECTORY_SCHEMA = pa.schema(
    [
        pa.field("trajectory_id", pa.string(), nullable=False),
        pa.field("session_id", pa.string(), nullable=False),
        pa.field("task_id", pa.string(), nullable=True),
        pa.field("prompt_ids", pa.list_(pa.int32()), nullable=False),
        pa.field("response_ids", pa.list_(pa.int32()), nullable=False),
        pa.field("loss_mask", pa.list_(pa.int8()), nullable=False),
        pa.field("response_logprobs", pa.list_(pa.float32()), nullable=False),
        pa.field("num_turns", pa.int32(), nullable=False),
        pa.field("turn_ids", pa.list_(pa.string()), nullable=False),
        pa.field("finish_reason", pa.string(), nullable=False),
        pa.field("reward", pa.float64(), nullable=True),
        pa.field("metadata", pa.string(), nullable=False),
        # Rollouts (null for rows outside one): see reconstruct/groups.py.
        pa.field("group_id", pa.string(), nullable=True),
        pa.field("sample_index", pa.int32(), nullable=True),
        pa.field("status", pa.string(), nullable=True),
        pa.field("reward_detail", pa.string(), nullable=True),
        pa.field("advantage", pa.float64(), nullable=True),
        # Multi-agent structure (see reconstruct/structure.py): main | subagent | compaction | side,
        # and the trajectory id of the row it came from (null for main and side rows).
        pa.field("role", pa.string(), nullable=False),
        pa.field("parent_id", pa.string(), nullable=True),
        # The proxy's tool parser on the turns this row trains: null (none read one), "ok", or the
        # kind of the first block that failed (all of them in metadata `tool_parse_failures`).
        pa.field("tool_parse", pa.string(), nullable=True),
    ]
)


@dataclass(eq=False, slots=True)
class Trajectory:
    """One row of the export. Token arrays are numpy (int32 / int8 / float32) so that batches
    convert to Arrow without a Python-level loop."""

    trajectory_id: str
    session_id: str
    task_id: str | None
    prompt_ids: np.ndarray
    response_ids: np.ndarray
    loss_mask: np.ndarray
    response_logprobs: np.ndarray
    turn_ids: list[str]
    finish_reason: str
    reward: float | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    group_id: str | None = None
    sample_index: int | None = None
    status: str | None = None  # the sample's outcome: completed, agent_timeout, failed, …
    reward_detail: str | None = None  # JSON from the evaluator
    advantage: float | None = None
    role: str = "main"
    parent_id: str | None = None
    tool_parse: str | None = None

    @classmethod
    def from_sequence(
        cls,
        ids: np.ndarray,
        mask: np.ndarray,
        logprobs: np.ndarray,
        **fields: Any,
    ) -> Trajectory:
        """Split a full sequence at its first trained token: before it is `prompt_ids`."""
        ids = np.asarray(ids, dtype=TOKEN_DTYPE)
        mask = np.asarray(mask, dtype=MASK_DTYPE)
        logprobs = np.asarray(logprobs, dtype=LOGPROB_DTYPE)
        if not len(ids) == len(mask) == len(logprobs):
            raise ValueError(
                f"sequence lengths differ: ids {len(ids)}, mask {len(mask)}, logprobs {len(logprobs)}"
            )
        trained = np.flatnonzero(mask)
        cut = int(trained[0]) if len(trained) else len(ids)
        return cls(
            prompt_ids=ids[:cut],
            response_ids=ids[cut:],
            loss_mask=mask[cut:],
            response_logprobs=logprobs[cut:],
            **fields,
        )

    @property
    def num_turns(self) -> int:
        return len(self.turn_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)

    @property
    def num_trained(self) -> int:
        return int(np.count_nonzero(self.loss_mask))

    @property
    def metadata(self) -> str:
        return json.dumps(self.meta, separators=(",", ":"), sort_keys=True)

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> Trajectory:
        """A row as `to_row` wrote it (JSON lines, the rollout service), back as a Trajectory."""
        return cls(
            trajectory_id=row["trajectory_id"],
            session_id=row["session_id"],
            task_id=row.get("task_id"),
            prompt_ids=np.asarray(row["prompt_ids"], dtype=TOKEN_DTYPE),
            response_ids=np.asarray(row["response_ids"], dtype=TOKEN_DTYPE),
            loss_mask=np.asarray(row["loss_mask"], dtype=MASK_DTYPE),
            response_logprobs=np.asarray(row["response_logprobs"], dtype=LOGPROB_DTYPE),
            turn_ids=list(row["turn_ids"]),
            finish_reason=row["finish_reason"],
            reward=row.get("reward"),
            meta=json.loads(row.get("metadata") or "{}"),
            group_id=row.get("group_id"),
            sample_index=row.get("sample_index"),
            status=row.get("status"),
            reward_detail=row.get("reward_detail"),
            advantage=row.get("advantage"),
            role=row.get("role") or "main",
            parent_id=row.get("parent_id"),
            tool_parse=row.get("tool_parse"),
        )

    def to_row(self) -> dict[str, Any]:
        """The row as plain Python values, in schema column order (what JSON lines hold)."""
        return {
            "trajectory_id": self.trajectory_id,
            "session_id": self.session_id,
            "task_id": self.task_id,
            "prompt_ids": self.prompt_ids.tolist(),
            "response_ids": self.response_ids.tolist(),
            "loss_mask": self.loss_mask.tolist(),
            "response_logprobs": self.response_logprobs.tolist(),
            "num_turns": self.num_turns,
            "turn_ids": list(self.turn_ids),
            "finish_reason": self.finish_reason,
            "reward": self.reward,
            "metadata": self.metadata,
            "group_id": self.group_id,
            "sample_index": self.sample_index,
            "status": self.status,
            "reward_detail": self.reward_detail,
            "advantage": self.advantage,
            "role": self.role,
            "parent_id": self.parent_id,
            "tool_parse": self.tool_parse,
        }


def _list_column(arrays: list[np.ndarray], dtype: np.dtype, arrow_type: pa.DataType) -> pa.Array:
    offsets = np.zeros(len(arrays) + 1, dtype=np.int64)
    np.cumsum([len(a) for a in arrays], out=offsets[1:])
    values = np.concatenate(arrays).astype(dtype, copy=False) if arrays else np.empty(0, dtype=dtype)
    if offsets[-1] >= 2**31:  # the sinks flush long before this; list<> has 32-bit offsets
        raise ValueError(f"a batch of {offsets[-1]} tokens is too large for one Arrow list array")
    return pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), pa.array(values, type=arrow_type))


def to_table(rows: list[Trajectory]) -> pa.Table:
    """A batch of rows as an Arrow table with exactly `TRAJECTORY_SCHEMA`."""
    columns = [
        pa.array([r.trajectory_id for r in rows], type=pa.string()),
        pa.array([r.session_id for r in rows], type=pa.string()),
        pa.array([r.task_id for r in rows], type=pa.string()),
        _list_column([r.prompt_ids for r in rows], TOKEN_DTYPE, pa.int32()),
        _list_column([r.response_ids for r in rows], TOKEN_DTYPE, pa.int32()),
        _list_column([r.loss_mask for r in rows], MASK_DTYPE, pa.int8()),
        _list_column([r.response_logprobs for r in rows], LOGPROB_DTYPE, pa.float32()),
        pa.array([r.num_turns for r in rows], type=pa.int32()),
        pa.array([r.turn_ids for r in rows], type=pa.list_(pa.string())),
        pa.array([r.finish_reason for r in rows], type=pa.string()),
        pa.array([r.reward for r in rows], type=pa.float64()),
        pa.array([r.metadata for r in rows], type=pa.string()),
        pa.array([r.group_id for r in rows], type=pa.string()),
        pa.array([r.sample_index for r in rows], type=pa.int32()),
        pa.array([r.status for r in rows], type=pa.string()),
        pa.array([r.reward_detail for r in rows], type=pa.string()),
        pa.array([r.advantage for r in rows], type=pa.float64()),
        pa.array([r.role for r in rows], type=pa.string()),
        pa.array([r.parent_id for r in rows], type=pa.string()),
        pa.array([r.tool_parse for r in rows], type=pa.string()),
    ]
    return pa.Table.from_arrays(columns, schema=TRAJECTORY_SCHEMA)


def token_array(ids: list[int] | np.ndarray) -> np.ndarray:
    """Token ids as int32: an array as it is (or cast), a list through fromiter with a count (the
    quickest way from a long Python list)."""
    if isinstance(ids, np.ndarray):
        return ids.astype(TOKEN_DTYPE, copy=False)
    return np.fromiter(ids, dtype=TOKEN_DTYPE, count=len(ids))


def output_arrays(
    output_ids: list[int] | np.ndarray, output_logprobs: list[float] | np.ndarray
) -> tuple[np.ndarray, np.ndarray, bool]:
    """A turn's sampled ids and their logprobs as arrays.

    The logprobs are fitted to the output's length (padded with 0.0 or cut) so that every row keeps
    `len(loss_mask) == len(response_logprobs) == len(response_ids)`; the flag says whether they
    already fitted, and callers count the turns where they did not.
    """
    output = token_array(output_ids)
    if isinstance(output_logprobs, np.ndarray):
        logprobs = output_logprobs.astype(LOGPROB_DTYPE, copy=False)
    else:
        logprobs = np.fromiter(output_logprobs, dtype=LOGPROB_DTYPE, count=len(output_logprobs))
    fits = len(logprobs) == len(output)
    if not fits:
        logprobs = np.concatenate([logprobs, np.zeros(max(0, len(output) - len(logprobs)), LOGPROB_DTYPE)])
        logprobs = logprobs[: len(output)]
    return output, logprobs, fits


def finish_reason_of(finish_reason: str | None, status: str) -> str:
    """The row's finish reason: the engine's, else one derived from the turn's status."""
    if finish_reason:
        return finish_reason
    return {"aborted": "abort", "error": "error"}.get(status, "unknown")


# What a trainer gets of a turn whose tool-call blocks did not all parse (`export
# --tool-parse-failures`): the row as it is, the turn's sampled tokens masked, or the reward of its
# sample (session) set to 0.0.
TOOL_PARSE_POLICIES = ("keep", "mask", "zero")


def tool_parse_failures(stored: str | None) -> tuple[bool, list[dict[str, Any]]]:
    """(whether a tool parser read the turn, its failed blocks) from `Turn.tool_parse`."""
    if not stored:
        return False, []
    try:
        status = json.loads(stored)
    except ValueError:
        return False, []
    failures = status.get("failures") if isinstance(status, dict) else None
    return True, [f for f in failures or [] if isinstance(f, dict)]
