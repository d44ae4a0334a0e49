"""What a verifier's run may be trusted for: the tests run the agent's code, so the verdict is
read only once nothing of that run is left, and checked against a second signal.

The tests of most coding tasks execute what the agent wrote (`bash /app/solution.sh`, `import
solution`), as root, in the verifier. So:

- **Nothing outlives the tests.** `run_tests` runs the test command and, the moment it returns,
  seals the sandbox (`Sandbox.seal`: frozen, its processes listed from outside, every one ended)
  before any verdict file is read. A verifier's init reaps nothing, so a process that detached
  from the tests (a `setsid` daemon that waits for reward.txt) is still listed there, running or
  as a zombie, even when it finished its write and exited before the tests did. Any process the
  tests leave behind makes the verdict suspect.
- **In-process tricks.** The tests' environment has `PYTHONSAFEPATH=1` (a `pytest.py` or any
  module in the working directory does not shadow the real one for `python3 -m pytest`) and
  `PYTHONNOUSERSITE=1`; where the tests run pytest, pytest also writes a JUnit report to
  RECORD_DIR, a directory we create empty. `cross_check` compares that report and pytest's own
  summary line with the reward: full marks while pytest recorded failures (an `atexit` that
  turns the exit status to 0), or a reward from tests that name pytest when pytest left no
  record at all, is suspect.

A suspect verdict scores 0 (`EvaluatorSpec.on_suspect = "record"` keeps the reward and only
records why); `reward_detail.suspect` lists the reasons either way. What a cheat would still
need is in docs/threat-model.md.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from polar_mitm.sandbox.base import ExecResult, Leftover, Sandbox
from polar_mitm.tasks.model import EvaluatorSpec, Task

RECORD_DIR = "/logs/polar-mitm"  # created empty by us before the tests run
JUNIT = f"{RECORD_DIR}/pytest-junit.xml"
RECORD_LIMIT = 8 << 20  # bytes of a JUnit report read
LISTED = 20  # leftover processes named in the detail

# What the verifier's commands get on top of the task's own environment (which may override them:
# PYTHONSAFEPATH="" gives a task that imports from its working directory the old behaviour).
SAFE_PYTHON = {"PYTHONSAFEPATH": "1", "PYTHONNOUSERSITE": "1"}


def uses_pytest(spec: EvaluatorSpec) -> bool:
    """Whether the task's tests run pytest: its command names it, or a file of its tests does."""
    if spec.kind in ("command", "swebench"):
        return "pytest" in (spec.command or "") + (spec.test_command or "")
    if spec.kind == "harbor" and spec.tests_dir is not None:
        for p in Path(spec.tests_dir).rglob("*"):
            if p.is_file() and not p.is_symlink() and p.stat().st_size <= 1 << 20:
                if b"pytest" in p.read_bytes():
                    return True
    return False


def test_env(task: Task, sandbox: Sandbox) -> dict[str, str]:
    """The environment the tests run with: SAFE_PYTHON, the JUnit report where pytest runs in a
    supervised sandbox, then the task's and the evaluator's own variables."""
    spec = task.evaluator
    safe = dict(SAFE_PYTHON)
    if spec.kind == "swebench":
        # The workdir is the repository, which its tests import from (`python -m pytest` puts it
        # on sys.path): keep that, and require pytest's own report instead (see judge).
        del safe["PYTHONSAFEPATH"]
    env = {**safe, **proxy_env(sandbox), **task.env, **spec.env}
    if sandbox.supervises and uses_pytest(spec):
        own = env.get("PYTEST_ADDOPTS", "")
        env["PYTEST_ADDOPTS"] = f"--junitxml={JUNIT} {own}".strip()
    return env


def proxy_env(sandbox: Sandbox) -> dict[str, str]:
    """The proxy variables of a verifier that reaches the internet through its channel (its
    forwarder on the sandbox's own loopback; the channel puts its credentials on)."""
    if sandbox.proxy_address is None or not sandbox.supervises:
        return {}
    url = "http://{}:{}".format(*sandbox.proxy_address)
    names = ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy")
    return {**dict.fromkeys(names, url), "NO_PROXY": "localhost,127.0.0.1", "no_proxy": "localhost,127.0.0.1"}


async def prepare(sandbox: Sandbox, *first: str) -> str | None:
    """Create RECORD_DIR empty (root's, 0700) in a supervised sandbox, in one exec after `first`
    (the evaluator's own shell lines: one daemon round trip for all); an error text when any of
    it fails."""
    lines = list(first)
    if sandbox.supervises:
        q = shlex.quote(RECORD_DIR)
        lines.append(f"rm -rf {q} && mkdir -p {q} && chmod 700 {q}")
    if not lines:
        return None
    r = await sandbox.exec(["sh", "-c", "set -e\n" + "\n".join(lines)], workdir="/")
    return None if r.exit_code == 0 else r.output[-300:]


async def run_tests(
    sandbox: Sandbox,
    argv: list[str],
    *,
    env: dict[str, str],
    timeout: float | None,
    workdir: str | None = None,
) -> tuple[ExecResult, list[Leftover]]:
    """Run the tests; in a supervised sandbox, seal it the moment they end and return what they
    left behind (processes not there before they started). After this only `read` and `export`
    work on the sandbox."""
    if not sandbox.supervises:
        return await sandbox.exec(argv, env=env, timeout=timeout, workdir=workdir), []
    return await sandbox.exec_sealed(argv, env=env, timeout=timeout, workdir=workdir)


@dataclass(frozen=True)
class PytestCounts:
    passed: int = 0
    failed: int = 0
    errors: int = 0
    skipped: int = 0

    @property
    def bad(self) -> int:
        return self.failed + self.errors


_ATTR = re.compile(r'\b(tests|failures|errors|skipped)="(\d+)"')
_SUITE = re.compile(r"<testsuite\b[^>]*>")


def junit_counts(raw: bytes) -> PytestCounts | None:
    """The totals of a JUnit report's <testsuite> elements (read by pattern, not by an XML parser:
    the file is the tests' and may be hostile), or None when it holds none."""
    text = raw[:RECORD_LIMIT].decode("utf-8", "replace")
    suites = _SUITE.findall(text)
    if not suites:
        return None
    total = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    for suite in suites:
        for name, value in _ATTR.findall(suite):
            total[name] += int(value)
    bad = total["failures"] + total["errors"]
    passed = max(0, total["tests"] - bad - total["skipped"])
    return PytestCounts(passed, total["failures"], total["errors"], total["skipped"])


_SUMMARY = re.compile(r"^=*\s*((?:\d+ \w+,? ?)+) in [\d.]+s\b.*$", re.MULTILINE)
_COUNT = re.compile(r"(\d+) (passed|failed|errors?|skipped|xfailed|xpassed)")


def summary_counts(output: str) -> PytestCounts | None:
    """The counts of pytest's last summary line in `output` (`=== 1 failed, 2 passed in 0.1s ===`,
    or `-q`'s `1 failed, 2 passed in 0.1s`), or None when there is none."""
    lines = _SUMMARY.findall(output)
    if not lines:
        return None
    got: dict[str, int] = {}
    for n, word in _COUNT.findall(lines[-1]):
        key = "errors" if word.startswith("error") else word
        got[key] = got.get(key, 0) + int(n)
    if not got:
        return None
    return PytestCounts(
        got.get("passed", 0) + got.get("xfailed", 0) + got.get("xpassed", 0),
        got.get("failed", 0),
        got.get("errors", 0),
        got.get("skipped", 0),
    )


def cross_check(
    reward: float,
    *,
    pytest_named: bool,
    report: PytestCounts | None,
    summary: PytestCounts | None,
) -> list[str]:
    """Why a reward disagrees with what pytest itself recorded (empty: no disagreement).

    Only a positive reward is questioned, and failures only against full marks (a task may give
    partial credit for some tests passing)."""
    if reward <= 0 or not pytest_named:
        return []
    if report is None and summary is None:
        return ["the tests run pytest, but pytest left neither its report nor a summary line"]
    out = []
    for name, counts in (("report", report), ("summary line", summary)):
        if counts is None:
            continue
        if counts.bad and reward >= 1.0:
            out.append(
                f"pytest's {name} records {counts.failed} failed and {counts.errors} errors, "
                f"yet the reward is {reward:g}"
            )
        elif counts.passed == 0 and not counts.bad:
            out.append(f"pytest's {name} records no test that passed, yet the reward is {reward:g}")
    if report is not None and summary is not None and (report.bad == 0) != (summary.bad == 0):
        out.append("pytest's report and its summary line disagree on whether tests failed")
    return out


async def judge(
    reward: float,
    detail: dict[str, Any],
    *,
    task: Task,
    sandbox: Sandbox,
    output: str,
    left: list[Leftover],
    check_pytest: bool = True,
    require_report: bool = False,
) -> float:
    """The reward to keep once the run's evidence is weighed; records it in `detail`.
    `require_report`: a positive reward from tests that run pytest needs pytest's JUnit report
    (SWE-bench, whose totals are not compared: see evaluators.swebench)."""
    spec = task.evaluator
    reasons = []
    if require_report and reward > 0 and sandbox.supervises and uses_pytest(spec):
        if await sandbox.read(JUNIT) is None:
            reasons.append("the tests run pytest, but pytest wrote no report (was it pytest that ran?)")
    if left:
        detail["left_running"] = [p.describe() for p in left[:LISTED]]
        reasons.append(f"{len(left)} processes outlived the tests (a detached process, live or exited)")
    if check_pytest and sandbox.supervises:
        named = uses_pytest(spec)
        report = None
        if named:
            raw = await sandbox.read(JUNIT)
            report = junit_counts(raw) if raw is not None else None
        summary = summary_counts(output) if named else None
        if named:
            detail["pytest"] = {
                "report": None if report is None else report.__dict__,
                "summary": None if summary is None else summary.__dict__,
            }
        reasons += cross_check(reward, pytest_named=named, report=report, summary=summary)
    if sandbox.supervises:
        detail["supervised"] = True
    if not reasons:
        return reward
    detail["suspect"] = reasons
    detail["reported_reward"] = reward
    return reward if spec.on_suspect == "record" else 0.0
