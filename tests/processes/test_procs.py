"""polar_mitm.procs on real child processes: exit statuses the shell's way, a polite stop that
ends in SIGKILL for a process that ignores it, and a group kill that reaches what a child left."""

import asyncio
import os
import signal
import subprocess
import sys
import time

from polar_mitm import procs

# Ignores SIGTERM, starts a grandchild in its own group that prints its pid, then waits.
STUBBORN = (
    "import signal, subprocess, sys, time\n"
    "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    "c = subprocess.Popen([sys.executable, '-c', 'import signal, time; "
    "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)'])\n"
    "print(c.pid, flush=True)\n"
    "time.sleep(60)\n"
)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (ended, not yet reaped by its parent) counts as gone
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


def _gone(pid: int, within: float = 5.0) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.02)
    return False


def test_a_signal_death_reads_as_128_plus_n():
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    p.send_signal(signal.SIGTERM)
    assert procs.exit_code(p.wait()) == 128 + signal.SIGTERM
    assert procs.exit_code(3) == 3


def test_stop_kills_a_process_that_ignores_sigterm_and_its_group():
    p = subprocess.Popen(
        [sys.executable, "-c", STUBBORN], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    assert p.stdout is not None
    grandchild = int(p.stdout.readline())
    t0 = time.monotonic()
    rc = procs.stop(p, 0.3, group=True)
    assert rc == -signal.SIGKILL  # SIGTERM was ignored: the grace ran out
    assert time.monotonic() - t0 < 5
    assert _gone(grandchild), "the group kill missed the grandchild"


def test_stop_leaves_the_group_alone_when_not_asked():
    p = subprocess.Popen(
        [sys.executable, "-c", STUBBORN], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    assert p.stdout is not None
    grandchild = int(p.stdout.readline())
    try:
        assert procs.stop(p, 0.3) == -signal.SIGKILL
        assert _alive(grandchild)
    finally:
        procs.kill_group(p.pid)
    assert _gone(grandchild)
    procs.kill_group(p.pid)  # a group that is gone is not an error


def test_stop_async_gives_a_willing_process_its_grace():
    async def main() -> int:
        p = await asyncio.create_subprocess_exec(
            sys.executable, "-c", "import time; time.sleep(60)", process_group=0
        )
        return await procs.stop_async(p, 5, group=True)

    assert procs.exit_code(asyncio.run(main())) == 128 + signal.SIGTERM
