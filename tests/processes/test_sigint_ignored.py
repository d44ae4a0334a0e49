"""A command a shell started in the background inherits SIGINT ignored: it must still stop on a
supervisor's SIGINT as in a terminal (before, `proxy`, `rollout` and `serve` started so never did)."""

import signal
import subprocess
import sys

from tests.support.harness import Lines


def test_a_command_started_with_sigint_ignored_still_stops_on_sigint(tmp_path):
    proc = subprocess.Popen(
        [sys.executable, "-m", "polar_mitm", "fake-backend", "--host", "127.0.0.1", "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),  # as `cmd &` in a script
    )
    try:
        Lines(proc.stdout).until("polar-mitm fake backend", timeout=60)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=20) is not None
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
