"""Rollouts in real Docker containers with real harness binaries, through `polar-mitm rollout`.

The containers start from the small base image `scripts/docker.sh` builds from a debootstrap root
(`docker import`, no registry). The harness is the host's npm installation, mounted read-only; the
container has no network and reaches the proxy through its sample's own channel (a Unix socket and
a forwarder on 127.0.0.1 inside), under its own session. The fake SGLang backend
answers "run: CMD" with a call to the harness's shell tool, so a task's instruction decides what
the sample does, and the task's own tests decide its reward.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import sqlite3
import subprocess
import time

import docker
import pyarrow.parquet as pq
import pytest

from tests.support.docker_rollout import (
    ANSWER_TEST,
    LABEL,
    TEST_IMAGE,
    harbor_task,
    leftovers,
    policy_args,
    rollout,
    solve_answer_task,
)
from tests.support.harness import POLAR, assert_turns_match_backend, harness_env, require_binary
from tests.support.helpers import wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.docker]


def table_rows(stderr: str) -> dict[str, list[str]]:
    """The rollout's summary table, by task: its cells split on runs of two or more spaces."""
    lines = stderr.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("task  "))
    rows = {}
    for line in lines[start + 2 :]:
        cells = re.split(r" {2,}", line.strip())
        if len(cells) < 6:
            break
        rows[cells[0]] = cells
    return rows


def test_claude_code_two_tasks_four_samples_each_in_docker(
    tmp_path, backend, qwen_tokenizer_dir, docker_client
):
    require_binary("claude")
    tasks = tmp_path / "tasks"
    harbor_task(tasks, "answer-right", "run: echo 42 > answer.txt", ANSWER_TEST)
    harbor_task(tasks, "answer-wrong", "run: echo 41 > answer.txt", ANSWER_TEST)
    db, out = tmp_path / "runs.sqlite", tmp_path / "groups.parquet"
    r = rollout(
        [str(tasks), "--harness", "claude-code", "--runtime", "docker", "--samples", "4",
         *policy_args(backend, qwen_tokenizer_dir, db), "--out", str(out)],
        cwd=tmp_path, env=harness_env(tmp_path / "home"),
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    table = table_rows(r.stderr)  # the per-task table: samples, usable, mean reward, pass@1, pass@k
    assert table["answer-right"][1:6] == ["4", "4", "1.00", "100%", "100% (k=4)"]
    assert table["answer-wrong"][1:6] == ["4", "4", "0.00", "0%", "0% (k=4)"]
    assert "wrote 8 rows (8 samples)" in r.stderr
    rows = pq.read_table(out).to_pylist()
    groups: dict[str, list[dict]] = {}
    for row in rows:
        groups.setdefault(row["group_id"], []).append(row)
    assert len(groups) == 2 and all(len(g) == 4 for g in groups.values())
    for g in groups.values():
        task = g[0]["task_id"]
        assert {row["task_id"] for row in g} == {task}
        assert sorted(row["sample_index"] for row in g) == [0, 1, 2, 3]
        assert {row["reward"] for row in g} == ({1.0} if task == "answer-right" else {0.0})
        assert {row["advantage"] for row in g} == {0.0}  # equal rewards in a group: no signal
        for row in g:
            assert row["status"] == "completed" and row["num_turns"] == 2
            assert json.loads(row["reward_detail"])["verifier_exit_code"] == 0
            assert len(row["response_ids"]) == len(row["loss_mask"]) == len(row["response_logprobs"])
    # Token fidelity: every stored turn is exactly what the backend sampled for its prompt.
    assert_turns_match_backend(backend, db)
    con = sqlite3.connect(db)
    assert con.execute("SELECT COUNT(DISTINCT session_id) FROM turns").fetchone() == (8,)
    assert con.execute("SELECT COUNT(*) FROM sessions WHERE id LIKE 'rollout-unattributed'").fetchone() == (
        0,
    )
    assert leftovers(docker_client) == []


@pytest.mark.parametrize("harness,binary", [("codex", "codex"), ("gemini-cli", "gemini")])
def test_other_harnesses_in_docker(tmp_path, backend, qwen_tokenizer_dir, docker_client, harness, binary):
    require_binary(binary)
    db, _ = solve_answer_task(tmp_path, harness, backend, qwen_tokenizer_dir)
    assert_turns_match_backend(backend, db)
    assert leftovers(docker_client) == []


REPO_FILES = {
    "calc.py": "def add(a, b):\n    return a - b\n\n\ndef mul(a, b):\n    return a * b\n",
    "tests/test_calc.py": "from calc import mul\n\n\ndef test_mul():\n    assert mul(2, 3) == 6\n",
}
# A unified diff; its blank context lines are a single space, spelled out.
TEST_PATCH = "\n".join(
    [
        "--- a/tests/test_calc.py",
        "+++ b/tests/test_calc.py",
        "@@ -1,5 +1,9 @@",
        "-from calc import mul",
        "+from calc import add, mul",
        " ",
        " ",
        " def test_mul():",
        "     assert mul(2, 3) == 6",
        "+",
        "+",
        "+def test_add():",
        "+    assert add(2, 3) == 5",
        "",
    ]
)


def test_swebench_rows_against_a_locally_built_image(tmp_path, backend, qwen_tokenizer_dir, docker_client):
    """A tiny repository with a bug: the scripted model fixes it in one row and not in the other;
    the test patch adds the failing test, and resolution follows SWE-bench's rule."""
    require_binary("claude")
    ctx = tmp_path / "image"
    for name, text in REPO_FILES.items():
        (ctx / "repo" / name).parent.mkdir(parents=True, exist_ok=True)
        (ctx / "repo" / name).write_text(text)
    (ctx / "Dockerfile").write_text(
        f"FROM {TEST_IMAGE}\nCOPY repo /testbed\nWORKDIR /testbed\n"
        "RUN git init -q && git add -A && git -c user.email=t@t -c user.name=t commit -qm base\n"
    )
    tag = f"polar-mitm/test-swe:{os.getpid()}"
    docker_client.images.build(path=str(ctx), tag=tag, rm=True)
    try:
        test_cmd = "python3 -m pytest -rA -p no:cacheprovider tests/test_calc.py"
        common = {
            "repo": "example/calc", "image": tag, "test_patch": TEST_PATCH, "test_command": test_cmd,
            "FAIL_TO_PASS": json.dumps(["tests/test_calc.py::test_add"]),
            "PASS_TO_PASS": ["tests/test_calc.py::test_mul"],
        }  # fmt: skip
        rows = [
            {
                "instance_id": "example__calc-1",
                "problem_statement": "add() subtracts.\nrun: sed -i 's/a - b/a + b/' calc.py",
                **common,
            },
            {"instance_id": "example__calc-2", "problem_statement": "add() subtracts.\nrun: true", **common},
        ]
        jsonl = tmp_path / "swe.jsonl"
        jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
        db, out = tmp_path / "runs.sqlite", tmp_path / "groups.parquet"
        r = rollout(
            [str(jsonl), "--harness", "claude-code", "--runtime", "docker", "--samples", "1",
             *policy_args(backend, qwen_tokenizer_dir, db), "--out", str(out)],
            cwd=tmp_path, env=harness_env(tmp_path / "home"),
        )  # fmt: skip
        assert r.returncode == 0, r.stderr
        by_task = {row["task_id"]: row for row in pq.read_table(out).to_pylist()}
        fixed, unfixed = by_task["example__calc-1"], by_task["example__calc-2"]
        assert fixed["reward"] == 1.0 and unfixed["reward"] == 0.0, (
            fixed["reward_detail"],
            unfixed["reward_detail"],
        )
        detail = json.loads(fixed["reward_detail"])
        assert detail["FAIL_TO_PASS"] == {"tests/test_calc.py::test_add": "PASSED"}
        assert detail["PASS_TO_PASS"] == {"tests/test_calc.py::test_mul": "PASSED"}
        assert json.loads(unfixed["reward_detail"])["FAIL_TO_PASS"] == {
            "tests/test_calc.py::test_add": "FAILED"
        }
        assert_turns_match_backend(backend, db)
    finally:
        docker_client.images.remove(tag, force=True)
    assert leftovers(docker_client) == []


def test_offline_task_reaches_its_model_but_no_other_host(
    tmp_path, backend, qwen_tokenizer_dir, docker_client
):
    """allow_internet = false: the harness still talks to the policy (its turns are recorded), but a
    request to any other host from inside the container is refused by the proxy with a 403."""
    require_binary("claude")
    tasks = tmp_path / "tasks"
    fetch = "python3 -c \"import urllib.request as u; u.urlopen('https://example.com')\" > out.txt 2>&1"
    harbor_task(
        tasks, "offline", f"run: {fetch}",
        "grep -q 'Tunnel connection failed: 403' /app/out.txt && echo 1 > /logs/verifier/reward.txt",
        allow_internet=False,
    )  # fmt: skip
    db = tmp_path / "runs.sqlite"
    r = rollout(
        [str(tasks), "--harness", "claude-code", *policy_args(backend, qwen_tokenizer_dir, db)],
        cwd=tmp_path, env=harness_env(tmp_path / "home"),
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    con = sqlite3.connect(db)
    assert con.execute("SELECT status, reward FROM samples").fetchall() == [("completed", 1.0)]
    assert con.execute("SELECT COUNT(*) FROM turns WHERE status = 'ok'").fetchone()[0] >= 2
    assert leftovers(docker_client) == []


def test_missing_image_is_a_clear_error_before_anything_runs(
    tmp_path, docker_client, backend, qwen_tokenizer_dir
):
    tasks = tmp_path / "tasks"
    harbor_task(tasks, "t", "run: true", "true", docker_image="polar-mitm/does-not-exist:1")
    db = tmp_path / "runs.sqlite"
    r = rollout(
        [str(tasks), "--harness", "claude-code", *policy_args(backend, qwen_tokenizer_dir, db)],
        cwd=tmp_path,
        env=harness_env(tmp_path / "h"),
    )
    assert r.returncode == 1
    assert "image 'polar-mitm/does-not-exist:1' is not on this machine and could not be pulled" in r.stderr
    assert "Traceback" not in r.stderr
    con = sqlite3.connect(db)
    assert con.execute("SELECT COUNT(*) FROM rollouts").fetchone() == (0,)


def test_harness_timeout_and_a_sandbox_that_dies(tmp_path, docker_client, qwen_tokenizer_dir, backend):
    """The harness overruns: killed, trainable with reward 0. The container is killed under the
    harness: the sample fails with that cause (no retries left) and nothing is left behind."""
    tasks = tmp_path / "tasks"
    harbor_task(tasks, "slow", "run: true", "echo 1 > /logs/verifier/reward.txt")
    db = tmp_path / "runs.sqlite"
    args = [str(tasks), "--harness", "claude-code", "--harness-cmd", "sh -c 'sleep 300' {instruction}",
            *policy_args(backend, qwen_tokenizer_dir, db)]  # fmt: skip
    r = rollout([*args, "--agent-timeout", "3"], cwd=tmp_path, env=harness_env(tmp_path / "h"))
    assert r.returncode == 0, r.stderr
    con = sqlite3.connect(db)
    assert con.execute("SELECT status, reward, cause FROM samples").fetchall() == [
        ("agent_timeout", 0.0, "agent timeout")
    ]
    assert leftovers(docker_client) == []

    db2 = tmp_path / "runs2.sqlite"
    args[args.index(str(db))] = str(db2)
    p = subprocess.Popen([*POLAR, "rollout", *args, "--retries", "0"], cwd=tmp_path, env=harness_env(tmp_path / "h"),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        running = wait_until(
            lambda: docker_client.containers.list(filters={"label": LABEL}),
            timeout=60,
            interval=0.2,
            message="a container started",
        )
        assert running, "no container started"
        box = running[0]

        def harness_runs() -> bool:
            try:
                return any("sleep 300" in " ".join(proc) for proc in box.top()["Processes"] or [])
            except docker.errors.APIError:  # not running yet, or gone
                return False

        wait_until(harness_runs, timeout=60, interval=0.2, message="the harness running in the container")
        box.kill()
        _, err = p.communicate(timeout=120)
    finally:
        p.kill()
    assert p.returncode == 3, err  # its only sample failed: nothing to train on, and it says so
    assert "none of the 1 samples can be trained on" in err
    [(status, reward, cause)] = (
        sqlite3.connect(db2).execute("SELECT status, reward, cause FROM samples").fetchall()
    )
    # Whether the harness's exec or the scoring noticed first, the cause is the dead sandbox.
    assert (status, reward) == ("failed", 0.0) and cause.startswith("sandbox died: while")
    assert table_rows(err)["slow"][7] == "sandbox died 1"  # the table counts the failure by cause
    assert leftovers(docker_client) == []


def test_ctrl_c_stops_every_container_and_records_every_sample(
    tmp_path, docker_client, qwen_tokenizer_dir, backend
):
    tasks = tmp_path / "tasks"
    harbor_task(tasks, "t", "run: true", "true")
    db = tmp_path / "runs.sqlite"
    p = subprocess.Popen(
        [*POLAR, "rollout", str(tasks), "--harness", "claude-code", "--harness-cmd", "sh -c 'sleep 300' {instruction}",
         "--samples", "4", *policy_args(backend, qwen_tokenizer_dir, db)],
        cwd=tmp_path, env=harness_env(tmp_path / "h"), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        with contextlib.suppress(AssertionError):  # most samples started; what is checked comes below
            wait_until(lambda: len(docker_client.containers.list(filters={"label": LABEL})) >= 3, 60, 0.2)
        time.sleep(1)
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=60)
    finally:
        p.kill()
    assert p.returncode == 130, err
    assert "rollout interrupted" in err
    assert leftovers(docker_client) == []
    con = sqlite3.connect(db)
    assert sorted(r[0] for r in con.execute("SELECT status FROM samples")) == ["cancelled"] * 4
    assert con.execute("SELECT status FROM rollouts").fetchone() == ("interrupted",)


def test_a_sandbox_start_cancelled_midway_leaves_no_container(tmp_path, docker_client):
    """Ctrl-C (or early stop) can land while the daemon is creating a container in its thread."""
    import asyncio

    from polar_mitm.proxy.certs import ensure_ca
    from polar_mitm.sandbox.base import SandboxSpec
    from polar_mitm.sandbox.docker import DockerRuntime
    from polar_mitm.tasks.model import Task

    async def main() -> None:
        rt = DockerRuntime()
        task = Task(id="c", instruction="x", image=TEST_IMAGE)
        await rt.prepare(task)
        spec = SandboxSpec(
            name=f"polar-cancel-{os.getpid()}", session_dir=tmp_path, ca=ensure_ca(tmp_path / "ca"),
            labels={LABEL: "cancel-test"},
        )  # fmt: skip
        starting = asyncio.create_task(rt.start(task, spec))
        await asyncio.sleep(0.05)
        starting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await starting

    asyncio.run(main())
    assert docker_client.containers.list(all=True, filters={"label": f"{LABEL}=cancel-test"}) == []
