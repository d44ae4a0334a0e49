"""Rollouts in real Docker containers of the npm harnesses beyond Claude Code, Codex and Gemini CLI
(tests/e2e/test_rollout_docker.py): Cline, Continue, Copilot CLI, Kilo Code, Qwen Code, Pi and
OpenCode (the npm ones: the host's installation is mounted read-only, as for Claude Code), through
`polar-mitm rollout` with each recipe's headless command, the files its recipe writes into the
sample's fresh HOME, and a Harbor task scored by its own test. The PyPI harnesses (mini-swe-agent,
aider, Kimi CLI, OpenHands) are in tests/e2e/test_rollout_docker_pypi.py.
"""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest

from tests.e2e.harness import assert_turns_match_backend, harness_env, require_binary
from tests.e2e.test_rollout_docker import ANSWER_TEST, harbor_task, leftovers, policy_args, rollout

pytestmark = [pytest.mark.e2e, pytest.mark.docker]


@pytest.mark.parametrize(
    "harness,binary",
    [
        ("cline", "cline"),
        ("continue", "cn"),
        ("copilot", "copilot"),
        ("kilo", "kilo"),
        # The recipe harnesses that had only run under `run` until now.
        ("qwen-code", "qwen"),
        ("pi", "pi"),
        ("opencode", "opencode"),
    ],
)
def test_harness_solves_a_task_in_docker(
    tmp_path, backend, qwen_tokenizer_dir, docker_client, harness, binary
):
    require_binary(binary)
    tasks = tmp_path / "tasks"
    harbor_task(tasks, "answer", "run: echo 42 > answer.txt", ANSWER_TEST)
    db, out = tmp_path / "runs.sqlite", tmp_path / "groups.parquet"
    r = rollout(
        [str(tasks), "--harness", harness, "--runtime", "docker", "--samples", "2",
         *policy_args(backend, qwen_tokenizer_dir, db), "--out", str(out)],
        cwd=tmp_path, env=harness_env(tmp_path / "home"),
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    rows = pq.read_table(out).to_pylist()
    assert {row["reward"] for row in rows} == {1.0} and {row["sample_index"] for row in rows} == {0, 1}, [
        (row["status"], row["reward"]) for row in rows
    ]
    assert all(row["status"] == "completed" and sum(row["loss_mask"]) > 0 for row in rows)
    assert all(row["role"] == "main" for row in rows)  # side calls (titles) are tagged, not trajectories
    assert_turns_match_backend(backend, db)
    assert leftovers(docker_client) == []
