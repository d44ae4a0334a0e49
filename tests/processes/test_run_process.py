"""`sandbox.base.run_process`, which runs every host command of the local and Apptainer runtimes
(`apptainer exec` of the harness, the tests, the seal): a command that ends while a process it
left behind in another session keeps its output open must not hold its caller (the verifier's
tests hung there: a daemon the agent's code started inherited the tests' output), and it keeps
its output, its exit status and its timeout as before."""

from __future__ import annotations

import time

import pytest

from polar_mitm.procs import EXIT_TIMEOUT
from polar_mitm.sandbox.base import OUTPUT_GRACE, run_process

pytestmark = pytest.mark.slow


async def test_a_command_whose_daemon_holds_its_output_returns_after_the_grace():
    # The daemon is in a session of its own (the group kill does not reach it) and keeps the
    # command's stdout open for 60 s: on the code before, the caller waited those 60 s.
    t0 = time.monotonic()
    r = await run_process(["bash", "-c", "echo before; setsid sleep 60 & echo after; exit 3"])
    took = time.monotonic() - t0
    assert r.exit_code == 3
    assert "before" in r.output and "after" in r.output
    assert took < OUTPUT_GRACE + 10, took


async def test_output_exit_status_stdin_and_timeout_as_before():
    r = await run_process(["bash", "-c", "cat; echo done >&2; exit 7"], stdin=b"fed through stdin\n")
    assert (r.exit_code, r.timed_out) == (7, False)
    assert "fed through stdin" in r.output and "done" in r.output  # stderr joins stdout
    big = await run_process(["python3", "-c", "print('x' * 300_000)"])
    assert big.exit_code == 0 and big.output.endswith("x\n")  # the tail of a large output
    t0 = time.monotonic()
    slow = await run_process(["bash", "-c", "echo started; sleep 30"], timeout=1)
    assert (slow.exit_code, slow.timed_out) == (EXIT_TIMEOUT, True)
    assert "started" in slow.output
    assert time.monotonic() - t0 < 10
    missing = await run_process(["/nonexistent/command"])
    assert missing.exit_code == 127
