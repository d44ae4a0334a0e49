"""Docker rollouts: the test image, the label every rollout container carries, Harbor tasks and
the `rollout` command as the e2e tests run it."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Sequence
from pathlib import Path

import pyarrow.parquet as pq

from tests.support.harness import POLAR, harness_env

TEST_IMAGE = os.environ.get("POLAR_MITM_TEST_IMAGE", "polar-mitm/rollout-base:bookworm")


LABEL = "polar-mitm.rollout"


def leftovers(client) -> list:
    return client.containers.list(all=True, filters={"label": LABEL})


def harbor_task(root: Path, name: str, instruction: str, test_sh: str, **environment) -> Path:
    d = root / name
    (d / "tests").mkdir(parents=True)
    (d / "instruction.md").write_text(instruction + "\n")
    env = {"docker_image": TEST_IMAGE, **environment}
    lines = ["[agent]", "timeout_sec = 180", "[verifier]", "timeout_sec = 60", "[environment]"]
    lines += [f"{k} = {json.dumps(v)}" for k, v in env.items()]
    (d / "task.toml").write_text("\n".join(lines) + "\n")
    (d / "tests" / "test.sh").write_text("#!/bin/bash\n" + test_sh + "\n")
    return d


ANSWER_TEST = 'if [ "$(cat /app/answer.txt)" = 42 ]; then echo 1; else echo 0; fi > /logs/verifier/reward.txt'


def rollout(args: list[str], *, cwd: Path, env: dict, timeout: float = 600):
    return subprocess.run(
        [*POLAR, "rollout", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )


def policy_args(backend, tokenizer, db: Path) -> list[str]:
    return [
        "--backend",
        backend.url,
        "--tokenizer",
        str(tokenizer),
        "--tool-parser",
        "qwen25",
        "--db",
        str(db),
    ]


def solve_answer_task(
    tmp_path: Path,
    harness: str,
    backend,
    tokenizer_dir,
    instruction: str = "run: echo 42 > answer.txt",
    runtime: str = "docker",
    extra: Sequence[str] = (),
) -> tuple[Path, list[dict]]:
    """`rollout` of one Harbor task (answer.txt must hold 42) x 2 samples with `harness` in Docker
    (or `runtime`; `extra`: more `rollout` arguments):
    both samples completed, were trained on, and scored 1.0 by the task's own test. Returns the
    store and the exported rows, for the caller's own checks."""
    tasks = tmp_path / "tasks"
    harbor_task(tasks, "answer", instruction, ANSWER_TEST)
    db, out = tmp_path / "runs.sqlite", tmp_path / "groups.parquet"
    r = rollout(
        [str(tasks), "--harness", harness, "--runtime", runtime, "--samples", "2",
         *policy_args(backend, tokenizer_dir, db), "--out", str(out), *extra],
        cwd=tmp_path, env=harness_env(tmp_path / "home"),
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    rows = pq.read_table(out).to_pylist()
    assert {row["reward"] for row in rows} == {1.0} and {row["sample_index"] for row in rows} == {0, 1}, (
        [(row["status"], row["reward"]) for row in rows],
        r.stderr[-3000:],
    )
    assert all(row["status"] == "completed" and sum(row["loss_mask"]) > 0 for row in rows)
    return db, rows
