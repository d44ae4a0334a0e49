"""Export throughput and on-disk size on synthetic agent sessions.

Each session is a linear agent loop of `--turns` turns whose context grows to about `--context`
tokens: a system prompt, then per turn some appended prompt tokens (tool results) and a sampled
reply, every prompt stored the way the proxy stores a splice (a reference to the previous turn
plus the new suffix). Sessions are written round-robin through `Store`, as a shared proxy would
interleave them. Then both strategies are exported to parquet.

Prints export throughput in tokens/s (tokens of the per-request view read from the store, and
tokens of the rows written) and bytes per session of the SQLite store and of each parquet file,
as ratios to the minimum: unique prompt tokens × 4 B + sampled tokens × 8 B (id + logprob).

    .venv/bin/python bench/bench_export.py               # 32 sessions, about 20 s on 2 cores
    .venv/bin/python bench/bench_export.py --sessions 32 --keep /tmp/bench
"""

from __future__ import annotations

import argparse
import asyncio
import sqlite3
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from polar_mitm.reconstruct.export import export  # noqa: E402
from polar_mitm.store.turn import Turn  # noqa: E402
from polar_mitm.store.writer import Store  # noqa: E402

VOCAB = 151_000


@dataclass
class Shape:
    turns: int
    context: int
    system: int = 2_000
    reply: int = 300

    @property
    def appended(self) -> int:
        """Prompt tokens appended per turn after the first, so the last context is ~`context`."""
        return max(1, (self.context - self.system - self.turns * self.reply) // max(1, self.turns - 1))


async def write_store(path: Path, sessions: int, shape: Shape, seed: int) -> dict[str, int]:
    rng = np.random.default_rng(seed)
    store = await Store.open(path)
    seqs: dict[str, list[int]] = {}
    last: dict[str, str] = {}
    totals = {"per_request": 0, "sampled": 0, "unique_prompt": 0, "turns": 0}
    try:
        for s in range(sessions):
            await store.ensure_session(f"s{s}", task_id=f"task-{s % 4}")
        for turn in range(shape.turns):
            for s in range(sessions):
                sid = f"s{s}"
                prev = seqs.get(sid, [])
                new = shape.system + shape.appended if turn == 0 else shape.appended
                prompt = prev + rng.integers(0, VOCAB, new).tolist()
                output = rng.integers(0, VOCAB, shape.reply).tolist()
                logprobs = (-rng.exponential(0.5, shape.reply)).astype(np.float32).tolist()
                tid = f"{sid}-t{turn}"
                await store.insert_turn(
                    Turn(
                        id=tid,
                        session_id=sid,
                        style="anthropic",
                        finish_reason="stop",
                        prompt_ids=prompt,
                        prompt_ref=last.get(sid),
                        prompt_ref_len=len(prev),
                        output_ids=output,
                        output_logprobs=logprobs,
                        weight_version="w0",
                    )
                )
                seqs[sid], last[sid] = prompt + output, tid
                totals["per_request"] += len(prompt) + len(output)
                totals["sampled"] += len(output)
                totals["unique_prompt"] += new
                totals["turns"] += 1
    finally:
        await store.close()
    return totals


def store_bytes(path: Path) -> int:
    db = sqlite3.connect(path)
    db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    db.close()
    return sum(p.stat().st_size for p in path.parent.glob(path.name + "*"))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sessions", type=int, default=32, help="synthetic sessions (default 32)")
    parser.add_argument("--turns", type=int, default=50, help="turns per session (default 50)")
    parser.add_argument("--context", type=int, default=65_536, help="final context length (default 65536)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--keep", type=Path, help="write into this directory and keep the files")
    args = parser.parse_args()

    shape = Shape(turns=args.turns, context=args.context)
    tmp = None if args.keep else tempfile.TemporaryDirectory(prefix="polar-bench-")
    work = args.keep or Path(tmp.name)  # type: ignore[union-attr]
    work.mkdir(parents=True, exist_ok=True)
    db = work / "bench.sqlite"
    for p in work.glob("bench.sqlite*"):
        p.unlink()

    t0 = time.perf_counter()
    totals = asyncio.run(write_store(db, args.sessions, shape, args.seed))
    write_s = time.perf_counter() - t0
    n = args.sessions
    minimum = totals["unique_prompt"] * 4 + totals["sampled"] * 8
    print(
        f"{n} sessions × {args.turns} turns, context {shape.system}+{shape.appended}/turn+{shape.reply} sampled "
        f"→ {(totals['unique_prompt'] + totals['sampled']) // n:,} tokens per session"
    )
    print(
        f"write through Store: {write_s:.1f} s ({totals['turns'] / write_s:.0f} turns/s, "
        f"{totals['per_request'] / write_s / 1e6:.1f} M per-request tokens/s)"
    )
    print(f"minimum bytes/session (unique prompt × 4 B + sampled × 8 B): {minimum / n:,.0f}")
    sqlite_bytes = store_bytes(db)
    print(
        f"{'sqlite store':<24} {sqlite_bytes / n:>14,.0f} B/session  {sqlite_bytes / minimum:5.2f}× minimum"
    )

    for strategy in ("per-request", "prefix-merge"):
        out = work / f"{strategy}.parquet"
        t0 = time.perf_counter()
        stats = export(db, out, strategy=strategy, quiet=True)
        secs = time.perf_counter() - t0
        size = out.stat().st_size
        rows = pq.ParquetFile(out).metadata.num_rows
        print(
            f"{'parquet ' + strategy:<24} {size / n:>14,.0f} B/session  {size / minimum:5.2f}× minimum   "
            f"export {secs:5.1f} s: {stats.per_request_tokens / secs / 1e6:6.1f} M tokens/s read, "
            f"{stats.merged_tokens / secs / 1e6:6.1f} M tokens/s written, {rows} rows"
        )
        if strategy == "prefix-merge":
            assert rows == n and stats.trainer_token_ratio, "every synthetic session is one chain"
            print(
                f"{'':<24} merge ratio {stats.merge_ratio:.1f}, trainer-token ratio {stats.trainer_token_ratio:.1f}"
            )
    structure_cost(db, work)
    if tmp is not None:
        tmp.cleanup()


def structure_cost(db: Path, work: Path) -> None:
    """Export time with the structure pass (roles and parents, `structure.link`) ÷ without it, in
    this run: without it, every turn is linked `main` at once. Per-request rows need the session's
    prefix tree for it; prefix-merge builds that tree anyway."""
    import importlib

    from polar_mitm.reconstruct import structure

    # The modules, not the functions of the same names the package exports.
    per_request = importlib.import_module("polar_mitm.reconstruct.per_request")
    prefix_merge = importlib.import_module("polar_mitm.reconstruct.prefix_merge")

    main_link = structure.Link("main")

    def all_main(turns, **_):  # type: ignore[no-untyped-def]
        return {t.id: main_link for t in turns}

    def merger_all_main(self, stats=None):  # type: ignore[no-untyped-def]
        return dict.fromkeys(self.by_turn, main_link)

    for strategy in ("per-request", "prefix-merge"):
        out = work / f"structure-{strategy}.parquet"
        times = {}
        for label in ("without", "with", "without ", "with "):  # interleaved, twice each
            saved = (per_request.turn_links, prefix_merge.SessionMerger.turn_links)
            if label.strip() == "without":
                per_request.turn_links = all_main  # type: ignore[assignment]
                prefix_merge.SessionMerger.turn_links = merger_all_main  # type: ignore[method-assign]
            try:
                t0 = time.perf_counter()
                export(db, out, strategy=strategy, quiet=True)
                times.setdefault(label.strip(), []).append(time.perf_counter() - t0)
            finally:
                per_request.turn_links, prefix_merge.SessionMerger.turn_links = saved  # type: ignore[method-assign]
        with_s, without_s = min(times["with"]), min(times["without"])
        print(
            f"{'structure pass ' + strategy:<24} export {with_s:5.1f} s with, {without_s:5.1f} s without: "
            f"{with_s / without_s:.2f}×"
        )


if __name__ == "__main__":
    main()
