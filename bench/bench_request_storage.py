"""Stored bytes per turn of a Claude Code session: synthetic sessions, or a captured real one.

Each session is a linear tool-calling loop of `--turns` turns in Claude Code's request shape
(messages first, then a ~`--system`-token system prompt and tools; the newest user message carries
the cache marker, so an earlier message changes every turn), growing to about `--context` tokens,
with a title side call after turn 2 and, with `--compact-at`, a compaction (a new, short
conversation behind the same system prompt). Prompt ids are stored as the proxy stores a splice
(a word of the synthetic text counts as a token), 300 sampled tokens a turn. The same sessions are written
three times in one run: every request whole (as before m005), as what changed from an earlier
request (m005), and that compressed with the session's zstd dictionary with headers as what
changed (m006, the default).

Prints bytes per turn of the SQLite file and of the stored request text, the insert time per
turn, and the storage goal of issue 10: a session ≤ 2 × (zstd size of its last request + 4 B per
unique token + 8 B per sampled token).

`--replay FILE` instead feeds a captured real session (`bench/capture_session.py`; the committed
one is bench/fixtures/claude_code_session.jsonl.zst: Claude Code, 17 turns of Bash and Read)
through the store writer, turn by turn as the proxy wrote it, before (m005) and after (m006) in
one run, and prints the turns' own pages (the `turns` table and its indexes, from SQLite's dbstat)
per turn against issue 21's minimum: zstd of the last request + 4 B per unique (stored) prompt
token + 8 B per sampled token. Every request and its headers are read back and compared.

    .venv/bin/python bench/bench_request_storage.py [--sessions 8] [--turns 50] [--context 32000]
    .venv/bin/python bench/bench_request_storage.py --replay bench/fixtures/claude_code_session.jsonl.zst
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sqlite3
import sys
import tempfile
import time
from pathlib import Path

import pyarrow as pa

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from polar_mitm.store import requests as stored_requests  # noqa: E402
from polar_mitm.store.reader import read_turns  # noqa: E402
from polar_mitm.store.requests import COLUMNS, RequestReader, zstd  # noqa: E402
from polar_mitm.store.turn import Turn  # noqa: E402
from polar_mitm.store.writer import Store  # noqa: E402

WORDS = (
    "the proxy records every token of the file while tests run parser import error line def return".split()
)
REPLY = 300


def text(rng: random.Random, tokens: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(tokens))


def request(messages: list[dict], system: str, tools: list[dict]) -> str:
    msgs = list(messages)
    last = msgs[-1]
    msgs[-1] = {
        **last,
        "content": [*last["content"][:-1], {**last["content"][-1], "cache_control": {"type": "ephemeral"}}],
    }
    body = {
        "model": "claude-sonnet-4-5-20250929",
        "messages": msgs,
        "system": [{"type": "text", "text": system, "cache_control": {"type": "ephemeral"}}],
        "tools": tools,
        "metadata": {"user_id": "user_0123456789abcdef_account__session_42"},
        "max_tokens": 32000,
        "stream": True,
    }
    return json.dumps(body)


def session(
    rng: random.Random, turns: int, context: int, system_tokens: int, compact_at: int
) -> list[tuple[str | None, str, int]]:
    """(tag, request, new prompt tokens) of each call of one session, in order."""
    system = text(rng, system_tokens)
    tools = [
        {
            "name": f"Tool{i}",
            "description": text(rng, 60),
            "input_schema": {"type": "object", "properties": {"x": {"type": "string"}}},
        }
        for i in range(16)
    ]
    per_turn = max(1, (context - system_tokens - turns * REPLY) // max(1, turns - 1))
    calls: list[tuple[str | None, str, int]] = []
    messages = [{"role": "user", "content": [{"type": "text", "text": text(rng, 50)}]}]
    new = system_tokens + 50
    for turn in range(turns):
        if turn == compact_at:
            messages = [
                {"role": "user", "content": [{"type": "text", "text": "Summary: " + text(rng, 2000)}]}
            ]
            new = 2000
        calls.append((None, request(messages, system, tools), new))
        if turn == 2:
            title = [
                {"role": "user", "content": [{"type": "text", "text": "Write a title for: " + text(rng, 40)}]}
            ]
            calls.append(
                ("title", request(title, "Summarize this coding conversation in a few words.", []), 60)
            )
        messages = messages + [
            {
                "role": "assistant",
                "content": [
                    {"type": "text", "text": text(rng, REPLY - 20)},
                    {
                        "type": "tool_use",
                        "id": f"toolu_{turn:04d}",
                        "name": "Read",
                        "input": {"x": text(rng, 5)},
                    },
                ],
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": f"toolu_{turn:04d}",
                        "content": text(rng, per_turn),
                    }
                ],
            },
        ]
        new = per_turn + REPLY
    return calls


async def write(
    path: Path, sessions: list[list[tuple[str | None, str, int]]], memo: int, compress: bool
) -> tuple[float, int]:
    store = await Store.open(path, request_memo_chars=memo, compress=compress)
    rng = random.Random(1)
    last: dict[int, tuple[str, int]] = {}
    inserts = 0
    spent = 0.0
    try:
        for i in range(max(len(s) for s in sessions)):
            for s, calls in enumerate(sessions):  # interleaved, as a shared proxy writes them
                if i >= len(calls):
                    continue
                tag, req, new = calls[i]
                ref, ref_len = last.get(s, (None, 0)) if tag is None else (None, 0)
                prompt = [rng.randrange(150_000) for _ in range(ref_len + new)]
                tid = f"s{s}-{i:03d}"
                rec = Turn(
                    id=tid,
                    session_id=f"s{s}",
                    style="anthropic",
                    tag=tag,
                    path="/v1/messages?beta=true",
                    request=req,
                    prompt_ids=prompt,
                    prompt_ref=ref,
                    prompt_ref_len=ref_len,
                    output_ids=[rng.randrange(150_000) for _ in range(REPLY)],
                    output_logprobs=[-0.5] * REPLY,
                    response=json.dumps({"content": text(rng, REPLY - 20)}),
                )
                t0 = time.perf_counter()
                await store.insert_turn(rec)
                spent += time.perf_counter() - t0
                inserts += 1
                if tag is None:
                    last[s] = (tid, len(prompt) + REPLY)
    finally:
        await store.close()
    return spent / inserts, inserts


def sizes(path: Path) -> tuple[int, int]:
    db = sqlite3.connect(path)
    db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    stored = db.execute(
        "SELECT SUM(COALESCE(LENGTH(CAST(request AS BLOB)), 0) + COALESCE(LENGTH(CAST(request_delta AS BLOB)), 0)) FROM turns"
    ).fetchone()[0]
    db.close()
    return sum(p.stat().st_size for p in path.parent.glob(path.name + "*")), stored


def read_back(path: Path, expected: dict[str, str]) -> float:
    db = sqlite3.connect(path)
    reader = RequestReader(db)
    t0 = time.perf_counter()
    rows = db.execute(f"SELECT id, {COLUMNS} FROM turns ORDER BY seq")
    for tid, *rest in rows:
        assert reader.text(tid, *rest) == expected[tid], f"{tid} did not come back whole"
    db.close()
    return time.perf_counter() - t0


# What m006 adds to a turn, timed where the writer calls it: compressing the stored text (in the
# store's thread, before the commit), the session's dictionary (built once, digested between
# turns), the headers' diff (on the loop).
ADDED: dict[str, list[float]] = {"compress": [], "dictionary": [], "warm": [], "headers_diff": []}


def instrument() -> None:
    for name in ADDED:
        fn = getattr(stored_requests, name)

        def wrapper(*a, _fn=fn, _name=name, **kw):
            t0 = time.perf_counter()
            try:
                return _fn(*a, **kw)
            finally:
                ADDED[_name].append(time.perf_counter() - t0)

        setattr(stored_requests, name, wrapper)


def own_work(turns: int) -> str:
    z = sorted(ADDED["compress"]) or [0.0]
    per_turn = {k: sum(v) / max(turns, 1) * 1e3 for k, v in ADDED.items()}
    for v in ADDED.values():
        v.clear()
    return (
        f"m006's own work a turn: zstd median {z[len(z) // 2] * 1e3:.3f} ms, max {z[-1] * 1e3:.3f} ms,"
        f" mean {per_turn['compress']:.3f} ms (in the store's thread, before the commit); the session's"
        f" dictionary {per_turn['dictionary'] + per_turn['warm']:.3f} ms a turn (built once, digested"
        f" between turns); headers diff {per_turn['headers_diff']:.3f} ms (on the loop)"
    )


def load_session(path: Path) -> list[dict]:
    """The captured turns (`bench/capture_session.py`), in the order they were stored."""
    return [json.loads(line) for line in zstd.decompress(path.read_bytes()).decode().splitlines() if line]


async def replay_write(path: Path, turns: list[dict], compress: bool) -> list[float]:
    """Each captured turn through `Store.insert_turn`, its prompt rebuilt from its reference as
    the proxy held it; the seconds each insert took."""
    store = await Store.open(path, compress=compress)
    spent = []
    try:
        await store.ensure_session(turns[0]["session_id"], harness="claude-code")
        for t in turns:
            fields = {k: v for k, v in t.items() if k not in ("prompt_suffix", "prompt_len")}
            base = (
                (await store.sequence(t["prompt_ref"]))[0][: t["prompt_ref_len"]] if t["prompt_ref"] else []
            )
            rec = Turn(**fields, prompt_ids=base + t["prompt_suffix"])
            t0 = time.perf_counter()
            await store.insert_turn(rec)
            spent.append(time.perf_counter() - t0)
    finally:
        await store.close()
    return spent


def turn_pages(path: Path) -> tuple[int, int]:
    """Bytes of the pages of `turns` and of its indexes (SQLite's dbstat, after a checkpoint)."""
    db = sqlite3.connect(path)
    db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    table = db.execute("SELECT SUM(pgsize) FROM dbstat WHERE name = 'turns'").fetchone()[0]
    indexes = db.execute(
        "SELECT SUM(pgsize) FROM dbstat WHERE name IN"
        " (SELECT name FROM sqlite_master WHERE type = 'index' AND tbl_name = 'turns')"
    ).fetchone()[0]
    db.close()
    return table, indexes


def replay(file: Path, reps: int) -> None:
    turns = load_session(file)
    n = len(turns)
    last = max(turns, key=lambda t: t["prompt_len"])["request"].encode()
    unique = sum(len(t["prompt_suffix"]) for t in turns)
    sampled = sum(len(t["output_ids"]) for t in turns)
    zstd_last = len(pa.compress(last, codec="zstd", asbytes=True))
    minimum = zstd_last + 4 * unique + 8 * sampled
    print(
        f"{file.name}: {n} turns ({sum(t['tag'] is None for t in turns)} main), longest request"
        f" {len(last):,} B at {max(t['prompt_len'] for t in turns):,} prompt tokens"
    )
    print(
        f"minimum: zstd of the last request {zstd_last:,} B + 4 B × {unique:,} unique prompt tokens"
        f" + 8 B × {sampled:,} sampled = {minimum:,} B ({minimum / n:,.0f} B/turn)"
    )
    instrument()
    with tempfile.TemporaryDirectory(prefix="polar-bench-") as tmp:
        times: dict[str, list[float]] = {}
        paths = {}
        for rep in range(reps):  # the two modes alternate, so load on the machine hits both alike
            for name, compress in (("before (m005)", False), ("after (m006)", True)):
                path = Path(tmp) / f"{rep}-{compress}.sqlite"
                times.setdefault(name, []).extend(asyncio.run(replay_write(path, turns, compress)))
                paths[name] = path
        for name, path in paths.items():
            table, indexes = turn_pages(path)
            got = {t.id: t for t in read_turns(path, with_raw=True, include_text_only=True)}
            for t in turns:
                assert got[t["id"]].request == t["request"], f"{t['id']}: request differs"
                assert got[t["id"]].request_headers == t["request_headers"], f"{t['id']}: headers differ"
                assert list(got[t["id"]].request_headers) == list(t["request_headers"])
            spent = sorted(times[name])
            print(
                f"{name:<14} turns' pages {table + indexes:>9,} B ({(table + indexes) / n:>7,.0f} B/turn;"
                f" table {table:,}, indexes {indexes:,}) = {(table + indexes) / minimum:4.2f}× minimum;"
                f" insert median {spent[len(spent) // 2] * 1e3:5.2f} ms/turn, mean"
                f" {sum(spent) / len(spent) * 1e3:5.2f} ms; read back identical"
            )
    print(own_work(reps * n))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--replay", type=Path, default=None, help="a captured session (.jsonl.zst) to replay")
    ap.add_argument(
        "--reps", type=int, default=5, help="replays of each mode, for the insert times (default 5)"
    )
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument("--turns", type=int, default=50)
    ap.add_argument("--context", type=int, default=32_000, help="tokens by the last turn (default 32000)")
    ap.add_argument("--system", type=int, default=12_000, help="system prompt + tools tokens (default 12000)")
    ap.add_argument("--compact-at", type=int, default=-1, help="turn of a compaction (default none)")
    args = ap.parse_args()
    if args.replay is not None:
        replay(args.replay, args.reps)
        return

    rng = random.Random(0)
    sessions = [
        session(rng, args.turns, args.context, args.system, args.compact_at) for _ in range(args.sessions)
    ]
    expected = {
        f"s{s}-{i:03d}": req for s, calls in enumerate(sessions) for i, (_, req, _) in enumerate(calls)
    }
    calls = sum(len(c) for c in sessions)
    last = sessions[0][-1][1].encode()
    unique = sum(new for _, _, new in sessions[0])
    zstd_last = len(pa.compress(last, codec="zstd", asbytes=True))
    target = 2 * (zstd_last + 4 * unique + 8 * REPLY * args.turns)
    print(
        f"{args.sessions} sessions × {args.turns} turns (+1 title call), last request {len(last):,} B"
        f" (zstd {zstd_last:,} B), {unique:,} unique prompt tokens a session"
    )
    print(f"goal: a session ≤ 2 × (zstd of last request + 4 B × unique + 8 B × sampled) = {target:,} B")
    instrument()
    with tempfile.TemporaryDirectory(prefix="polar-bench-") as tmp:
        modes = (
            ("whole", 0, False),
            ("what changed", 32_000_000, False),
            ("+ zstd (m006)", 32_000_000, True),
        )
        for name, memo, compress in modes:
            path = Path(tmp) / f"{name[:4]}.sqlite"
            per_insert, n = asyncio.run(write(path, sessions, memo, compress))
            file_bytes, request_bytes = sizes(path)
            secs = read_back(path, expected)
            print(
                f"{name:<16} file {file_bytes / args.sessions:>11,.0f} B/session"
                f" ({file_bytes / calls:>9,.0f} B/turn, {file_bytes / args.sessions / target:4.2f}× goal)"
                f"  request text {request_bytes / calls:>9,.0f} B/turn"
                f"  insert {per_insert * 1e3:5.2f} ms/turn  read back {secs / n * 1e6:6.1f} µs/turn, byte-identical"
            )
            if compress:
                print("  " + own_work(n))


if __name__ == "__main__":
    main()
