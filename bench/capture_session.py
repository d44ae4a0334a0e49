"""Capture a real Claude Code session for `bench_request_storage.py --replay`.

Runs the real `claude` CLI through `polar-mitm run` against the fake backend with a script that
makes it call its tools many times (Bash and Read, ~17 main turns, each tool output a few kB of
this repository's source, so the context grows as a real coding session's does), then exports
every stored turn as one JSON line — its raw request and headers (as the store holds them,
credentials removed), response, prompt reference + new suffix ids, sampled ids and logprobs —
zstd-compressed. The replay feeds these lines through the store writer exactly as the proxy did.

    .venv/bin/python bench/capture_session.py [--out bench/fixtures/claude_code_session.jsonl.zst]

Needs the `claude` CLI (scripts/install.sh) and the Qwen tokenizer (the test extra).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sqlite3
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from polar_mitm import recipes  # noqa: E402
from polar_mitm.backends.tokenizer_build import ensure_tokenizer  # noqa: E402
from polar_mitm.store.connection import connect  # noqa: E402
from polar_mitm.store.packing import unpack_ids, unpack_logprobs  # noqa: E402
from polar_mitm.store.requests import RequestReader, zstd  # noqa: E402
from tests.support.harness import FakeBackend, harness_env, polar_run  # noqa: E402

DEFAULT_OUT = ROOT / "bench" / "fixtures" / "claude_code_session.jsonl.zst"
# Source files the tool calls read (Read) or print (Bash), in this order: real code, a few kB each.
SOURCES = [
    "polar_mitm/store/deltas.py",
    "polar_mitm/store/packing.py",
    "polar_mitm/sse.py",
    "polar_mitm/redact.py",
    "polar_mitm/store/migrations.py",
    "polar_mitm/outcomes.py",
    "polar_mitm/store/rollouts.py",
    "polar_mitm/neutral.py",
]
STEPS = 16


def script(work: Path) -> list[dict]:
    """Rules that walk Claude Code through STEPS tool calls: each tool output carries the marker
    of the next step (the fake reads the last message), alternating Bash and Read."""
    rules: list[dict] = []
    for i in range(STEPS):
        nxt = f"MARK{i + 1:02d}"
        src = work / f"src{i:02d}.py"
        if i % 3 == 1:
            rules.append(
                {
                    "match": f"MARK{i:02d}\\b",
                    "tool_call": {"name": "Read", "arguments": {"file_path": str(src)}},
                }
            )
        elif i % 3 == 2:
            rules.append(
                {"match": f"MARK{i:02d}\\b", "shell": f"grep -n 'def \\|class ' {src.name}; echo {nxt}"}
            )
        else:
            rules.append({"match": f"MARK{i:02d}\\b", "shell": f"cat {src.name}; echo {nxt}"})
    rules.append({"match": f"MARK{STEPS:02d}\\b", "text": "Done. I read the files; nothing else to do."})
    rules.append({"match": "", "text": "Hello."})
    return rules


def export(db_path: Path, out: Path) -> int:
    """Every turn as the store holds it, one JSON line each, in insert order; returns the count."""
    db = connect(db_path)
    reader = RequestReader(db)
    lines = []
    for row in db.execute(
        "SELECT id, session_id, created_at, style, host, path, model, tag, status, finish_reason,"
        " prompt_ref, prompt_ref_len, prompt_suffix, prompt_len, output_ids, output_logprobs,"
        " weight_version, msg_hash, post_hash, request_headers, response, error, latency_ms"
        " FROM turns ORDER BY seq"
    ):
        (tid, sid, created, style, host, path, model, tag, status, finish, ref, ref_len, suffix, plen) = row[
            :14
        ]
        out_ids, lps, wv, mh, ph, headers, response, error, latency = row[14:]
        lines.append(
            json.dumps(
                {
                    "id": tid,
                    "session_id": sid,
                    "created_at": created,
                    "style": style,
                    "host": host,
                    "path": path,
                    "model": model,
                    "tag": tag,
                    "status": status,
                    "finish_reason": finish,
                    "prompt_ref": ref,
                    "prompt_ref_len": ref_len,
                    "prompt_suffix": unpack_ids(suffix),
                    "prompt_len": plen,
                    "output_ids": unpack_ids(out_ids),
                    "output_logprobs": unpack_logprobs(lps),
                    "weight_version": wv,
                    "msg_hash": mh,
                    "post_hash": ph,
                    "request": reader.request(tid),
                    "request_headers": reader.headers(tid),
                    "response": response,
                    "error": error,
                    "latency_ms": latency,
                }
            )
        )
    db.close()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(zstd.compress("\n".join(lines).encode() + b"\n", level=19))
    return len(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--keep-db", type=Path, default=None, help="also keep the captured store here")
    ap.add_argument("--from-db", type=Path, default=None, help="export this store instead of capturing")
    args = ap.parse_args()
    if args.from_db is not None:
        print(f"{export(args.from_db, args.out)} turns -> {args.out} ({args.out.stat().st_size:,} B)")
        return
    tokenizer = ensure_tokenizer("qwen")
    with tempfile.TemporaryDirectory(prefix="polar-capture-") as tmp:
        tmp_path = Path(tmp)
        work = tmp_path / "work"
        work.mkdir()
        for i in range(STEPS):
            text = (ROOT / SOURCES[i % len(SOURCES)]).read_text()
            (work / f"src{i:02d}.py").write_text(f"# MARK{i + 1:02d}\n{text}")
        rules = tmp_path / "rules.json"
        rules.write_text(json.dumps(script(work)))
        backend = FakeBackend(tokenizer, "--script", str(rules))
        db = tmp_path / "runs.sqlite"
        try:
            cmd = recipes.get("claude-code").headless_command("Read the files here, step by step. MARK00")
            r = polar_run(
                ["--backend", backend.url, "--tokenizer", str(tokenizer), "--db", str(db)]
                + ["--session", "claude-code-capture"],
                cmd,
                cwd=work,
                env=harness_env(tmp_path / "home"),
                timeout=600,
            )
        finally:
            backend.stop()
        if r.returncode != 0:
            raise SystemExit(f"claude exited {r.returncode}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
        con = sqlite3.connect(db)
        main_turns = con.execute("SELECT COUNT(*) FROM turns WHERE tag IS NULL").fetchone()[0]
        con.close()
        if args.keep_db is not None:
            shutil.copy(db, args.keep_db)
        n = export(db, args.out)
        shutil.rmtree(work, ignore_errors=True)
    print(f"{n} turns ({main_turns} main) -> {args.out} ({args.out.stat().st_size:,} B)")


if __name__ == "__main__":
    main()
