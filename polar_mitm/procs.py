"""Child processes: signalling a process group, reading an exit status the shell's way, and
stopping a process politely first (a signal, a grace period, then SIGKILL).

One place for what the sandboxes, the harness runner, the service's nodes, the proxy's workers
and the benchmarks all do with the processes they start, so that a group is killed the same way
everywhere and a signal death reads as 128 + n everywhere. Standard library only (core floor).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess

EXIT_TIMEOUT = 124  # as coreutils' timeout


def signal_group(pgid: int, sig: int) -> None:
    """Send `sig` to process group `pgid`; a group that is gone (or no longer ours) is not an error."""
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def kill_group(pgid: int) -> None:
    """SIGKILL to every process in group `pgid` (a child started with its own session or group)."""
    signal_group(pgid, signal.SIGKILL)


def exit_code(returncode: int) -> int:
    """A Popen return code as a shell reports it: a death by signal n (negative) reads 128 + n."""
    return 128 - returncode if returncode < 0 else returncode


def stop(
    proc: subprocess.Popen,
    grace: float,
    *,
    sig: int = signal.SIGTERM,
    group: bool = False,
) -> int:
    """Stop a process: `sig` (SIGTERM, or SIGINT for one that shuts down on Ctrl-C), `grace`
    seconds for it to end on its own, then SIGKILL (to its whole group when `group`, for a child
    started with `start_new_session`: what it started goes too). Returns its return code."""
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            return proc.wait(grace)
        except subprocess.TimeoutExpired:
            if group:
                kill_group(proc.pid)
            else:
                proc.kill()
    return proc.wait()


def wait_or_kill(proc: subprocess.Popen, grace: float) -> int:
    """Wait `grace` seconds for a process told to stop some other way (its stdin or control socket
    closed), then SIGKILL it. Returns its return code."""
    try:
        return proc.wait(grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


async def stop_async(
    proc: asyncio.subprocess.Process,
    grace: float,
    *,
    sig: int = signal.SIGTERM,
    group: bool = False,
) -> int:
    """`stop` for an asyncio child: `sig`, `grace` seconds, then SIGKILL (to its group when
    `group`). Returns its return code."""
    if proc.returncode is None:
        send_async(proc, sig, group=group)
        try:
            return await asyncio.wait_for(proc.wait(), grace)
        except TimeoutError:
            send_async(proc, signal.SIGKILL, group=group)
    return await proc.wait()


def send_async(proc: asyncio.subprocess.Process, sig: int, *, group: bool = False) -> None:
    """Send `sig` to an asyncio child that is still running (to its process group when `group`)."""
    if proc.returncode is None:
        if group:
            signal_group(proc.pid, sig)
        else:
            proc.send_signal(sig)
