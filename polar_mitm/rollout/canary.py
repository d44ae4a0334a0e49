"""The canary: a forged pytest pass caught without knowing the trick.

Where the tests import the agent's code, that code runs inside pytest's own process and can
forge what pytest reports (patch `TestReport`, wrap `pytest_runtest_makereport`, rewrite the
JUnit report at exit, print a summary line of its own). It cannot be prevented; it can be caught.
Each verifier run gets a pytest plugin of ours, generated per sample under a random module name
and shown read-only in the verifier (`Canary.write`, passed with `-p` through PYTEST_ADDOPTS):

- after the tests' own loop it runs one more test, named at random, that must fail (it raises
  an AssertionError carrying a secret). It is run through pytest's own report machinery (so a
  forgery of that machinery reaches it too) but logged nowhere: no summary line, exit status,
  JUnit or JSON report of the task's ever sees it, and honest runs are scored exactly as before;
- it records, as pytest reports them, every test's outcome and the totals, appended as JSON
  lines to a file of its own (a random name in the record directory, root's and 0700).

`findings` reads that record against pytest's JUnit report and its summary line: a canary
reported as anything but its own failure, a run that started but never finished, a record
missing while pytest's report is there, or totals that disagree, make the verdict suspect. None
of these is a rule for a particular trick: each follows from the forgery itself. What a cheat
would still need (to find this plugin by name in its own process and forge its record too) is
in docs/threat-model.md.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any

RECORD_LINES = 64  # pytest sessions read from a record (one line each, plus their starts)
TESTS_RECORDED = 20_000  # per-test outcomes a session records


@dataclass(frozen=True)
class Canary:
    """One verifier run's canary: the plugin's module name, where the verifier sees it, the test
    that must fail, its secret, and the record file."""

    module: str
    mount: str  # the sandbox directory holding the module (read-only)
    test: str
    secret: str
    record: str  # the sandbox path of the record

    @classmethod
    def new(cls, record_dir: str) -> Canary:
        tag = secrets.token_hex(6)
        return cls(
            module=f"_pm_{tag}",
            mount=f"/opt/pm-{secrets.token_hex(6)}",
            test=f"test_{secrets.token_hex(5)}",
            secret=secrets.token_hex(16),
            record=f"{record_dir}/{secrets.token_hex(8)}.jsonl",
        )

    def write(self, host_dir: Path) -> Path:
        """The plugin module written into `host_dir` (made, 0755; the module 0644), to be shown
        read-only at `mount`; returns `host_dir`."""
        host_dir.mkdir(parents=True, exist_ok=True)
        host_dir.chmod(0o755)
        path = host_dir / f"{self.module}.py"
        path.write_text(
            PLUGIN.replace("@RECORD@", repr(self.record))
            .replace("@NAME@", repr(self.test))
            .replace("@SECRET@", repr(self.secret))
            .replace("@LIMIT@", str(TESTS_RECORDED))
        )
        path.chmod(0o644)
        return host_dir

    def env(self, env: dict[str, str]) -> dict[str, str]:
        """`env` with the plugin loaded by every pytest the tests start: its directory first on
        PYTHONPATH, `-p MODULE` in PYTEST_ADDOPTS (both kept as the task set them, after ours)."""
        out = dict(env)
        path = out.get("PYTHONPATH", "")
        out["PYTHONPATH"] = f"{self.mount}:{path}" if path else self.mount
        out["PYTEST_ADDOPTS"] = f"-p {self.module} {out.get('PYTEST_ADDOPTS', '')}".strip()
        return out


# The plugin's text: plain Python 3.6+ and pytest 6+, nothing imported but json, os and pytest;
# every step guarded, so a pytest it does not fit runs as it would without it.
PLUGIN = '''"""Generated for one verifier run: a test that must fail, and a record of what pytest reported."""
import json
import os

import pytest

_RECORD = @RECORD@
_NAME = @NAME@
_SECRET = @SECRET@
_LIMIT = @LIMIT@
_tests = {}
_counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
_state = {"canary": None, "worker": False}


def _write(entry):
    try:
        fd = os.open(_RECORD, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, (json.dumps(entry) + "\\n").encode())
        finally:
            os.close(fd)
    except Exception:
        pass


def pytest_configure(config):
    _state["worker"] = hasattr(config, "workerinput")  # xdist's workers: their controller records
    if not _state["worker"]:
        _write({"event": "start", "pid": os.getpid()})


def _status(report):
    if report.when == "call":
        if getattr(report, "wasxfail", None) is not None:
            return "skipped" if report.skipped else "passed"
        return report.outcome
    if report.failed:
        return "errors"
    if report.skipped:
        return "skipped"
    return None


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_logreport(report):
    if _state["worker"]:
        return
    try:
        status = _status(report)
        if status is None:
            return
        _counts[status] += 1
        if len(_tests) < _LIMIT and _tests.get(report.nodeid) in (None, "passed"):
            _tests[report.nodeid] = status if status != "errors" else "error"
    except Exception:
        pass


class _Canary(pytest.Item):
    def runtest(self):
        raise AssertionError(_SECRET)

    def reportinfo(self):
        return getattr(self, "path", None) or self.fspath, 0, self.name


@pytest.hookimpl(hookwrapper=True)
def pytest_runtestloop(session):
    yield
    if _state["worker"] or session.config.option.collectonly:
        return
    try:
        from _pytest.runner import runtestprotocol

        item = _Canary.from_parent(session, name=_NAME)
        reports = runtestprotocol(item, nextitem=None, log=False)
        call = [r for r in reports if r.when == "call"]
        outcome = call[0].outcome if call else "not run"
        _state["canary"] = {"outcome": outcome, "secret": bool(call) and _SECRET in str(call[0].longrepr)}
    except Exception as e:
        _state["canary"] = {"outcome": "unavailable", "error": repr(e)[:200]}


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus):
    if _state["worker"]:
        return
    _write({
        "event": "finish",
        "pid": os.getpid(),
        "canary": _state["canary"],
        "counts": _counts,
        "tests": _tests,
        "exitstatus": int(exitstatus),
    })
'''


@dataclass
class Session:
    canary: dict[str, Any] | None
    counts: dict[str, int]
    tests: dict[str, str]
    exitstatus: int | None


@dataclass
class Record:
    starts: int
    sessions: list[Session]


def _dict(value: Any) -> dict[str, Any] | None:
    return value if isinstance(value, dict) else None


def read_record(raw: bytes) -> Record:
    """The record's lines (a line that is not one of the plugin's is skipped: it proves nothing
    either way)."""
    starts, sessions = 0, []
    for line in raw.splitlines()[: RECORD_LINES * 2]:
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if not isinstance(entry, dict):
            continue
        if entry.get("event") == "start":
            starts += 1
        elif entry.get("event") == "finish":
            counts = _dict(entry.get("counts")) or {}
            tests = _dict(entry.get("tests")) or {}
            canary = _dict(entry.get("canary"))
            status = entry.get("exitstatus")
            sessions.append(
                Session(
                    canary,
                    {k: int(v) for k, v in counts.items() if isinstance(v, int)},
                    {str(k): str(v) for k, v in tests.items()},
                    status if isinstance(status, int) else None,
                )
            )
    return Record(starts, sessions)


def canary_reasons(record: Record) -> list[str]:
    """Why the record says pytest's reports were forged (empty: it does not)."""
    out = []
    if record.starts > len(record.sessions):
        out.append(
            f"{record.starts - len(record.sessions)} of {record.starts} pytest runs started and never "
            "finished (the process ended from inside the tests)"
        )
    for s in record.sessions:
        c = s.canary or {}
        if c.get("outcome") == "unavailable" or s.canary is None:
            continue  # the plugin could not run its test here: no evidence either way
        if c.get("outcome") != "failed" or not c.get("secret"):
            out.append(
                f"the canary, a test that must fail, was reported {c.get('outcome')!r}: pytest's own "
                "reports are forged in its process"
            )
    return out
