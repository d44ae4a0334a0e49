"""Synchronous reading of turns, for the offline tools: `read_turns` (token ids resolved through
their references) and `turn_filter`, the selection every reader shares."""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from polar_mitm.store.connection import connect
from polar_mitm.store.packing import unpack_ids, unpack_ids_array, unpack_logprobs, unpack_logprobs_array
from polar_mitm.store.requests import COLUMNS as REQUEST_COLUMNS
from polar_mitm.store.requests import RequestReader
from polar_mitm.store.sequences import SequenceCache
from polar_mitm.store.turn import Turn

# A token sequence as read: a list of ints, or with `read_turns(arrays=True)` a read-only numpy
# array; both slice, measure and join alike (`_join`), and Turn keeps either as it is given.
Ids = Any


def turn_filter(
    *,
    session: str | None = None,
    task: str | None = None,
    since: float | None = None,
    tokens: bool | None = True,
    rollout: str | None = None,
) -> tuple[list[str], list[object]]:
    """SQL conditions and their arguments over `turns t JOIN sessions s`, for every reader.

    tokens: True keeps turns with token ids (policy turns), False only text turns (harvested),
    None both.
    """
    where: list[str] = []
    args: list[object] = []
    if session:
        where.append("t.session_id = ?")
        args.append(session)
    if task:
        where.append("s.task_id = ?")
        args.append(task)
    if since is not None:
        where.append("t.created_at >= ?")
        args.append(since)
    if rollout:
        where.append(
            "t.session_id IN (SELECT sa.session_id FROM samples sa JOIN rollout_groups g"
            " ON g.id = sa.group_id WHERE g.rollout_id = ?)"
        )
        args.append(rollout)
    if tokens is True:
        where.append("(t.output_len > 0 OR t.prompt_len > 0)")
    elif tokens is False:
        where.append("t.prompt_len = 0 AND t.output_len = 0")
    return where, args


def read_turns(
    path: str | Path,
    *,
    session: str | None = None,
    task: str | None = None,
    since: float | None = None,
    with_raw: bool = False,
    include_text_only: bool = False,
    rollout: str | None = None,
    arrays: bool = False,
) -> Iterator[Turn]:
    """Turns in creation order, with prompt ids resolved through their references.

    Resolution keeps the full sequences of recent turns in a bounded cache, so it costs about
    one pass over the unique tokens. With `arrays`, `prompt_ids` and `output_ids` are read-only
    int32 numpy arrays and `output_logprobs` a read-only float32 (or, as stored, float64) array
    instead of lists: the same values without a Python object per token, for the exporters.
    """
    db = connect(path)
    cache = SequenceCache()
    ids_of: Callable[[bytes | None], Ids] = unpack_ids_array if arrays else unpack_ids
    logprobs_of: Callable[[bytes | None], Ids] = unpack_logprobs_array if arrays else unpack_logprobs
    where, args = turn_filter(
        session=session, task=task, since=since, tokens=None if include_text_only else True, rollout=rollout
    )
    requests = RequestReader(db)
    try:
        for row in db.execute(_turns_sql(where, with_raw), args):
            tid, ref, ref_len, suffix, out = row[0], row[9], row[10], row[11], row[12]
            prompt = ids_of(suffix)
            if ref:
                base = cache.get(ref)
                if base is None:
                    base = (_resolve_sync(db, ref, cache, arrays=arrays), 0)
                prompt = _join(base[0][:ref_len], prompt)
            output = ids_of(out)
            cache.put(tid, _join(prompt, output), len(prompt))
            yield _turn(row, prompt, output, logprobs_of(row[13]), requests if with_raw else None)
    finally:
        db.close()


def _turns_sql(where: list[str], with_raw: bool) -> str:
    """`read_turns`' query: a turn's columns and its session's task (then, `with_raw`, its stored
    response, headers and request columns), oldest first."""
    raw_cols = (
        ", t.response, t.request_headers, t.headers_ref, "
        + ", ".join(f"t.{c.strip()}" for c in REQUEST_COLUMNS.split(","))
        if with_raw
        else ""
    )
    return (
        "SELECT t.id, t.session_id, t.seq, t.created_at, t.style, t.model, t.tag, t.status, t.finish_reason,"
        " t.prompt_ref, t.prompt_ref_len, t.prompt_suffix, t.output_ids, t.output_logprobs, t.weight_version,"
        f" t.logprobs_mode, t.tool_parse, s.task_id{raw_cols} FROM turns t JOIN sessions s ON s.id = t.session_id"
        + (" WHERE " + " AND ".join(where) if where else "")
        + " ORDER BY t.seq"
    )


def _turn(
    row: Sequence[Any], prompt: Ids, output: Ids, logprobs: Ids, requests: RequestReader | None
) -> Turn:
    """A row of `_turns_sql` as a `Turn`, its token ids resolved; `requests` reads its raw request
    and headers (None: without them)."""
    (tid, sid, seq, created, style, model, tag, status, finish, ref, ref_len) = row[:11]
    wv, lp_mode, tool_parse, task_id = row[14:18]
    # Values come straight from our own schema: skip validation, it dominated export time.
    return Turn.model_construct(
        id=tid,
        session_id=sid,
        seq=seq,
        created_at=created,
        style=style,
        model=model,
        tag=tag,
        status=status,
        finish_reason=finish,
        prompt_ids=prompt,
        output_ids=output,
        output_logprobs=logprobs,
        prompt_ref=ref,
        prompt_ref_len=ref_len,
        weight_version=wv,
        logprobs_mode=lp_mode,
        tool_parse=tool_parse,
        task_id=task_id,
        request=requests.text(tid, *row[21:]) if requests is not None else None,
        request_headers=requests.headers(tid, row[19], row[20]) if requests is not None else {},
        response=row[18] if requests is not None else None,
    )


def _join(head: Ids, tail: Ids) -> Ids:
    """Two token sequences as one: lists stay lists, arrays (`read_turns(arrays=True)`) arrays."""
    return head + tail if isinstance(head, list) else np.concatenate((head, tail))


def _resolve_sync(db: sqlite3.Connection, turn_id: str, cache: SequenceCache, *, arrays: bool = False) -> Ids:
    row = db.execute(
        "SELECT prompt_ref, prompt_ref_len, prompt_suffix, output_ids FROM turns WHERE id = ?", (turn_id,)
    ).fetchone()
    if row is None:
        raise KeyError(f"turn {turn_id} referenced but missing")
    ref, ref_len, suffix, out = row
    ids_of: Callable[[bytes | None], Ids] = unpack_ids_array if arrays else unpack_ids
    prompt = ids_of(suffix)
    if ref:
        base = cache.get(ref)
        prompt = _join((base[0] if base else _resolve_sync(db, ref, cache, arrays=arrays))[:ref_len], prompt)
    seq = _join(prompt, ids_of(out))
    cache.put(turn_id, seq, len(prompt))
    return seq
