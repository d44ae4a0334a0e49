"""A verifier's tests, run under a supervisor that keeps what they leave behind in sight.

Run as `python3 reap.py CMD...` in a fresh verifier sandbox whose init reaps its orphans (an
Apptainer instance's): it reads one line, a secret, from stdin, makes itself a child subreaper
(every process the tests start and abandon becomes its child, and stays a zombie, since it waits
only for the tests), runs CMD with stdin from /dev/null, waits for it, then stops every other
process of the sandbox's PID namespace, lists those that were not there when it began (running,
or exited and unreaped), kills them all, and prints one last line:

    <secret> {"status": N, "left": [[pid, state, command], ...]}

and exits with CMD's status. Nothing it prints can be forged by the tests: they never see the
secret (stdin is not theirs, and the supervisor is not dumpable, so /proc/PID/mem and ptrace are
closed to a root without CAP_SYS_PTRACE). Signals but SIGKILL are ignored; a killed supervisor
prints no line, which the host reads as a suspect verdict. Standard library only, any Python 3.
"""

import ctypes
import json
import os
import signal
import sys
import time

PR_SET_DUMPABLE = 4
PR_SET_CHILD_SUBREAPER = 36


def processes():
    """{pid: (state, command)} of every process this PID namespace's /proc shows but 1 and us."""
    me, out = os.getpid(), {}
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) in (1, me):
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
            state = stat.rsplit(")", 1)[1].split()[0]
            comm = stat[stat.index("(") + 1 : stat.rindex(")")]
            with open(f"/proc/{name}/cmdline", "rb") as f:
                args = f.read().replace(b"\0", b" ").decode("utf-8", "replace").strip()
        except (OSError, IndexError, ValueError):
            continue
        out[int(name)] = (state, args or f"[{comm}]")
    return out


def signal_all(sig):
    """`sig` to every process of the namespace but 1 and us (none there: nothing to do)."""
    try:
        os.kill(-1, sig)
    except ProcessLookupError:
        pass


def main():
    secret = sys.stdin.readline().strip()
    argv = sys.argv[1:]
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0 or libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        sys.stdout.write(f"\nreap.py: prctl failed (errno {ctypes.get_errno()})\n")
        return 125
    before = set(processes())
    pid = os.fork()
    if pid == 0:
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        try:
            os.execvp(argv[0], argv)
        except OSError as e:
            sys.stderr.write(f"{argv[0]}: {e}\n")
        os._exit(127)
    for sig in range(1, signal.NSIG):
        if sig not in (signal.SIGKILL, signal.SIGSTOP, signal.SIGCHLD):
            try:
                signal.signal(sig, signal.SIG_IGN)
            except (OSError, ValueError):
                pass
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    code = 128 - code if code < 0 else code
    # Stop everything first (a running leftover cannot fork or write while it is listed), list
    # what is new, then kill it all; our zombies are reaped last, once listed.
    signal_all(signal.SIGSTOP)
    left = {p: v for p, v in processes().items() if p not in before}
    signal_all(signal.SIGKILL)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            if os.waitpid(-1, os.WNOHANG) == (0, 0):
                time.sleep(0.01)
        except ChildProcessError:
            break
    report = {"status": code, "left": [[p, s, c[:200]] for p, (s, c) in sorted(left.items())]}
    sys.stdout.flush()
    sys.stderr.flush()
    sys.stdout.write(f"\n{secret} {json.dumps(report)}\n")
    sys.stdout.flush()
    return code


if __name__ == "__main__":
    sys.exit(main())
