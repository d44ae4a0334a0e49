"""Rollouts under the real Apptainer with real harness binaries, through `polar-mitm rollout
--runtime apptainer`: the task names the Docker test image, converted once into the SIF cache;
each sample runs in a contained instance with no network but its channel, is scored by the
task's own test in a fresh instance, and leaves no instance, process or registry record behind.
"""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess

import pytest

from polar_mitm.sandbox.apptainer.registry import default_registry_dir
from tests.support.docker_rollout import solve_answer_task
from tests.support.harness import assert_turns_match_backend, require_binary

pytestmark = [pytest.mark.e2e, pytest.mark.docker, pytest.mark.apptainer]


def running_instances(binary: str) -> list[str]:
    out = subprocess.run([binary, "instance", "list", "--json"], capture_output=True, text=True, timeout=60)
    return [i["instance"] for i in json.loads(out.stdout or "{}").get("instances") or []]


@pytest.mark.parametrize(
    "harness,binary",
    [
        ("claude-code", "claude"),
        ("codex", "codex"),
        ("openclaw", "openclaw"),  # its own npm prefix and Node 24 bound in; stateful Responses
        ("kimi-code", "kimi-code"),  # its own npm prefix and Node 24 too, its launcher named otherwise
    ],
)
def test_a_harbor_task_two_samples_under_apptainer(
    tmp_path, backend, qwen_tokenizer_dir, apptainer_binary, harness, binary
):
    require_binary(binary)
    db, rows = solve_answer_task(
        tmp_path,
        harness,
        backend,
        qwen_tokenizer_dir,
        runtime="apptainer",
        extra=["--allow-unenforced-limits"],
    )
    assert_turns_match_backend(backend, db)  # token-exact: every stored turn is what was sampled
    for row in rows:
        v = json.loads(row["reward_detail"])["verifier"]
        assert v["sandbox"] == "fresh" and v["runtime"] == "apptainer" and v["supervisor"] == "reap.py", v
        assert v["image"].endswith(".sif") and v["network"] == "none" and v["agent_stopped_first"], v
    con = sqlite3.connect(db)
    assert con.execute("SELECT COUNT(DISTINCT session_id) FROM turns").fetchone() == (2,)
    assert not [n for n in running_instances(apptainer_binary) if n.startswith("polar-")]
    assert not list(default_registry_dir().glob("polar-*.json"))
    for pid in filter(str.isdigit, os.listdir("/proc")):  # no instance's processes either
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        assert not (b"Apptainer instance: " in cmd and b"[polar-" in cmd), cmd
