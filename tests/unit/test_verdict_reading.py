"""How a verdict is read: reward files as Harbor reads them, strictly (a regular file of the
expected name, bounded) whatever the sandbox left there, and per-test results a later line or a
rewritten report cannot override."""

from __future__ import annotations

import io
import json
import math
import os
import tarfile

import pytest
from hypothesis import given
from hypothesis import strategies as st

from polar_mitm.rollout.canary import canary_reasons, read_record
from polar_mitm.rollout.evaluators import (
    RewardFileError,
    harbor_reward_order,
    parse_rewards,
    pytest_repeats,
    pytest_results,
    reward_of,
)
from polar_mitm.rollout.verdict import junit_cases, junit_name, record_reasons, summary_counts
from polar_mitm.sandbox.base import Unreadable
from polar_mitm.sandbox.untrusted import read_beneath, tar_file


def test_reward_files_are_read_as_harbor_reads_them():
    assert parse_rewards(b"1\n", "reward.txt") == {"reward": 1.0}
    assert parse_rewards(b" 0.25 ", "reward.txt") == {"reward": 0.25}
    # Every key of a multi-key reward.json is kept (Harbor's metrics are per key).
    assert parse_rewards(b'{"correctness": 1, "performance": 0.5}', "reward.json") == {
        "correctness": 1.0,
        "performance": 0.5,
    }
    assert parse_rewards(b"0.5", "reward.json") == {"reward": 0.5}
    for raw, name in [
        (b"", "reward.txt"),
        (b"  \n", "reward.json"),
        (b"yes", "reward.txt"),
        (b"nan", "reward.txt"),
        (b"inf", "reward.txt"),
        (b'{"a": "1"}', "reward.json"),
        (b'{"a": NaN}', "reward.json"),
        (b'{"a": 1e999}', "reward.json"),
        (b"[1]", "reward.json"),
        (b"{}", "reward.json"),
    ]:
        with pytest.raises(RewardFileError):
            parse_rewards(raw, name)


def test_the_trainers_number_is_chosen_by_a_declared_key_or_an_aggregate():
    both = {"correctness": 1.0, "performance": 0.5}
    assert reward_of({"reward": 0.3, "x": 1.0}, None)[0] == 0.3
    assert reward_of({"accuracy": 0.7}, None)[0] == 0.7
    assert reward_of(both, None) == (0.75, "the mean of 2 keys")
    assert reward_of(both, "performance")[0] == 0.5
    assert reward_of(both, "min")[0] == 0.5 and reward_of(both, "max")[0] == 1.0
    with pytest.raises(RewardFileError, match="no 'speed'"):
        reward_of(both, "speed")


def test_reward_json_first_unless_the_tests_name_one_file_only():
    assert harbor_reward_order([])[0] == ["reward.json", "reward.txt"]
    assert harbor_reward_order(["reward.txt", "reward.json"])[0] == ["reward.json", "reward.txt"]
    # Tests that write reward.txt only: a reward.json could only be the agent's code's.
    assert harbor_reward_order(["reward.txt"]) == (["reward.txt"], "the task's tests name reward.txt only")


@given(st.floats(allow_nan=False, allow_infinity=False))
def test_a_finite_number_reads_back_bit_for_bit(x):
    assert parse_rewards(repr(x).encode(), "reward.txt") == {"reward": x}
    assert parse_rewards(json.dumps({"k": x}).encode(), "reward.json") == {"k": x}


@given(st.binary(max_size=200))
def test_any_bytes_give_rewards_or_a_reward_file_error(raw):
    for name in ("reward.txt", "reward.json"):
        try:
            out = parse_rewards(raw, name)
        except RewardFileError:
            continue
        assert out and all(math.isfinite(v) for v in out.values())


def tar_of(*members: tuple[tarfile.TarInfo, bytes | None]) -> list[bytes]:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for info, data in members:
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    raw = buf.getvalue()
    return [raw[i : i + 1000] for i in range(0, len(raw), 1000)]  # a daemon's chunks


def info(name: str, kind: bytes = tarfile.REGTYPE, size: int = 0, link: str = "") -> tarfile.TarInfo:
    i = tarfile.TarInfo(name)
    i.type, i.size, i.linkname = kind, size, link
    return i


def test_a_tar_read_takes_only_the_regular_file_of_that_name_within_its_bound():
    assert (
        tar_file(iter(tar_of((info("reward.txt", size=2), b"1\n"))), "/logs/verifier/reward.txt", 64)
        == b"1\n"
    )
    cases = {
        "a directory": [(info("reward.txt", tarfile.DIRTYPE), None), (info("reward.txt/1", size=1), b"1")],
        "a link": [(info("reward.txt", tarfile.SYMTYPE, link="/app/one"), None)],
        "another name": [(info("reward.json", size=1), b"1")],
        "more than": [(info("reward.txt", size=100), b"1" * 100)],
    }
    for want, members in cases.items():
        with pytest.raises(Unreadable, match=want if want != "another name" else "holds 'reward.json'"):
            tar_file(iter(tar_of(*members)), "/logs/verifier/reward.txt", 64)


def test_a_huge_member_is_refused_by_its_header_without_reading_its_bytes():
    header = info("reward.json", size=10 << 30)
    head = header.tobuf(format=tarfile.GNU_FORMAT)
    pulled = []

    def chunks():
        yield head
        while True:  # 10 GiB of zeros, were it read
            pulled.append(1)
            yield bytes(1 << 16)

    with pytest.raises(Unreadable, match="more than the 65536"):
        tar_file(chunks(), "/logs/verifier/reward.json", 64 << 10)
    assert len(pulled) <= 2  # the reader's buffer, no more


def test_an_overlay_read_refuses_links_directories_and_sizes_past_the_bound(tmp_path):
    d = tmp_path / "logs" / "verifier"
    d.mkdir(parents=True)
    (d / "reward.txt").write_text("1\n")
    assert read_beneath(tmp_path, "/logs/verifier/reward.txt") == b"1\n"
    assert read_beneath(tmp_path, "/logs/verifier/reward.json") is None
    (d / "reward.json").mkdir()
    with pytest.raises(Unreadable, match="not a regular file"):
        read_beneath(tmp_path, "/logs/verifier/reward.json")
    os.symlink("/etc/hostname", d / "link")
    with pytest.raises(Unreadable):
        read_beneath(tmp_path, "/logs/verifier/link")
    with open(d / "big", "wb") as f:
        f.truncate(10 << 30)  # sparse: no disk used
    with pytest.raises(Unreadable, match="more than"):
        read_beneath(tmp_path, "/logs/verifier/big", 64 << 10)


def test_the_first_status_of_a_test_wins_and_a_repeat_is_named():
    out = (
        "FAILED tests/test_calc.py::test_add - assert -1 == 5\n"
        "PASSED tests/test_calc.py::test_sub\n"
        "=== 1 failed, 1 passed in 0.02s ===\n"
        "PASSED tests/test_calc.py::test_add\n"  # printed at exit by the code under test
    )
    assert pytest_results(out) == {
        "tests/test_calc.py::test_add": "FAILED",
        "tests/test_calc.py::test_sub": "PASSED",
    }
    assert pytest_repeats(out) == ["tests/test_calc.py::test_add"]


def test_junit_cases_are_named_as_pytest_names_them():
    assert junit_name("tests/test_calc.py::test_add") == ("tests.test_calc", "test_add")
    assert junit_name("tests/test_calc.py::TestX::test_y[1-a/b]") == (
        "tests.test_calc.TestX",
        "test_y[1-a/b]",
    )
    raw = (
        b'<testsuites><testsuite name="pytest" tests="3" failures="1">'
        b'<testcase classname="tests.test_calc" name="test_add" time="0.1"><failure message="x">'
        b"</failure></testcase>"
        b'<testcase classname="tests.test_calc" name="test_sub" time="0.1" />'
        b'<testcase classname="tests.test_calc" name="test_q&quot;" time="0.1"><skipped type="pytest.xfail" />'
        b"</testcase></testsuite></testsuites>"
    )
    assert junit_cases(raw) == {
        ("tests.test_calc", "test_add"): "failed",
        ("tests.test_calc", "test_sub"): "passed",
        ("tests.test_calc", 'test_q"'): "xfailed",
    }


def test_the_canary_record_names_a_forged_report_a_run_that_never_finished_and_rewritten_totals():
    honest = {"event": "finish", "canary": {"outcome": "failed", "secret": True},
              "counts": {"passed": 1, "failed": 1, "errors": 0, "skipped": 0}, "tests": {}, "exitstatus": 1}  # fmt: skip
    start = {"event": "start", "pid": 1}

    def rec(*entries):
        return read_record(b"".join(json.dumps(e).encode() + b"\n" for e in entries) + b"not json\n")

    assert canary_reasons(rec(start, honest)) == []
    forged = {**honest, "canary": {"outcome": "passed", "secret": False}}
    assert "was reported 'passed'" in canary_reasons(rec(start, forged))[0]
    assert "never finished" in canary_reasons(rec(start, start, honest))[0]
    # What pytest reported as it ran (1 failed) against a summary line printed later (2 passed).
    printed = summary_counts("=== 2 passed in 0.01s ===")
    assert (
        "as it ran pytest reported 1 passed and 1 failed"
        in record_reasons(rec(start, honest), None, printed)[0]
    )
    assert record_reasons(rec(start, honest), None, summary_counts("1 failed, 1 passed in 0.1s")) == []
