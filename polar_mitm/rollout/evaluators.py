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
import math
import os
import posixpath
import re
import shlex
import tempfile
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from polar_mitm.rollout import verdict
from polar_mitm.sandbox.base import READ_LIMIT, Sandbox, Unreadable
from polar_mitm.tasks.model import EvaluatorSpec, Task

DETAIL_TAIL = 4000  # characters of verifier output kept in the detail
HARBOR_TESTS = "/tests"
HARBOR_REWARD_DIR = "/logs/verifier"
HARBOR_REWARD_FILES = ("reward.txt", "reward.json")
# Where SWE-bench's test patch is copied in: not /tmp, a tmpfs in a container with --tmp-size,
# which the daemon's archive copy cannot write into.
TEST_PATCH_PATH = "/var/tmp/polar_mitm_test.patch"


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


class RewardFileError(ValueError):
    """A reward file the verifier's run left that gives no reward: empty, not a number, not an
    object of finite numbers. A result (0, suspect), never an infrastructure failure."""


def parse_rewards(raw: bytes | str, name: str) -> dict[str, float]:
    """A reward file's rewards, read as Harbor reads them: reward.txt holds one finite number
    (`{"reward": x}`); reward.json an object of finite numbers, every key kept (a bare number is
    `{"reward": x}`). Empty, non-numeric or non-finite: RewardFileError."""
    text = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw
    if not text.strip():
        raise RewardFileError(f"{name} is empty")
    if not name.endswith(".json"):
        try:
            value = float(text)
        except ValueError:
            raise RewardFileError(f"{name}: not a number: {text[:80]!r}") from None
        if not math.isfinite(value):
            raise RewardFileError(f"{name}: not a finite number: {text[:80]!r}")
        return {"reward": value}
    try:
        data = json.loads(text)
    except ValueError:
        raise RewardFileError(f"{name}: not JSON: {text[:80]!r}") from None
    if isinstance(data, (int, float)) and not isinstance(data, bool):
        data = {"reward": data}
    if not isinstance(data, dict) or not data:
        raise RewardFileError(f"{name}: expected an object of numbers, got {text[:80]!r}")
    out: dict[str, float] = {}
    for key, value in data.items():
        if not isinstance(value, (int, float)) or not math.isfinite(value):
            raise RewardFileError(f"{name}: {str(key)[:40]!r} is not a finite number: {str(value)[:40]!r}")
        out[str(key)] = float(value)
    return out


AGGREGATES = ("mean", "min", "max")


def reward_of(rewards: dict[str, float], key: str | None) -> tuple[float, str]:
    """The one number a trainer gets from a verifier's rewards, and the rule that chose it.
    `key`: a key of the rewards, or an aggregate of them all (`mean`, `min`, `max`); None:
    `reward` where it is there, else the only value, else the mean (Harbor keeps every key and
    leaves the choice to its metrics)."""
    if key is None:
        if "reward" in rewards:
            return rewards["reward"], "the 'reward' key"
        if len(rewards) == 1:
            [(only, value)] = rewards.items()
            return value, f"the only key, {only!r}"
        key = "mean"
    if key in AGGREGATES:
        values = list(rewards.values())
        agg = {"mean": sum(values) / len(values), "min": min(values), "max": max(values)}[key]
        return agg, f"the {key} of {len(values)} keys"
    if key not in rewards:
        raise RewardFileError(
            f"the rewards have no {key!r} (the reward key asked for): {sorted(rewards)[:10]}"
        )
    return rewards[key], f"the {key!r} key (asked for)"


def parse_reward(raw: bytes | str, source: str) -> float:
    """A reward file's one number (`parse_rewards`, then `reward_of` without a key)."""
    return reward_of(parse_rewards(raw, source), None)[0]


async def _shell(sandbox: Sandbox, line: str, spec: EvaluatorSpec, task: Task):
    return await sandbox.exec(
        ["sh", "-c", line], env=verdict.test_env(task, sandbox), timeout=spec.timeout_sec
    )


async def session_completed(
    task: Task, sandbox: Sandbox, outcome: HarnessOutcome, setup: verdict.Setup | None = None
) -> Score:
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


async def read_reward_file(sandbox: Sandbox, path: str, detail: dict[str, Any]) -> bytes | None:
    """A reward file, read strictly (`Sandbox.read`: a regular file of at most READ_LIMIT
    bytes); None, with why in `detail["reward_file_error"]`, when it is not there or not that."""
    try:
        raw = await sandbox.read(path, READ_LIMIT)
    except Unreadable as e:
        detail["reward_file_error"] = str(e)
        return None
    if raw is None:
        detail["reward_file_error"] = f"{path} was not written"
    return raw


def rewards_from(raw: bytes | None, name: str, key: str | None, detail: dict[str, Any]) -> float | None:
    """The reward in a reward file's bytes (None: none, with why in the detail); every key of
    the file kept in `detail["rewards"]`."""
    if raw is None:
        return None
    detail["reward_file"] = raw.decode("utf-8", "replace")[:1000]
    try:
        rewards = parse_rewards(raw, name)
        value, rule = reward_of(rewards, key)
    except RewardFileError as e:
        detail["reward_file_error"] = str(e)
        return None
    detail["rewards"] = rewards
    detail["reward_rule"] = rule
    return value


async def command(
    task: Task, sandbox: Sandbox, outcome: HarnessOutcome, setup: verdict.Setup | None = None
) -> Score:
    """`command` run in the workdir; 1.0 when it exits 0, or the value of `reward_file`, which
    counts only when the command exits 0 within its time.

    The reward file (relative to the workdir, or absolute) is removed before the command runs, so
    only what the command itself writes counts, never a file the agent left among its artefacts.
    A reward file the run left missing, unreadable or unparseable scores 0, as suspect.
    """
    spec = task.evaluator
    assert spec.command is not None
    reward_path = posixpath.join(sandbox.workdir, spec.reward_file) if spec.reward_file else None
    if reward_path is not None:
        rm = await sandbox.exec(["rm", "-rf", "--", reward_path], workdir="/")
        if rm.exit_code != 0:
            raise EvaluatorError(f"task {task.id}: cannot clear {reward_path}: {rm.output[-300:]}")
    r, left = await _supervised(task, sandbox, ["sh", "-c", spec.command], setup=setup)
    detail: dict[str, Any] = {
        "exit_code": r.exit_code,
        "timed_out": r.timed_out,
        "output": r.output[-DETAIL_TAIL:],
    }
    ok = r.exit_code == 0 and not r.timed_out
    reward = 1.0 if ok else 0.0
    problems = []
    if r.timed_out:
        problems.append(f"the verifier ran past its {spec.timeout_sec:g} s and was killed")
    if reward_path is not None:
        raw = await read_reward_file(sandbox, reward_path, detail)
        value = rewards_from(raw, posixpath.basename(reward_path), spec.reward_key, detail)
        if value is not None:
            detail["reported_reward"] = value
        if not ok:
            reward = 0.0  # the reward file counts only from a run that ended well
        elif value is None:
            reward = 0.0
            problems.append(detail.get("reward_file_error") or "no reward")
        else:
            reward = value
    reward = await verdict.judge(
        reward, detail, task=task, sandbox=sandbox, output=r.output, left=left, setup=setup, problems=problems
    )
    return Score(reward, detail)


async def _supervised(
    task: Task,
    sandbox: Sandbox,
    argv: list[str],
    workdir: str | None = None,
    *,
    prepared: bool = False,
    setup: verdict.Setup | None = None,
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
        env=verdict.test_env(task, sandbox, setup),
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


def harbor_reward_order(named: list[str]) -> tuple[list[str], str]:
    """The reward files to look for, in order, and the rule: Harbor reads reward.json when it
    is there, else reward.txt. When the task's tests name exactly one of the two, only that one
    counts: the other could only have been written by the agent's code the tests ran."""
    if len(named) == 1:
        return named, f"the task's tests name {named[0]} only"
    return ["reward.json", "reward.txt"], "reward.json when it was written, else reward.txt (Harbor's order)"


def exit_problems(code: int, value: float, rewards: dict[str, float]) -> list[str]:
    """What a test script's exit status says against the reward it left. Harbor ignores the
    status, so a partial reward from tests that then exit non-zero counts; but a script ended by
    a signal did not finish, and one that failed while its reward file says full marks did not
    write that file after its last check: both are what the agent's code does when it writes
    the reward itself and then stops (or kills) the tests that ran it."""
    if code >= 128 and value > 0:
        return [f"the test script was ended by signal {code - 128}, yet a reward of {value:g} was left"]
    if code != 0 and rewards and all(v >= 1.0 for v in rewards.values()):
        return [f"the test script failed (exit {code}), yet its reward file says full marks"]
    return []


async def harbor(
    task: Task, sandbox: Sandbox, outcome: HarnessOutcome, setup: verdict.Setup | None = None
) -> Score:
    """Harbor's verifier contract: tests/ at /tests (shown read-only from a pristine copy where the
    sandbox can: `setup.tests_mounted`; copied in otherwise), the test script run from the
    workdir, the reward read from /logs/verifier (`harbor_reward_order`), whatever the script's
    exit status, as Harbor does: whether a reward is trusted is the seal's, the canary's and
    pytest's records' to say (rollout/verdict.py). /logs/verifier is created empty before the
    tests run. A verifier that timed out, or a reward file missing, unreadable or unparseable,
    scores 0 as a result, with the cause under `suspect`."""
    spec = task.evaluator
    tests = Path(spec.tests_dir) if spec.tests_dir else None
    if tests is None or not (tests / "test.sh").is_file():
        raise EvaluatorError(f"task {task.id}: {tests}/test.sh does not exist")
    mounted = setup is not None and setup.tests_mounted
    # One exec: /tests (unless it is our read-only mount) and /logs/verifier cleared, and the
    # verdict's record directory made.
    clear = f"rm -rf {HARBOR_REWARD_DIR} && mkdir -p {HARBOR_REWARD_DIR}"
    if not mounted:
        clear = f"rm -rf {HARBOR_TESTS} && {clear}"
    problem = await verdict.prepare(sandbox, clear)
    if problem is not None:
        made = f"{HARBOR_REWARD_DIR} or {verdict.RECORD_DIR}" if sandbox.supervises else HARBOR_REWARD_DIR
        raise EvaluatorError(f"task {task.id}: cannot create {made}: {problem}")
    if not mounted:
        await sandbox.put(tests, HARBOR_TESTS)
    # Harbor runs the script itself (its shebang decides); `bash` where it is not executable.
    script = f"{HARBOR_TESTS}/test.sh"
    argv = [script] if mounted or os.access(tests / "test.sh", os.X_OK) else ["bash", script]
    r, left = await _supervised(task, sandbox, argv, prepared=True, setup=setup)
    detail: dict[str, Any] = {
        "verifier_exit_code": r.exit_code,
        "timed_out": r.timed_out,
        "output": r.output[-DETAIL_TAIL:],
        "tests": "read-only, from a pristine copy" if mounted else "copied in",
    }
    order, rule = harbor_reward_order(harbor_reward_names(tests))
    detail["reward_file_rule"] = rule
    raw, name = None, None
    for candidate in order:  # the first that is there, read strictly; anything else there stops it
        try:
            raw = await sandbox.read(f"{HARBOR_REWARD_DIR}/{candidate}", READ_LIMIT)
        except Unreadable as e:
            detail["reward_file_error"], name = str(e), candidate
            break
        if raw is not None:
            name = candidate
            break
    if raw is None and "reward_file_error" not in detail:
        detail["reward_file_error"] = f"the verifier wrote no reward file ({' nor '.join(order)})"
    detail["reward_file_name"] = name
    value = rewards_from(raw, name or "reward", spec.reward_key, detail)
    problems = []
    if r.timed_out:
        problems.append(f"the verifier ran past its {spec.timeout_sec:g} s and was killed")
    elif value is None:
        problems.append(str(detail.get("reward_file_error") or "no reward"))
    else:
        problems += exit_problems(r.exit_code, value, detail.get("rewards") or {})
    if value is not None:
        detail["reported_reward"] = value
    reward = value if value is not None and not r.timed_out else 0.0
    reward = await verdict.judge(
        reward, detail, task=task, sandbox=sandbox, output=r.output, left=left, setup=setup, problems=problems
    )
    return Score(reward, detail)


_PYTEST_RESULT = re.compile(r"^(PASSED|FAILED|ERROR|XFAIL|XPASS|SKIPPED)\s+(\S+)", re.MULTILINE)


def pytest_results(output: str) -> dict[str, str]:
    """Test id → status from pytest's `-rA` summary lines (`PASSED tests/x.py::test_a`); the
    first line of an id wins: a line printed later (by the code under test, at exit) cannot
    override what pytest reported (`pytest_repeats` names the ids printed more than once)."""
    out: dict[str, str] = {}
    for status, test in _PYTEST_RESULT.findall(output):
        out.setdefault(test, status)
    return out


def pytest_repeats(output: str) -> list[str]:
    """The test ids with more than one status line in `output`: pytest prints each once."""
    seen: dict[str, int] = {}
    for _status, test in _PYTEST_RESULT.findall(output):
        seen[test] = seen.get(test, 0) + 1
    return [t for t, n in seen.items() if n > 1]


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


async def swebench(
    task: Task, sandbox: Sandbox, outcome: HarnessOutcome, setup: verdict.Setup | None = None
) -> Score:
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
            await sandbox.put(Path(f.name), TEST_PATCH_PATH)
        finally:
            Path(f.name).unlink(missing_ok=True)
        ap = await _shell(
            sandbox,
            f"git apply -v {TEST_PATCH_PATH} || patch -p1 --forward < {TEST_PATCH_PATH}",
            spec,
            task,
        )
        detail["test_patch_applied"] = ap.exit_code == 0
        if ap.exit_code != 0:
            detail["output"] = ap.output[-DETAIL_TAIL:]
            return Score(0.0, detail)
    r, left = await _supervised(task, sandbox, ["sh", "-c", spec.test_command], setup=setup)
    printed = pytest_results(r.output)
    wanted = [*spec.fail_to_pass, *spec.pass_to_pass]
    reported = await verdict.junit_results(sandbox, wanted) if sandbox.supervises else None
    f2p = {t: printed.get(t, "MISSING") for t in spec.fail_to_pass}
    p2p = {t: printed.get(t, "MISSING") for t in spec.pass_to_pass}
    resolved = all(s in ("PASSED", "XFAIL") for s in [*f2p.values(), *p2p.values()])
    problems = []
    repeated = sorted(set(pytest_repeats(r.output)) & set(wanted))
    if repeated:
        problems.append(f"{len(repeated)} test ids printed with more than one status: {repeated[:5]}")
    if reported is not None:
        differ = [t for t in wanted if _agrees(printed.get(t, "MISSING"), reported.get(t)) is False]
        if differ:
            problems.append(f"pytest's report and its printed results differ on {differ[:5]}")
        resolved = resolved and not differ
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
    if reported is not None:
        detail["reported"] = {t: reported.get(t, "missing") for t in wanted[:200]}
    if r.timed_out:
        problems.append(f"the tests ran past their {spec.timeout_sec:g} s and were killed")
    # SWE-bench's files hold tests outside FAIL_TO_PASS and PASS_TO_PASS that may fail as they
    # always did: pytest's totals say nothing about those two lists, so only what was left counts.
    reward = await verdict.judge(
        1.0 if resolved and not r.timed_out else 0.0,
        detail,
        task=task,
        sandbox=sandbox,
        output=r.output,
        left=left,
        check_pytest=False,
        require_report=True,
        setup=setup,
        problems=problems,
        wanted=wanted,
    )
    return Score(reward, detail)


def _agrees(printed: str, reported: str | None) -> bool | None:
    """Whether a printed status and the JUnit report's agree on passing (None: no report line)."""
    if reported is None:
        return False if printed in ("PASSED", "XFAIL") else None
    return (printed in ("PASSED", "XFAIL")) == (reported in ("passed", "xfailed"))


EVALUATORS = {
    "session_completed": session_completed,
    "command": command,
    "harbor": harbor,
    "swebench": swebench,
}


async def evaluate(
    task: Task, sandbox: Sandbox, outcome: HarnessOutcome, setup: verdict.Setup | None = None
) -> Score:
    """The sample's score by its task's evaluator; `setup`: what the verifier's sandbox was given
    for it (the tests read-only, the canary), decided where the verifier was started."""
    score = await EVALUATORS[task.evaluator.kind](task, sandbox, outcome, setup)
    score.detail.setdefault("evaluator", task.evaluator.kind)
    return score
