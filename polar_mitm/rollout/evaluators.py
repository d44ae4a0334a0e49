"""Evaluators: score one sample after the harness has ended.

An evaluator runs in the sandbox it is given: on container runtimes a fresh one from the task's
image holding the agent's artefacts, started after the agent's sandbox was halted
(`rollout/verify.py`); on the `local` runtime the agent's own directory. Each evaluator also
assumes the worst of what it finds there: it clears the places its verdict is read from
(`/tests`, `/logs/verifier`, a `reward_file`) before the verifier runs, and reads only what the
verifier's own run justifies.

Each evaluator returns a `Score`: a float reward and a JSON-able detail (per-test results, the
verifier's exit code and output tail, where it ran) kept beside it. An evaluator that cannot run
(a missing tests directory, a sandbox that died) raises; the pipeline records that as an
infrastructure failure, never as reward 0.
"""

from __future__ import annotations

import json
import posixpath
import re
import shlex
import tempfile
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from polar_mitm.rollout import verdict
from polar_mitm.sandbox.base import Sandbox
from polar_mitm.tasks.model import EvaluatorSpec, Task

DETAIL_TAIL = 4000  # characters of verifier output kept in the detail
HARBOR_TESTS = "/tests"
HARBOR_REWARD_DIR = "/logs/verifier"
HARBOR_REWARD_FILES = ("reward.txt", "reward.json")  # Harbor's own order, when both count


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
    return await sandbox.exec(
        ["sh", "-c", line], env=verdict.test_env(task, sandbox), timeout=spec.timeout_sec
    )


async def session_completed(task: Task, sandbox: Sandbox, outcome: HarnessOutcome) -> Score:
    """Not a verifier: 1.0 when the harness exited 0 within its time, whatever it did.

    The agent decides this reward by how it exits; use it for harvesting sessions or smoke tests,
    never to train on a task's success (give the task a `command`, `harbor` or `swebench`
    evaluator for that). Nothing runs in the sandbox.
    """
    ok = outcome.exit_code == 0 and not outcome.timed_out
    return Score(
        1.0 if ok else 0.0,
        {
            "exit_code": outcome.exit_code,
            "timed_out": outcome.timed_out,
            "verifies": "nothing (exit status only)",
        },
    )


async def command(task: Task, sandbox: Sandbox, outcome: HarnessOutcome) -> Score:
    """`command` run in the workdir; 1.0 when it exits 0, or the value of `reward_file`.

    The reward file (relative to the workdir, or absolute) is removed before the command runs, so
    only what the command itself writes counts, never a file the agent left among its artefacts.
    """
    spec = task.evaluator
    assert spec.command is not None
    reward_path = posixpath.join(sandbox.workdir, spec.reward_file) if spec.reward_file else None
    if reward_path is not None:
        rm = await sandbox.exec(["rm", "-rf", "--", reward_path], workdir="/")
        if rm.exit_code != 0:
            raise EvaluatorError(f"task {task.id}: cannot clear {reward_path}: {rm.output[-300:]}")
    r, left = await _supervised(task, sandbox, ["sh", "-c", spec.command])
    detail: dict[str, Any] = {
        "exit_code": r.exit_code,
        "timed_out": r.timed_out,
        "output": r.output[-DETAIL_TAIL:],
    }
    reward = 1.0 if r.exit_code == 0 else 0.0
    if reward_path is not None:
        raw = await sandbox.read(reward_path)
        detail["reward_file"] = None if raw is None else raw.decode("utf-8", "replace")[:1000]
        reward = 0.0 if raw is None else _reward_of(raw, spec.reward_file or reward_path, left, detail)
    reward = await verdict.judge(reward, detail, task=task, sandbox=sandbox, output=r.output, left=left)
    return Score(reward, detail)


def _reward_of(raw: bytes, source: str, left: list, detail: dict[str, Any]) -> float:
    """The reward file's value; 0 when it cannot be read and the tests left processes behind (one
    of them was writing it: the verdict is suspect anyway), an EvaluatorError otherwise."""
    try:
        return parse_reward(raw, source)
    except EvaluatorError as e:
        if not left:
            raise
        detail["reward_file_error"] = str(e)
        return 0.0


async def _supervised(
    task: Task, sandbox: Sandbox, argv: list[str], workdir: str | None = None, *, prepared: bool = False
):
    """The tests' run (rollout/verdict.py): the record directory made (unless `prepared` did it),
    the safe environment, and the sandbox sealed when they end; (result, what they left running)."""
    if not prepared:
        problem = await verdict.prepare(sandbox)
        if problem is not None:
            raise EvaluatorError(f"task {task.id}: cannot create {verdict.RECORD_DIR}: {problem}")
    return await verdict.run_tests(
        sandbox,
        argv,
        env=verdict.test_env(task, sandbox),
        timeout=task.evaluator.timeout_sec,
        workdir=workdir,
    )


def harbor_reward_names(tests: Path) -> list[str]:
    """The reward files a task's tests name: those of reward.txt / reward.json that appear in any
    file under its tests/ directory (test.sh, or a script it runs)."""
    named: set[str] = set()
    for p in sorted(tests.rglob("*")):
        if p.is_file() and not p.is_symlink() and p.stat().st_size <= 1 << 20:  # scripts, not data
            data = p.read_bytes()
            named.update(n for n in HARBOR_REWARD_FILES if n.encode() in data)
    return [n for n in HARBOR_REWARD_FILES if n in named]


def harbor_reward_file(named: list[str], written: list[str]) -> tuple[str | None, str]:
    """Which of /logs/verifier's files is the reward, and the rule that chose it.

    /logs/verifier is empty when the verifier starts, so whatever is there it wrote. When the
    task's tests name exactly one of reward.txt and reward.json, that one is the reward and the
    other is ignored; otherwise the one the verifier wrote, and reward.txt when it wrote both
    (Harbor's own order).
    """
    if len(named) == 1:
        return named[0], f"the task's tests name {named[0]} only"
    if len(written) == 1:
        return written[0], f"the verifier wrote {written[0]} only"
    if written:
        return written[
            0
        ], f"the verifier wrote {' and '.join(written)}; {written[0]} first, as Harbor reads them"
    return None, "the verifier wrote no reward file"


async def harbor(task: Task, sandbox: Sandbox, outcome: HarnessOutcome) -> Score:
    """Harbor's verifier contract: tests/ uploaded to /tests, `bash /tests/test.sh` run from the
    workdir, the reward read from /logs/verifier (reward.txt or reward.json, chosen by
    `harbor_reward_file`); it counts only when the verifier exits 0. /tests and /logs/verifier are
    removed and /logs/verifier created empty before the tests are copied in."""
    spec = task.evaluator
    tests = Path(spec.tests_dir) if spec.tests_dir else None
    if tests is None or not (tests / "test.sh").is_file():
        raise EvaluatorError(f"task {task.id}: {tests}/test.sh does not exist")
    # One exec: /tests and /logs/verifier cleared, and the verdict's record directory made.
    clear = f"rm -rf {HARBOR_TESTS} {HARBOR_REWARD_DIR} && mkdir -p {HARBOR_REWARD_DIR}"
    problem = await verdict.prepare(sandbox, clear)
    if problem is not None:
        made = f"{HARBOR_REWARD_DIR} or {verdict.RECORD_DIR}" if sandbox.supervises else HARBOR_REWARD_DIR
        raise EvaluatorError(f"task {task.id}: cannot create {made}: {problem}")
    await sandbox.put(tests, HARBOR_TESTS)
    r, left = await _supervised(task, sandbox, ["bash", f"{HARBOR_TESTS}/test.sh"], prepared=True)
    detail: dict[str, Any] = {
        "verifier_exit_code": r.exit_code,
        "timed_out": r.timed_out,
        "output": r.output[-DETAIL_TAIL:],
    }
    found = {n: await sandbox.read(f"{HARBOR_REWARD_DIR}/{n}") for n in HARBOR_REWARD_FILES}
    name, rule = harbor_reward_file(
        harbor_reward_names(tests), [n for n in HARBOR_REWARD_FILES if found[n] is not None]
    )
    detail["reward_file_rule"] = rule
    raw = found[name] if name is not None else None
    if name is None or raw is None:
        detail["reward_file"] = None
        await verdict.judge(0.0, detail, task=task, sandbox=sandbox, output=r.output, left=left)
        return Score(0.0, detail)
    detail["reward_file_name"] = name
    detail["reward_file"] = raw.decode("utf-8", "replace")[:1000]
    value = _reward_of(raw, f"{HARBOR_REWARD_DIR}/{name}", left, detail)
    detail["reported_reward"] = value
    reward = value if r.exit_code == 0 else 0.0
    reward = await verdict.judge(reward, detail, task=task, sandbox=sandbox, output=r.output, left=left)
    return Score(reward, detail)


_PYTEST_RESULT = re.compile(r"^(PASSED|FAILED|ERROR|XFAIL|XPASS|SKIPPED)\s+(\S+)", re.MULTILINE)


def pytest_results(output: str) -> dict[str, str]:
    """Test id → status from pytest's `-rA` summary lines (`PASSED tests/x.py::test_a`)."""
    out: dict[str, str] = {}
    for status, test in _PYTEST_RESULT.findall(output):
        out[test] = status
    return out


def patched_files(patch: str) -> list[str]:
    return sorted(set(re.findall(r"^\+\+\+ b/(\S+)", patch, re.MULTILINE)))


@dataclass(frozen=True)
class FromImage:
    """What of a task's workdir a verifier takes from the task's image, not from the agent's
    artefacts: `paths` relative to the workdir (a directory with all below it), and file `names`
    wherever they are."""

    paths: tuple[str, ...] = ()
    names: tuple[str, ...] = ()

    def covers(self, rel: str) -> bool:
        return posixpath.basename(rel) in self.names or any(
            rel == p or rel.startswith(p + "/") for p in self.paths
        )


def from_image(spec: EvaluatorSpec) -> FromImage:
    """SWE-bench: the repository (.git, which the reset uses), the files the test patch touches,
    the test files its test ids name, pytest.ini and every conftest.py come from the image; a
    conftest.py the agent added is gone. Other evaluators take the whole workdir from the agent."""
    if spec.kind != "swebench":
        return FromImage()
    files = set(patched_files(spec.test_patch or ""))
    files.update(t.split("::", 1)[0] for t in [*spec.fail_to_pass, *spec.pass_to_pass] if "::" in t)
    safe = sorted(f for f in files if f and not f.startswith("/") and ".." not in PurePosixPath(f).parts)
    return FromImage(paths=(".git", "pytest.ini", *safe), names=("conftest.py",))


async def reset_conftests(task: Task, sandbox: Sandbox) -> None:
    """In the agent's own sandbox (no fresh one): conftest.py files as the repository's HEAD holds
    them, one the agent added removed. A fresh verifier has the image's already (`from_image`)."""
    await _shell(
        sandbox,
        "git ls-files -z --others -- '*conftest.py' | xargs -0 rm -f; "
        "git checkout -q HEAD -- '*conftest.py' 2>/dev/null; true",
        task.evaluator,
        task,
    )


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
    r, left = await _supervised(task, sandbox, ["sh", "-c", spec.test_command])
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
    # SWE-bench's files hold tests outside FAIL_TO_PASS and PASS_TO_PASS that may fail as they
    # always did: pytest's totals say nothing about those two lists, so only what was left counts.
    reward = await verdict.judge(
        1.0 if resolved else 0.0,
        detail,
        task=task,
        sandbox=sandbox,
        output=r.output,
        left=left,
        check_pytest=False,
        require_report=True,
    )
    return Score(reward, detail)


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
