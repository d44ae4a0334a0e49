"""Evaluators: score one sample in its own sandbox after the harness has ended.

Each evaluator returns a `Score`: a float reward and a JSON-able detail (per-test results, the
verifier's exit code and output tail) kept beside it. An evaluator that cannot run (a missing
tests directory, a sandbox that died) raises; the pipeline records that as an infrastructure
failure, never as reward 0.
"""

from __future__ import annotations

import json
import re
import shlex
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from polar_mitm.runtime.sandbox import Sandbox
from polar_mitm.tasks.model import EvaluatorSpec, Task

DETAIL_TAIL = 4000  # characters of verifier output kept in the detail
HARBOR_TESTS = "/tests"
HARBOR_REWARD_DIR = "/logs/verifier"


@dataclass
class HarnessOutcome:
    exit_code: int | None
    timed_out: bool = False


@dataclass
class Score:
    reward: float
    detail: dict[str, Any] = field(default_factory=dict)


class EvaluatorError(RuntimeError):
    """The evaluator could not run (not: the sample failed its tests)."""


def parse_reward(raw: bytes | str, source: str) -> float:
    """A reward file's value: a bare float, or JSON (`{"reward": x}`, or a single-entry object)."""
    text = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw
    text = text.strip()
    try:
        return float(text)
    except ValueError:
        pass
    try:
        data = json.loads(text)
    except ValueError:
        raise EvaluatorError(
            f"{source}: expected a number or JSON with a 'reward', got {text[:80]!r}"
        ) from None
    if isinstance(data, (int, float)) and not isinstance(data, bool):
        return float(data)
    if isinstance(data, dict):
        if isinstance(data.get("reward"), (int, float)):
            return float(data["reward"])
        values = [v for v in data.values() if isinstance(v, (int, float)) and not isinstance(v, bool)]
        if len(values) == 1:
            return float(values[0])
    raise EvaluatorError(f"{source}: expected a number or JSON with a 'reward', got {text[:80]!r}")


async def _shell(sandbox: Sandbox, line: str, spec: EvaluatorSpec, task: Task):
    return await sandbox.exec(["sh", "-c", line], env={**task.env, **spec.env}, timeout=spec.timeout_sec)


async def session_completed(task: Task, sandbox: Sandbox, outcome: HarnessOutcome) -> Score:
    ok = outcome.exit_code == 0 and not outcome.timed_out
    return Score(1.0 if ok else 0.0, {"exit_code": outcome.exit_code, "timed_out": outcome.timed_out})


async def command(task: Task, sandbox: Sandbox, outcome: HarnessOutcome) -> Score:
    spec = task.evaluator
    assert spec.command is not None
    r = await _shell(sandbox, spec.command, spec, task)
    detail: dict[str, Any] = {
        "exit_code": r.exit_code,
        "timed_out": r.timed_out,
        "output": r.output[-DETAIL_TAIL:],
    }
    if spec.reward_file:
        raw = await sandbox.read(spec.reward_file)
        if raw is None:
            detail["reward_file"] = None
            return Score(0.0, detail)
        detail["reward_file"] = raw.decode("utf-8", "replace")[:1000]
        return Score(parse_reward(raw, spec.reward_file), detail)
    return Score(1.0 if r.exit_code == 0 else 0.0, detail)


async def harbor(task: Task, sandbox: Sandbox, outcome: HarnessOutcome) -> Score:
    """Harbor's verifier contract: tests/ uploaded to /tests, `bash /tests/test.sh` run from the
    workdir, the reward read from /logs/verifier/reward.txt (or reward.json); it counts only when
    the verifier exits 0."""
    spec = task.evaluator
    tests = Path(spec.tests_dir) if spec.tests_dir else None
    if tests is None or not (tests / "test.sh").is_file():
        raise EvaluatorError(f"task {task.id}: {tests}/test.sh does not exist")
    await sandbox.put(tests, HARBOR_TESTS)
    mk = await sandbox.exec(["mkdir", "-p", HARBOR_REWARD_DIR], workdir="/")
    if mk.exit_code != 0:
        raise EvaluatorError(f"task {task.id}: cannot create {HARBOR_REWARD_DIR}: {mk.output[-300:]}")
    r = await sandbox.exec(
        ["bash", f"{HARBOR_TESTS}/test.sh"], env={**task.env, **spec.env}, timeout=spec.timeout_sec
    )
    detail: dict[str, Any] = {
        "verifier_exit_code": r.exit_code,
        "timed_out": r.timed_out,
        "output": r.output[-DETAIL_TAIL:],
    }
    raw, name = None, None
    for name in ("reward.txt", "reward.json"):
        raw = await sandbox.read(f"{HARBOR_REWARD_DIR}/{name}")
        if raw is not None:
            break
    if raw is None:
        detail["reward_file"] = None
        return Score(0.0, detail)
    detail["reward_file"] = raw.decode("utf-8", "replace")[:1000]
    value = parse_reward(raw, f"{HARBOR_REWARD_DIR}/{name}")
    detail["reported_reward"] = value
    return Score(value if r.exit_code == 0 else 0.0, detail)


_PYTEST_RESULT = re.compile(r"^(PASSED|FAILED|ERROR|XFAIL|XPASS|SKIPPED)\s+(\S+)", re.MULTILINE)


def pytest_results(output: str) -> dict[str, str]:
    """Test id → status from pytest's `-rA` summary lines (`PASSED tests/x.py::test_a`)."""
    out: dict[str, str] = {}
    for status, test in _PYTEST_RESULT.findall(output):
        out[test] = status
    return out


def patched_files(patch: str) -> list[str]:
    return sorted(set(re.findall(r"^\+\+\+ b/(\S+)", patch, re.MULTILINE)))


async def swebench(task: Task, sandbox: Sandbox, outcome: HarnessOutcome) -> Score:
    """SWE-bench's rule: the test files are reset and `test_patch` applied, the tests run; the
    sample is resolved when every FAIL_TO_PASS test passes and every PASS_TO_PASS test still does."""
    spec = task.evaluator
    assert spec.test_command is not None
    detail: dict[str, Any] = {}
    if spec.test_patch:
        files = patched_files(spec.test_patch)
        if files:  # undo what the agent did to the test files (new files simply vanish)
            await _shell(
                sandbox,
                "git checkout -q -- " + " ".join(map(shlex.quote, files)) + " 2>/dev/null; true",
                spec,
                task,
            )
        with tempfile.NamedTemporaryFile("w", suffix=".patch", delete=False) as f:
            f.write(spec.test_patch)
        try:
            await sandbox.put(Path(f.name), "/tmp/polar_mitm_test.patch")
        finally:
            Path(f.name).unlink(missing_ok=True)
        ap = await _shell(
            sandbox,
            "git apply -v /tmp/polar_mitm_test.patch || patch -p1 --forward < /tmp/polar_mitm_test.patch",
            spec,
            task,
        )
        detail["test_patch_applied"] = ap.exit_code == 0
        if ap.exit_code != 0:
            detail["output"] = ap.output[-DETAIL_TAIL:]
            return Score(0.0, detail)
    r = await _shell(sandbox, spec.test_command, spec, task)
    results = pytest_results(r.output)
    f2p = {t: results.get(t, "MISSING") for t in spec.fail_to_pass}
    p2p = {t: results.get(t, "MISSING") for t in spec.pass_to_pass}
    resolved = all(s in ("PASSED", "XFAIL") for s in [*f2p.values(), *p2p.values()])
    detail.update(
        {
            "exit_code": r.exit_code,
            "timed_out": r.timed_out,
            "FAIL_TO_PASS": f2p,
            "PASS_TO_PASS": p2p,
            "resolved": resolved,
            "output": r.output[-DETAIL_TAIL:],
        }
    )
    return Score(1.0 if resolved else 0.0, detail)


EVALUATORS = {
    "session_completed": session_completed,
    "command": command,
    "harbor": harbor,
    "swebench": swebench,
}


async def evaluate(task: Task, sandbox: Sandbox, outcome: HarnessOutcome) -> Score:
    score = await EVALUATORS[task.evaluator.kind](task, sandbox, outcome)
    score.detail.setdefault("evaluator", task.evaluator.kind)
    return score
