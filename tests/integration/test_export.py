"""Exports from a real store: parquet readable by pyarrow / polars / datasets, JSON lines, stats,
rewards, filters and the click commands."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from datetime import datetime
from pathlib import Path

import click
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from polar_mitm.cli.data import COMMANDS
from polar_mitm.reconstruct import export as export_mod
from polar_mitm.reconstruct.export import ParquetSink, SinkOptions, export, iter_trajectories
from polar_mitm.reconstruct.source import Selection
from polar_mitm.reconstruct.trajectory import TRAJECTORY_SCHEMA
from polar_mitm.store.turn import Turn
from polar_mitm.store.writer import Store

A, B, C, D = -0.5, -0.25, -1.0, -0.125

# (session, id, prompt, output, logprobs, extra Turn fields), in creation order.
TURNS = [
    ("s1", "a1", [1, 2, 3], [10, 11], [A, B], {}),
    ("s2", "b1", [7, 8], [20], [C], {}),
    (
        "s1",
        "a-title",
        [1, 2, 3, 10, 11, 50],
        [51],
        [D],
        {"tag": "title", "prompt_ref": "a1", "prompt_ref_len": 5},
    ),
    ("s1", "a2", [1, 2, 3, 10, 11, 4], [12], [C], {"prompt_ref": "a1", "prompt_ref_len": 5}),
    ("s2", "b2", [7, 8, 20, 9], [21], [A], {"prompt_ref": "b1", "prompt_ref_len": 3}),
    (
        "s1",
        "a-abort",
        [1, 2, 3, 10, 11, 4, 12, 5],
        [13],
        [D],
        {"status": "aborted", "finish_reason": None, "prompt_ref": "a2", "prompt_ref_len": 7},
    ),
    ("s1", "a3", [1, 2, 3, 10, 11, 4, 12, 5], [14, 15], [B, D], {"prompt_ref": "a2", "prompt_ref_len": 7}),
]
SESSION_T0 = {"s1": 1000.0, "s2": 2000.0}


async def _fill(path: Path) -> None:
    store = await Store.open(path)
    try:
        await store.ensure_session("s1", task_id="task-a")
        await store.ensure_session("s2", task_id="task-b")
        for i, (session, tid, prompt, output, logprobs, extra) in enumerate(TURNS):
            fields = {"finish_reason": "stop", "weight_version": "w7", "model": "policy", **extra}
            await store.insert_turn(
                Turn(
                    id=tid,
                    session_id=session,
                    created_at=SESSION_T0[session] + i,
                    style="anthropic",
                    prompt_ids=prompt,
                    output_ids=output,
                    output_logprobs=logprobs,
                    **fields,
                )
            )
    finally:
        await store.close()


@pytest.fixture
def db(tmp_path: Path) -> Path:
    path = tmp_path / "runs.sqlite"
    asyncio.run(_fill(path))
    return path


@pytest.fixture
def cli() -> click.Group:
    return click.Group("polar-mitm", commands={c.name: c for c in COMMANDS})


def invoke(cli: click.Group, *args: str, env: dict[str, str] | None = None):
    return CliRunner().invoke(cli, list(args), env=env, catch_exceptions=False)


# --- parquet ------------------------------------------------------------------------------------


def test_parquet_schema_and_rows_are_exact(db: Path, tmp_path: Path) -> None:
    out = tmp_path / "traj.parquet"
    stats = export(db, out)
    table = pq.read_table(out)
    assert table.schema.names == TRAJECTORY_SCHEMA.names
    for field in TRAJECTORY_SCHEMA:
        assert table.schema.field(field.name).type == field.type, field.name
    assert table.schema.field("loss_mask").type == pa.list_(pa.int8())
    assert table.schema.field("response_logprobs").type == pa.list_(pa.float32())
    rows = table.to_pylist()
    assert [r["trajectory_id"] for r in rows] == ["a3", "b2"]
    a3 = rows[0]
    assert a3["session_id"] == "s1" and a3["task_id"] == "task-a"
    assert a3["prompt_ids"] == [1, 2, 3]
    assert a3["response_ids"] == [10, 11, 4, 12, 5, 14, 15]
    assert a3["loss_mask"] == [1, 1, 0, 1, 0, 1, 1]
    assert a3["response_logprobs"] == [A, B, 0.0, C, 0.0, B, D]
    assert a3["num_turns"] == 3 and a3["turn_ids"] == ["a1", "a2", "a3"]
    assert a3["finish_reason"] == "stop" and a3["reward"] is None
    meta = json.loads(a3["metadata"])
    assert meta["strategy"] == "prefix-merge" and meta["weight_versions"] == ["w7"]
    for r in rows:
        assert len(r["loss_mask"]) == len(r["response_logprobs"]) == len(r["response_ids"])
    assert stats.turns == 5 and stats.side_calls_excluded == 1 and stats.not_ok_excluded == 1


def test_parquet_loads_in_polars(db: Path, tmp_path: Path) -> None:
    import polars as pl

    out = tmp_path / "traj.parquet"
    export(db, out)
    df = pl.read_parquet(out)
    assert df.schema["prompt_ids"] == pl.List(pl.Int32)
    assert df.schema["loss_mask"] == pl.List(pl.Int8)
    assert df.schema["response_logprobs"] == pl.List(pl.Float32)
    assert df.schema["num_turns"] == pl.Int32 and df.schema["reward"] == pl.Float64
    assert df.schema["turn_ids"] == pl.List(pl.String) and df.schema["metadata"] == pl.String
    assert df["response_ids"].to_list()[1] == [20, 9, 21]


@pytest.mark.slow
def test_parquet_loads_in_hf_datasets_offline_without_our_code(db: Path, tmp_path: Path) -> None:
    out = tmp_path / "traj.parquet"
    export(db, out)
    script = f"""
import json, datasets
ds = datasets.load_dataset("parquet", data_files={str(out)!r}, split="train", cache_dir={str(tmp_path / "hf")!r})
f = ds.features
print(json.dumps({{"n": len(ds), "types": {{k: str(v) for k, v in f.items()}}, "row": ds[1]}}))
"""
    env = {
        **os.environ,
        "HF_DATASETS_OFFLINE": "1",
        "HF_HUB_OFFLINE": "1",
        "HF_HOME": str(tmp_path / "hf-home"),
        "HF_DATASETS_CACHE": str(tmp_path / "hf"),
    }
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["n"] == 2
    assert "int32" in result["types"]["prompt_ids"] and "int8" in result["types"]["loss_mask"]
    assert "float32" in result["types"]["response_logprobs"]
    row = result["row"]
    assert (
        row["prompt_ids"] == [7, 8] and row["response_ids"] == [20, 9, 21] and row["loss_mask"] == [1, 0, 1]
    )
    assert row["response_logprobs"] == [C, 0.0, A] and row["reward"] is None


def test_rows_are_written_in_row_groups(db: Path, tmp_path: Path) -> None:
    out = tmp_path / "turns.parquet"
    sink = ParquetSink(out, SinkOptions(), row_group_rows=2)
    for row in iter_trajectories(db, strategy="per-request"):
        sink.write(row)
    sink.close()
    f = pq.ParquetFile(out)
    assert f.metadata.num_rows == 5 and f.metadata.num_row_groups == 3


def test_a_failed_export_leaves_no_file(db: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args, **kwargs):
        yield from ()
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(export_mod, "iter_trajectories", broken)
    out = tmp_path / "traj.parquet"
    with pytest.raises(RuntimeError):
        export(db, out)
    assert list(tmp_path.glob("traj.parquet*")) == []


# --- JSON lines and per-request -----------------------------------------------------------------


def test_jsonl_holds_the_same_rows_as_parquet(db: Path, tmp_path: Path) -> None:
    for strategy in ("prefix-merge", "per-request"):
        export(db, tmp_path / "x.parquet", strategy=strategy)
        export(db, tmp_path / "x.jsonl", strategy=strategy, fmt="jsonl")
        from_parquet = pq.read_table(tmp_path / "x.parquet").to_pylist()
        from_jsonl = [json.loads(line) for line in (tmp_path / "x.jsonl").read_text().splitlines()]
        assert from_jsonl == from_parquet
        assert list(from_jsonl[0]) == TRAJECTORY_SCHEMA.names


def test_per_request_rows_are_each_generation(db: Path, tmp_path: Path) -> None:
    export(db, tmp_path / "turns.parquet", strategy="per-request")
    rows = pq.read_table(tmp_path / "turns.parquet").to_pylist()
    # Session by session (a turn's role depends on its session's other conversations), each in
    # creation order.
    assert [r["trajectory_id"] for r in rows] == ["a1", "a2", "a3", "b1", "b2"]
    a3 = rows[2]
    assert a3["prompt_ids"] == [1, 2, 3, 10, 11, 4, 12, 5] and a3["response_ids"] == [14, 15]
    assert a3["loss_mask"] == [1, 1] and a3["response_logprobs"] == [B, D] and a3["num_turns"] == 1


# --- filters ------------------------------------------------------------------------------------


def ids(db: Path, **selection) -> list[str]:
    return [r.trajectory_id for r in iter_trajectories(db, selection=Selection(**selection))]


def test_filters(db: Path) -> None:
    assert ids(db) == ["a3", "b2"]
    assert ids(db, session="s2") == ["b2"]
    assert ids(db, task="task-a") == ["a3"]
    assert ids(db, since=1500.0) == ["b2"]
    assert ids(db, include_side_calls=True) == ["a-title", "a3", "b2"]
    # The aborted turn and a3 share a prompt: a retry, of which the newest stays.
    assert ids(db, include_aborted=True) == ["a3", "b2"]


def test_side_call_branch_does_not_retrain_the_shared_prefix(db: Path) -> None:
    rows = {r.trajectory_id: r for r in iter_trajectories(db, selection=Selection(include_side_calls=True))}
    title = rows["a-title"]
    assert title.prompt_ids.tolist() == [1, 2, 3, 10, 11, 50] and title.loss_mask.tolist() == [1]
    assert rows["a3"].loss_mask.tolist() == [1, 1, 0, 1, 0, 1, 1]


# --- CLI ----------------------------------------------------------------------------------------


def test_cli_export_parquet_and_jsonl(cli: click.Group, db: Path, tmp_path: Path) -> None:
    out = tmp_path / "traj.parquet"
    r = invoke(
        cli, "export", "--db", str(db), "--strategy", "prefix-merge", "--format", "parquet", "--out", str(out)
    )
    assert r.exit_code == 0, r.output
    assert "wrote 2 prefix-merge rows from 5 turns of 2 sessions" in r.stderr
    assert pq.read_table(out).num_rows == 2
    # Format inferred from the suffix; db from the environment.
    r = invoke(cli, "export", "--out", str(tmp_path / "t.jsonl"), "-q", env={"POLAR_MITM_DB": str(db)})
    assert r.exit_code == 0 and r.stderr == ""
    assert len((tmp_path / "t.jsonl").read_text().splitlines()) == 2
    r = invoke(
        cli, "export", "--db", str(db), "--strategy", "per-request", "--out", "-", "--session", "s2", "-q"
    )
    assert [json.loads(line)["trajectory_id"] for line in r.stdout.splitlines()] == ["b1", "b2"]


def test_cli_filters_since_iso_and_flags(cli: click.Group, db: Path, tmp_path: Path) -> None:
    since = datetime.fromtimestamp(1500).isoformat()
    out = tmp_path / "t.jsonl"
    invoke(cli, "export", "--db", str(db), "--out", str(out), "--since", since, "-q")
    assert [json.loads(x)["trajectory_id"] for x in out.read_text().splitlines()] == ["b2"]
    invoke(
        cli, "export", "--db", str(db), "--out", str(out), "--include-side-calls", "--task", "task-a", "-q"
    )
    assert [json.loads(x)["trajectory_id"] for x in out.read_text().splitlines()] == ["a-title", "a3"]
    r = invoke(cli, "export", "--db", str(db), "--out", str(out), "--since", "last tuesday")
    assert r.exit_code == 2 and "neither unix seconds nor an ISO date" in r.output


def test_cli_missing_db_is_a_clear_error(cli: click.Group, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)  # no polar-mitm.sqlite here: the default store is not there
    r = invoke(cli, "export", "--out", str(tmp_path / "x.parquet"), env={"POLAR_MITM_DB": ""})
    assert r.exit_code == 1
    assert "no database at polar-mitm.sqlite (pass --db PATH or set POLAR_MITM_DB)" in r.output
    r = invoke(cli, "stats", "--db", str(tmp_path / "nope.sqlite"))
    assert r.exit_code == 1 and "no database at" in r.output
    assert not (tmp_path / "nope.sqlite").exists()


def test_cli_stats_text_and_json(cli: click.Group, db: Path) -> None:
    r = invoke(cli, "stats", "--db", str(db), "--json")
    assert r.exit_code == 0, r.output
    s = json.loads(r.stdout)
    assert s["sessions"] == 2 and s["turns"] == 5 and s["trajectories"] == 2
    assert s["merge_ratio"] == 2.5
    # per-request: 5 + 3 + 7 + 5 + 10 tokens; merged rows: 10 + 5
    assert s["per_request_tokens"] == 30 and s["merged_tokens"] == 15 and s["trainer_token_ratio"] == 2.0
    assert s["side_calls_excluded"] == 1 and s["not_ok_excluded"] == 1
    assert s["retries_dropped"] == 0 and s["breaks"] == {} and s["mismatches"] == {"total": 0}
    r = invoke(cli, "stats", "--db", str(db), "--include-aborted", "--include-side-calls", "--json")
    s = json.loads(r.stdout)
    assert s["turns"] == 7 and s["retries_dropped"] == 1 and s["branches"] == 1 and s["trajectories"] == 3
    text = invoke(cli, "stats", "--db", str(db)).stdout
    for label in (
        "turns",
        "trajectories",
        "merge ratio",
        "trainer-token ratio",
        "retries dropped",
        "mismatches",
    ):
        assert label in text
    assert "2.50" in text and "2.00" in text


def test_cli_reward_attaches_to_every_trajectory(cli: click.Group, db: Path, tmp_path: Path) -> None:
    r = invoke(cli, "reward", "--db", str(db), "--session", "s1", "--value", "1.0")
    assert r.exit_code == 0, r.output
    out = tmp_path / "t.parquet"
    invoke(cli, "export", "--db", str(db), "--out", str(out), "--include-side-calls", "-q")
    rewards = {row["trajectory_id"]: row["reward"] for row in pq.read_table(out).to_pylist()}
    assert rewards == {"a-title": 1.0, "a3": 1.0, "b2": None}
    r = invoke(cli, "reward", "--db", str(db), "--session", "nope", "--value", "1")
    assert r.exit_code == 1 and "no session 'nope'" in r.output
    invoke(cli, "reward", "--db", str(db), "--session", "s1", "--clear")
    export(db, out)
    assert pq.read_table(out).column("reward").to_pylist() == [None, None]
    r = invoke(cli, "reward", "--db", str(db), "--session", "s1")
    assert r.exit_code == 2 and "exactly one of --value or --clear" in r.output


def test_cli_show_ids_list_and_text(cli: click.Group, db: Path, tiny_tokenizer_dir: Path) -> None:
    r = invoke(cli, "show", "--db", str(db))
    assert r.exit_code == 0
    lines = r.stdout.splitlines()
    assert lines[0].split() == [
        "trajectory_id",
        "session_id",
        "turns",
        "tokens",
        "trained",
        "reward",
        "finish",
    ]
    assert lines[1].split()[:5] == ["a3", "s1", "3", "10", "5"]
    r = invoke(cli, "show", "--db", str(db), "a3")
    assert r.exit_code == 0, r.output
    assert "1 2 3 «10 11» 4 «12» 5 «14 15»" in r.stdout
    assert "\x1b[" not in r.stdout
    r = invoke(cli, "show", "--db", str(db), "a2", "--color")  # a turn id finds the row holding it
    assert "\x1b[32m" in r.stdout and "trajectory  a3" in r.stdout
    r = invoke(cli, "show", "--db", str(db), "s2")  # a session id: all its rows
    assert "trajectory  b2" in r.stdout
    r = invoke(cli, "show", "--db", str(db), "zzz")
    assert r.exit_code == 1 and "no trajectory, turn or session 'zzz'" in r.output
    r = invoke(cli, "show", "--db", str(db), "a-title")
    assert r.exit_code == 1 and "--include-side-calls" in r.output


def test_cli_show_decodes_with_a_tokenizer(
    cli: click.Group, tmp_path: Path, tiny_tokenizer_dir: Path
) -> None:
    from polar_mitm.backends.tokenizer import Tokenizer

    tok = Tokenizer.load(tiny_tokenizer_dir)
    prompt = tok.encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    output = tok.encode("hello<|im_end|>")

    async def fill() -> None:
        store = await Store.open(tmp_path / "t.sqlite")
        await store.ensure_session("s")
        await store.insert_turn(
            Turn(
                id="t1",
                session_id="s",
                style="openai-chat",
                prompt_ids=prompt,
                output_ids=output,
                output_logprobs=[-0.5] * len(output),
            )
        )
        await store.close()

    asyncio.run(fill())
    r = invoke(cli, "show", "--db", str(tmp_path / "t.sqlite"), "t1", "--tokenizer", str(tiny_tokenizer_dir))
    assert r.exit_code == 0, r.output
    assert "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n«hello<|im_end|>»" in r.stdout


def test_every_command_has_help_with_an_example(cli: click.Group) -> None:
    for name in ("export", "stats", "show", "reward"):
        r = invoke(cli, name, "--help")
        assert r.exit_code == 0 and "polar-mitm " + name in r.stdout
    assert "--format [parquet|jsonl|sft-jsonl]" in invoke(cli, "export", "--help").stdout


@pytest.mark.parametrize("seed", range(5))
def test_store_hints_and_pure_merge_agree(tmp_path: Path, seed: int) -> None:
    """Random conversations written through the Store (prompts stored as references) merge to the
    same rows as the same turns handed to prefix_merge without any hint."""
    import random

    from polar_mitm.reconstruct.prefix_merge import prefix_merge
    from polar_mitm.store.reader import read_turns

    rng = random.Random(seed)
    seqs: list[tuple[str, list[int]]] = []
    records = []
    for i in range(40):
        session = rng.choice(["x", "y"])
        mine = [(t, s) for t, s in seqs if t.startswith(session)]
        if not mine or rng.random() < 0.1:
            ref, base = None, []
        else:
            ref, base = rng.choice(mine[-3:])
        prompt = base + [rng.randint(1, 50) for _ in range(rng.randint(1, 30))]
        output = [rng.randint(1, 50) for _ in range(rng.randint(1, 10))]
        tid = f"{session}{i}"
        records.append(
            Turn(
                id=tid,
                session_id=session,
                style="openai-chat",
                prompt_ids=prompt,
                prompt_ref=ref,
                prompt_ref_len=len(base),
                output_ids=output,
                output_logprobs=[-0.5] * len(output),
            )
        )
        seqs.append((tid, prompt + output))

    async def fill() -> None:
        store = await Store.open(tmp_path / "r.sqlite")
        for s in ("x", "y"):
            await store.ensure_session(s)
        for rec in records:
            await store.insert_turn(rec)
        await store.close()

    asyncio.run(fill())
    db = tmp_path / "r.sqlite"
    stored = [r.to_row() for r in iter_trajectories(db)]
    hintless = [t.model_copy(update={"prompt_ref": None, "prompt_ref_len": 0}) for t in read_turns(db)]
    pure = [r.to_row() for r in prefix_merge(hintless)]
    assert sorted(stored, key=lambda r: r["trajectory_id"]) == sorted(pure, key=lambda r: r["trajectory_id"])
