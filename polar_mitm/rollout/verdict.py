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

import html
import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from polar_mitm.rollout.canary import Canary, Record, canary_reasons, read_record
from polar_mitm.sandbox.base import ExecResult, Leftover, Sandbox, Unreadable
from polar_mitm.tasks.model import EvaluatorSpec, Task

RECORD_DIR = "/logs/polar-mitm"  # created empty by us before the tests run
JUNIT = f"{RECORD_DIR}/pytest-junit.xml"
RECORD_LIMIT = 8 << 20  # bytes of a JUnit report read
LISTED = 20  # leftover processes named in the detail

# What the verifier's commands get on top of the task's own environment (which may override them:
# PYTHONSAFEPATH="" gives a task that imports from its working directory the old behaviour).
SAFE_PYTHON = {"PYTHONSAFEPATH": "1", "PYTHONNOUSERSITE": "1"}


# The checks `judge` weighs, by name; a test may narrow them to show what one catches alone.
CHECKS = frozenset({"leftovers", "pytest_report", "canary", "per_test", "reward_file"})


@dataclass(frozen=True)
class Setup:
    """What a verifier's sandbox was given for its run, decided where it was started
    (rollout/verify.py): the tests shown read-only at /tests from a pristine host copy, and the
    canary's plugin (rollout/canary.py) shown read-only for pytest to load."""

    tests_mounted: bool = False
    canary: Canary | None = None
    # In shared mode: what the agent changed of what the tests start with (verify.LAUNCH_PATHS).
    tampered: tuple[str, ...] = ()


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


def test_env(task: Task, sandbox: Sandbox, setup: Setup | None = None) -> dict[str, str]:
    """The environment the tests run with: SAFE_PYTHON, the JUnit report and the canary's plugin
    where pytest runs in a supervised sandbox, then the task's and the evaluator's own variables."""
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
        if setup is not None and setup.canary is not None:
            env = setup.canary.env(env)
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


_CASE = re.compile(r"<testcase\b([^>]*?)(/>|>(.*?)</testcase>)", re.DOTALL)
_CASE_ATTR = re.compile(r'\b(classname|name)="([^"]*)"')


def junit_name(nodeid: str) -> tuple[str, str]:
    """The (classname, name) pytest's JUnit report gives a test id: the path's separators as
    dots without `.py`, classes after it, the parameters kept on the name."""
    path, bracket, params = nodeid.partition("[")
    names = path.split("::")
    names[0] = re.sub(r"\.py$", "", names[0].replace("/", "."))
    names[-1] += bracket + params
    return ".".join(names[:-1]), names[-1]


def junit_cases(raw: bytes) -> dict[tuple[str, str], str]:
    """(classname, name) → passed / failed / error / skipped / xfailed for every <testcase> of a
    JUnit report (read by pattern: the file is the tests' and may be hostile); a case listed
    twice keeps its first entry."""
    out: dict[tuple[str, str], str] = {}
    for attrs, _end, body in _CASE.findall(raw[:RECORD_LIMIT].decode("utf-8", "replace")):
        a = {k: html.unescape(v) for k, v in _CASE_ATTR.findall(attrs)}
        body = body or ""
        if "<failure" in body:
            status = "failed"
        elif "<error" in body:
            status = "error"
        elif "<skipped" in body:
            status = "xfailed" if "pytest.xfail" in body else "skipped"
        else:
            status = "passed"
        out.setdefault((a.get("classname", ""), a.get("name", "")), status)
    return out


async def read_bounded(
    sandbox: Sandbox, path: str, limit: int = RECORD_LIMIT
) -> tuple[bytes | None, str | None]:
    """A record file read strictly: (its bytes, None), (None, None) when absent, (None, why)
    when something else stands there."""
    try:
        return await sandbox.read(path, limit), None
    except Unreadable as e:
        return None, str(e)


async def junit_results(sandbox: Sandbox, wanted: list[str]) -> dict[str, str] | None:
    """The status pytest's JUnit report gives each of `wanted` (an id it does not list is left
    out), or None when there is no report."""
    raw, _why = await read_bounded(sandbox, JUNIT)
    if raw is None:
        return None
    cases = junit_cases(raw)
    return {t: cases[junit_name(t)] for t in wanted if junit_name(t) in cases}


def record_reasons(record: Record, report: PytestCounts | None, summary: PytestCounts | None) -> list[str]:
    """Where what pytest reported as it ran (the canary plugin's record of its last session)
    disagrees with its JUnit report or its summary line: one of them was rewritten."""
    if not record.sessions:
        return []
    counts = record.sessions[-1].counts
    seen = PytestCounts(
        counts.get("passed", 0), counts.get("failed", 0), counts.get("errors", 0), counts.get("skipped", 0)
    )
    out = []
    for name, other in (("JUnit report", report), ("summary line", summary)):
        if other is not None and (other.bad != seen.bad or other.passed != seen.passed):
            out.append(
                f"pytest's {name} says {other.passed} passed and {other.bad} failed, but as it ran pytest "
                f"reported {seen.passed} passed and {seen.bad} failed"
            )
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
    setup: Setup | None = None,
    problems: list[str] | None = None,
    wanted: list[str] | None = None,
) -> float:
    """The reward to keep once the run's evidence is weighed; records it in `detail`.
    `problems`: what the evaluator found already (a timeout, a reward file missing or
    unreadable): the verdict is 0 and they are its cause. `require_report`: a positive reward
    from tests that run pytest needs pytest's JUnit report (SWE-bench, whose totals are not
    compared: see evaluators.swebench; `wanted` its test ids, held to the canary's record)."""
    spec = task.evaluator
    reasons = list(problems or []) if "reward_file" in CHECKS else []
    if setup is not None and setup.tampered and reward > 0:
        reasons.append(f"the agent changed what the tests start with: {list(setup.tampered)[:5]}")
    named = sandbox.supervises and uses_pytest(spec)
    report_raw, report_problem = (None, None)
    if named:
        report_raw, report_problem = await read_bounded(sandbox, JUNIT)
        if report_problem is not None and reward > 0 and "pytest_report" in CHECKS:
            reasons.append(f"pytest's report is not a file we can read: {report_problem}")
    if require_report and reward > 0 and named and report_raw is None and "pytest_report" in CHECKS:
        reasons.append("the tests run pytest, but pytest wrote no report (was it pytest that ran?)")
    if left and "leftovers" in CHECKS:
        detail["left_running"] = [p.describe() for p in left[:LISTED]]
        reasons.append(f"{len(left)} processes outlived the tests (a detached process, live or exited)")
    report = junit_counts(report_raw) if report_raw is not None else None
    summary = summary_counts(output) if named else None
    if named and check_pytest:
        detail["pytest"] = {
            "report": None if report is None else report.__dict__,
            "summary": None if summary is None else summary.__dict__,
        }
        if "pytest_report" in CHECKS:
            reasons += cross_check(reward, pytest_named=named, report=report, summary=summary)
    canary = setup.canary if setup is not None else None
    if named and canary is not None and reward > 0:
        reasons += await _canary_reasons(
            sandbox, canary, report_raw, report, summary, check_pytest, wanted, detail
        )
    if sandbox.supervises:
        detail["supervised"] = True
    if not reasons:
        return reward
    detail["suspect"] = reasons
    detail.setdefault("reported_reward", reward)
    return reward if spec.on_suspect == "record" else 0.0


async def _canary_reasons(
    sandbox: Sandbox,
    canary: Canary,
    report_raw: bytes | None,
    report: PytestCounts | None,
    summary: PytestCounts | None,
    totals: bool,
    wanted: list[str] | None,
    detail: dict[str, Any],
) -> list[str]:
    raw, problem = await read_bounded(sandbox, canary.record)
    out: list[str] = []
    if problem is not None:
        return [f"the canary's record is not a file we can read: {problem}"] if "canary" in CHECKS else []
    if raw is None:
        detail["canary"] = {"record": None}
        if report_raw is not None and "canary" in CHECKS:
            out.append(
                "pytest's report is there but the canary's record is not (removed, or pytest ran without it)"
            )
        return out
    record = read_record(raw)
    detail["canary"] = {
        "runs": record.starts,
        "finished": len(record.sessions),
        "outcomes": [(s.canary or {}).get("outcome") for s in record.sessions[:10]],
    }
    if "canary" in CHECKS:
        out += canary_reasons(record)
        if totals:
            out += record_reasons(record, report, summary)
    if wanted and record.sessions and "per_test" in CHECKS:
        seen = record.sessions[-1].tests
        differ = [t for t in wanted if seen.get(t, "missing") not in ("passed",)]
        if differ:
            out.append(f"as it ran, pytest reported {differ[:5]} as not passed")
    return out
