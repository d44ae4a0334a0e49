"""Exports: store → strategy → rows → a file (parquet or JSON lines), streaming.

Prefix merging needs a session's whole tree before it can say which rows exist, and sessions are
interleaved in the store. Rather than buffer every open session of one global pass, the export
reads one session at a time (`read_turns(session=...)`, served by the store's
`(session_id, seq)` index), so memory holds one session's unique tokens plus one row group.
Per-request rows are read the same way: a turn's role depends on the other conversations of its
session (`structure`), so one session's turns are held at a time.

Formats are a registry: `FORMATS[name]` opens a `Sink` for an output path; add an entry (and,
if it needs one, a field of `SinkOptions`) to add a format to `polar-mitm export --format`. A sink
with a `rows(path, *, strategy, selection, stats, on_turn)` method makes its own rows instead of
trajectories (`sft-jsonl`: text conversations, see `sft`).

Harvested sessions hold text, not token ids: with `SinkOptions.tokenizer` set, their
conversations are added as rows retokenized with that tokenizer's chat template
(`sft.retokenized_trajectories`, metadata `"retokenized": true`); without one they are left out.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import IO, Any, Literal, Protocol

import pyarrow.parquet as pq
from tqdm import tqdm

from polar_mitm.reconstruct import sft
from polar_mitm.reconstruct.breaks import TokenText
from polar_mitm.reconstruct.groups import annotate, group_advantages
from polar_mitm.reconstruct.per_request import per_request
from polar_mitm.reconstruct.prefix_merge import prefix_merge
from polar_mitm.reconstruct.source import (
    Selection,
    count_turns,
    read_selected,
    session_ids,
    side_call_suspects,
    tool_results,
)
from polar_mitm.reconstruct.stats import ReconstructStats
from polar_mitm.reconstruct.trajectory import TOOL_PARSE_POLICIES, TRAJECTORY_SCHEMA, Trajectory, to_table
from polar_mitm.store.queries import (
    session_rewards,
    tool_calls,
    tool_parse_failed_sessions,
    tool_parse_rates,
)
from polar_mitm.store.rollouts import read_samples
from polar_mitm.strategies import Normalize, Strategy, choices

log = logging.getLogger("polar_mitm.export")

RewardTo = Literal["all", "main"]
REWARD_TO = ("all", "main")
TOKEN_COLUMNS = ("prompt_ids", "response_ids", "loss_mask", "response_logprobs")


class Sink(Protocol):
    """Where rows go. `close` makes the output final; `abort` leaves nothing half-written."""

    def write(self, row: Trajectory) -> None: ...

    def close(self) -> None: ...

    def abort(self) -> None: ...


@dataclass(frozen=True)
class SinkOptions:
    """Options a format may need beyond the output path (e.g. a tokenizer for text formats)."""

    tokenizer: str | None = None


class _AtomicFile:
    """Writes go to `<out>.partial`; `close` renames it to `out`, so a failed export leaves no
    file that looks complete."""

    def __init__(self, out: str | Path):
        self.out = Path(out)
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = self.out.with_name(self.out.name + ".partial")

    def commit(self) -> None:
        os.replace(self.tmp, self.out)

    def discard(self) -> None:
        self.tmp.unlink(missing_ok=True)


class ParquetSink:
    """Rows → parquet with `TRAJECTORY_SCHEMA`, one row group per `row_group_rows` rows or
    `row_group_tokens` tokens, whichever comes first."""

    def __init__(
        self,
        out: str | Path,
        options: SinkOptions | None = None,
        *,
        row_group_rows: int = 1024,
        row_group_tokens: int = 8_000_000,
    ):
        self._file = _AtomicFile(out)
        # Token columns skip dictionary encoding: ids from a 150k vocabulary overflow the
        # dictionary page and cost a fallback per page; zstd alone is 4x faster, ~15% larger.
        # Nor do they carry min/max statistics: nobody filters on a token id, and computing them
        # took half the writer's time on per-request rows.
        other_columns = [f.name for f in TRAJECTORY_SCHEMA if f.name not in TOKEN_COLUMNS]
        self._writer = pq.ParquetWriter(
            str(self._file.tmp),
            TRAJECTORY_SCHEMA,
            compression="zstd",
            use_dictionary=other_columns,
            write_statistics=other_columns,
        )
        self.row_group_rows = row_group_rows
        self.row_group_tokens = row_group_tokens
        self._rows: list[Trajectory] = []
        self._tokens = 0

    def write(self, row: Trajectory) -> None:
        self._rows.append(row)
        self._tokens += row.num_tokens
        if len(self._rows) >= self.row_group_rows or self._tokens >= self.row_group_tokens:
            self._flush()

    def _flush(self) -> None:
        if self._rows:
            table = to_table(self._rows)
            self._writer.write_table(table, row_group_size=len(self._rows))
        self._rows, self._tokens = [], 0

    def close(self) -> None:
        self._flush()
        self._writer.close()
        self._file.commit()

    def abort(self) -> None:
        self._writer.close()
        self._file.discard()


class JsonlSink:
    """Rows → one JSON object per line, the same columns and values as the parquet rows.
    `-` writes to standard output."""

    def __init__(self, out: str | Path, options: SinkOptions | None = None):
        self._file: _AtomicFile | None = None
        if str(out) == "-":
            self._fh: IO[str] = sys.stdout
        else:
            self._file = _AtomicFile(out)
            self._fh = open(self._file.tmp, "w", encoding="utf-8")

    def write(self, row: Trajectory) -> None:
        self._fh.write(json.dumps(row.to_row(), ensure_ascii=False, separators=(",", ":")))
        self._fh.write("\n")

    def close(self) -> None:
        if self._file is None:
            self._fh.flush()
            return
        self._fh.close()
        self._file.commit()

    def abort(self) -> None:
        if self._file is not None:
            self._fh.close()
            self._file.discard()


class SftJsonlSink(JsonlSink):
    """Conversations → one OpenAI chat-format object per line (`messages` with `tool_calls` and
    `tool` messages, `tools`, `metadata`), for SFT. Its rows are rebuilt from the stored text by
    `sft.sft_records`: prefix-merge writes each session's final conversations, per-request every turn."""

    rows = staticmethod(sft.sft_records)

    def write(self, row: dict) -> None:  # type: ignore[override]
        self._fh.write(json.dumps(row, ensure_ascii=False, separators=(",", ":")))
        self._fh.write("\n")


FORMATS: dict[str, Callable[[str | Path, SinkOptions], Sink]] = {
    "parquet": ParquetSink,
    "jsonl": JsonlSink,
    # Its rows are the dicts its own `rows` makes, not Trajectory: the one sink Sink's row type misses.
    "sft-jsonl": SftJsonlSink,  # type: ignore[dict-item]
}


def iter_trajectories(
    path: str | Path,
    *,
    strategy: str = Strategy.PREFIX_MERGE,
    selection: Selection | None = None,
    stats: ReconstructStats | None = None,
    text: TokenText | None = None,
    on_turn: Callable[[], object] | None = None,
    retokenize: str | Path | None = None,
    normalize: Normalize | None = None,
    reward_to: RewardTo = "all",
    tool_parse_failures: str = "keep",
) -> Iterator[Trajectory]:
    """The rows of a store under one strategy, streamed (see the module docstring). With
    `retokenize` (a tokenizer directory), harvested conversations follow as retokenized rows.
    Rows of rollout samples carry their group, sample and reward (`groups.annotate`); with
    `normalize`, a GRPO advantage too. A session's reward goes to all its rows (`reward_to`
    "all"), or to its main agent's rows only ("main": subagent, compaction and side rows get
    none). A turn whose tool calls did not all parse (`tool_parse_failures`): "keep" it as it is
    (the `tool_parse` column says so), "mask" its sampled tokens, or "zero" the reward of its
    session (its sample: before advantages are computed)."""
    if tool_parse_failures not in TOOL_PARSE_POLICIES:
        raise ValueError(
            f"unknown tool-parse policy {tool_parse_failures!r}; choose one of {', '.join(TOOL_PARSE_POLICIES)}"
        )
    selection = selection or Selection()
    stats = stats if stats is not None else ReconstructStats()
    rewards = session_rewards(path)
    samples = read_samples(path, rollout=selection.rollout)
    if tool_parse_failures == "zero":
        failed = tool_parse_failed_sessions(path)
        rewards = {sid: 0.0 if sid in failed else r for sid, r in rewards.items()}
        samples = {sid: replace(s, reward=0.0) if sid in failed else s for sid, s in samples.items()}
    advantage = group_advantages(samples, normalize) if normalize else {}
    rows = _session_rows(path, strategy, selection, stats, on_turn, text, rewards, tool_parse_failures)
    if retokenize is not None:
        rows = itertools.chain(
            rows,
            sft.retokenized_trajectories(
                path,
                tokenizer=retokenize,
                strategy=strategy,
                selection=selection,
                stats=stats,
                on_turn=on_turn,
            ),
        )
    for row in rows:
        if samples:
            annotate(row, samples.get(row.session_id), advantage.get(row.session_id))
        if reward_to == "main" and row.role != "main":
            row.reward = row.advantage = None
        stats.add_row(row)
        yield row


def _session_rows(
    path: str | Path,
    strategy: str,
    selection: Selection,
    stats: ReconstructStats,
    on_turn: Callable[[], object] | None,
    text: TokenText | None,
    rewards: dict[str, float | None],
    tool_parse_failures: str,
) -> Iterator[Trajectory]:
    """The selected sessions' rows under `strategy`, session by session: a turn's role depends on
    its session's other conversations."""
    if strategy not in (Strategy.PER_REQUEST, Strategy.PREFIX_MERGE):
        raise ValueError(f"unknown strategy {strategy!r}; choose one of {', '.join(choices(Strategy))}")
    common: dict[str, Any] = {
        "rewards": rewards,
        "stats": stats,
        "tool_calls": lambda ids: tool_calls(path, ids),
        "tool_results": lambda ids: tool_results(path, ids),
        "tool_parse_failures": tool_parse_failures,
    }
    for session in session_ids(path, selection):
        if strategy == Strategy.PER_REQUEST:
            # Arrays, not lists: a per-request row repeats its whole prompt, and a Python int per
            # token cost more than the rest of the export.
            turns = read_selected(path, selection, session=session, stats=stats, on_turn=on_turn, arrays=True)
            yield from per_request(turns, **common)
        else:
            turns = read_selected(path, selection, session=session, stats=stats, on_turn=on_turn)
            yield from prefix_merge(turns, text=text, **common)


def progress_bar(path: str | Path, selection: Selection, *, quiet: bool, desc: str) -> tqdm:
    """A turn-counting bar on stderr; silent when quiet or when stderr is not a terminal."""
    disable = quiet or not sys.stderr.isatty()
    total = None if disable else count_turns(path, selection)
    return tqdm(total=total, unit="turn", desc=desc, file=sys.stderr, disable=disable, dynamic_ncols=True)


def export(
    path: str | Path,
    out: str | Path,
    *,
    strategy: str = Strategy.PREFIX_MERGE,
    fmt: str = "parquet",
    selection: Selection | None = None,
    text: TokenText | None = None,
    options: SinkOptions | None = None,
    quiet: bool = False,
    normalize: Normalize | None = None,
    reward_to: RewardTo = "all",
    tool_parse_failures: str = "keep",
) -> ReconstructStats:
    """Write every row of the store to `out`; returns what happened on the way."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; choose one of {', '.join(FORMATS)}")
    selection = selection or Selection()
    stats = ReconstructStats()
    options = options or SinkOptions()
    sink = FORMATS[fmt](out, options)
    own_rows = getattr(sink, "rows", None)
    try:
        with progress_bar(path, selection, quiet=quiet, desc="export") as bar:
            if own_rows is not None:
                rows = own_rows(path, strategy=strategy, selection=selection, stats=stats, on_turn=bar.update)
            else:
                rows = iter_trajectories(
                    path,
                    strategy=strategy,
                    selection=selection,
                    stats=stats,
                    text=text,
                    on_turn=bar.update,
                    retokenize=options.tokenizer,
                    normalize=normalize,
                    reward_to=reward_to,
                    tool_parse_failures=tool_parse_failures,
                )
            for row in rows:
                sink.write(row)
    except BaseException:
        sink.abort()
        raise
    sink.close()
    _judge_side_calls(path, stats)
    return stats


def _judge_side_calls(path: str | Path, stats: ReconstructStats) -> None:
    """Generic-recipe sessions' side-call suspects, judged once the rows are out, with a warning."""
    stats.side_call_suspects = side_call_suspects(path, stats.sessions)
    if stats.side_call_suspects:
        log.warning("%s", stats.suspects_warning())


def compute_stats(
    path: str | Path,
    *,
    selection: Selection | None = None,
    text: TokenText | None = None,
    quiet: bool = False,
) -> ReconstructStats:
    """Prefix-merge the store without writing anything, for `polar-mitm stats`."""
    selection = selection or Selection()
    stats = ReconstructStats()
    with progress_bar(path, selection, quiet=quiet, desc="stats") as bar:
        for _ in iter_trajectories(path, selection=selection, stats=stats, text=text, on_turn=bar.update):
            pass
    stats.tool_parse = tool_parse_rates(
        path, session=selection.session, task=selection.task, since=selection.since, rollout=selection.rollout
    )
    stats.side_call_suspects = side_call_suspects(path, stats.sessions)
    return stats
