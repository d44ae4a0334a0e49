"""The sandbox interface every runtime implements: start one for a task, run a command in it with
an environment and a timeout, run the harness (as an unprivileged user where the sandbox can,
and with every process it left killed at its end), copy files in and out, stop it.

Runtimes: `local` (a temporary directory on the host, `sandbox/tempdir.py`), `docker`
(`sandbox/docker.py`) and `apptainer` (`sandbox/apptainer/`). The rollout pipeline talks only
to this interface; what a sandbox's files say is read as untrusted (`sandbox/untrusted.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, BinaryIO, Literal, Protocol

from polar_mitm.procs import EXIT_TIMEOUT, exit_code, kill_group
from polar_mitm.proxy.certs import CA
from polar_mitm.tasks.model import Task

# Where the harness CLIs and our CA appear inside container sandboxes.
HARNESS_ROOT = "/opt/polar-mitm"
NPM_MODULES = f"{HARNESS_ROOT}/npm/lib/node_modules"
HARNESS_BIN = f"{HARNESS_ROOT}/npm/bin"
NODE_BIN = f"{HARNESS_ROOT}/node/bin"
CA_DIR = f"{HARNESS_ROOT}/ca"
SESSION_DIR = f"{HARNESS_ROOT}/session"
HOME_DIR = f"{SESSION_DIR}/home"  # the harness's HOME: the sample's host directory `home`
CHANNEL_SOCKET = f"{HARNESS_ROOT}/channel/proxy.sock"  # the sample's socket to the proxy
FORWARDER_ROOT = f"{HARNESS_ROOT}/forwarder"  # the forwarder's scripts (sandbox/forwarder/)
HARNESS_USER = "1000:1000"  # who the harness runs as in a container, where the image allows
PIDS_LIMIT = 4096  # processes a container may hold at once (a fork bomb stops there)
# What root's own steps in a container (setup, handing the workdir over, scoring) may still do.
# No NET_RAW (no packet sockets), no NET_BIND_SERVICE, MKNOD, SYS_CHROOT, KILL, AUDIT_WRITE,
# SYS_PTRACE, SYS_ADMIN. An unprivileged harness has none of them (and no-new-privileges: no
# setuid binary gives them back).
ROOT_CAPS = ["CHOWN", "DAC_OVERRIDE", "FOWNER", "SETUID", "SETGID"]


@dataclass(frozen=True)
class Limits:
    """What one sample's sandbox may take of the host, by default: memory (MiB), CPUs, processes,
    and the sizes of its /tmp and its harness's HOME (MiB: a tmpfs in Docker, a file system image
    of that size in Apptainer). A task's own memory and CPUs win (`for_task`); None: no limit of
    that kind. The rollout's options set them (`--memory`, `--cpus`, `--pids`, `--tmp-size`,
    `--home-size`). `allow_unenforced`: a runtime that cannot enforce them here starts the sandbox
    anyway (`--allow-unenforced-limits`); else it refuses (`Runtime.unenforced`)."""

    memory_mb: int | None = 4096
    cpus: float | None = 2.0
    pids: int = PIDS_LIMIT
    tmp_mb: int | None = 1024
    home_mb: int | None = 1024
    allow_unenforced: bool = False

    def for_task(self, task: Task) -> Limits:
        """These limits with the task's own memory and CPUs in place of the defaults."""
        return Limits(
            memory_mb=task.memory_mb or self.memory_mb,
            cpus=task.cpus or self.cpus,
            pids=self.pids,
            tmp_mb=self.tmp_mb,
            home_mb=self.home_mb,
            allow_unenforced=self.allow_unenforced,
        )


def sandbox_ca(ca: CA) -> CA:
    """Our CA's files as a sandbox sees them: the certificate and the bundle, mounted one by one
    under CA_DIR with their host names. The private key never enters a sandbox."""
    d = Path(CA_DIR)
    return CA(dir=d, key_and_cert=d / "none", cert=d / ca.cert.name, bundle=d / ca.bundle.name)


def ca_mounts(ca: CA) -> list[tuple[Path, str]]:
    """(host file, sandbox path) for each CA file a sandbox gets, read-only."""
    inside = sandbox_ca(ca)
    return [(ca.cert, str(inside.cert)), (ca.bundle, str(inside.bundle))]


# The host variables a harness on the `local` runtime (and its commands) sees, besides the
# recipe's and the task's own: never the host's environment, which holds the operator's secrets.
HOST_ENV_ALLOWED = (
    "PATH",
    "HOME",
    "USER",
    "LOGNAME",
    "SHELL",
    "LANG",
    "LANGUAGE",
    "TERM",
    "COLORTERM",
    "TMPDIR",
    "TZ",
)


def host_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The allowed host variables (HOST_ENV_ALLOWED and the locale's LC_*) of `environ`
    (default: this process's environment)."""
    environ = os.environ if environ is None else environ
    return {k: v for k, v in environ.items() if k in HOST_ENV_ALLOWED or k.startswith("LC_")}


class RuntimeUnavailable(RuntimeError):
    """The runtime cannot work on this machine (no daemon, no binary): say what to do."""


class SandboxError(RuntimeError):
    """The sandbox failed (could not start, died, a copy failed): an infrastructure failure."""


class LimitsUnenforced(SandboxError):
    """The runtime cannot enforce a sandbox's limits here, and they do not allow that: the same on
    every attempt, so a sample fails with it at once (not retried)."""


def unenforced_refusal(runtime: Runtime, limits: Limits) -> str | None:
    """Why a sandbox with `limits` must not start on `runtime`: it cannot enforce them here and
    they do not allow that (one sample could take the memory or the disk that every sample
    shares); else None. What a rollout checks before it starts (`rollout.jobs.unenforced_limits`)
    and every sandbox start checks again (`refuse_unenforced`)."""
    if limits.allow_unenforced or (why := runtime.unenforced(limits)) is None:
        return None
    return (
        f"{runtime.name}: cannot enforce {why} on this host: one sample could take what every "
        "sample shares. Run where it can, or pass --allow-unenforced-limits where something else "
        "bounds the job (its scheduler's cgroup), or 0 for no limit of that kind (--memory 0; "
        "--tmp-size 0 --home-size 0)"
    )


def refuse_unenforced(runtime: Runtime, limits: Limits) -> None:
    """Raise LimitsUnenforced where `unenforced_refusal` says why."""
    if (why := unenforced_refusal(runtime, limits)) is not None:
        raise LimitsUnenforced(why)


class ExportTooLarge(SandboxError):
    """A directory to export holds more than asked for: what the agent left, not a failure of ours."""


class Unreadable(Exception):
    """A file a verdict is read from is there but is not what it must be: not a regular file (a
    directory, a link, a FIFO), or larger than the bound it is read with. What the sandbox left,
    never an infrastructure failure: a verdict read from it is suspect."""


# Bytes read of a file a verdict comes from, unless the caller says otherwise (`Sandbox.read`).
READ_LIMIT = 64 << 10


@dataclass(frozen=True)
class Leftover:
    """A process found in a sandbox besides its init once a command ended: still running, or
    exited and never reaped (a zombie of the init, which reaps nothing: what a detached process
    that already did its work leaves)."""

    pid: int  # as the host sees it
    state: str  # the kernel's one-letter state: R, S, D, Z, T
    command: str

    def describe(self) -> str:
        return f"{self.pid} {self.state} {self.command[:120]}"


def host_process(pid: int) -> Leftover:
    """A process of this host by its /proc entry (gone by now: state "?")."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        state = stat.rsplit(")", 1)[1].split()[0]
        comm = stat[stat.index("(") + 1 : stat.rindex(")")]
    except (OSError, IndexError, ValueError):
        return Leftover(pid, "?", "")
    try:
        args = (
            Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode("utf-8", "replace").strip()
        )
    except OSError:
        args = ""
    return Leftover(pid, state, args or f"[{comm}]")


async def exec_then_seal(
    sandbox: Sandbox,
    cmd: list[str],
    *,
    env: dict[str, str] | None,
    timeout: float | None,
    workdir: str | None,
    before: set[int] | None = None,
) -> tuple[ExecResult, list[Leftover]]:
    """`Sandbox.exec_sealed` where the sandbox's init keeps what the command abandons in sight
    (Docker's verifier: an init that reaps nothing): the processes before (listed, unless the
    caller knows them: `before`), the command, then `seal`, and what is new."""
    if before is None:
        before = {p.pid for p in await sandbox.processes()}
    r = await sandbox.exec(cmd, env=env, timeout=timeout, workdir=workdir)
    left = [p for p in await sandbox.seal() if p.pid not in before]
    return r, left


@dataclass
class ExecResult:
    exit_code: int
    output: str  # stdout and stderr together, the tail only (see OUTPUT_TAIL)
    timed_out: bool = False
    seconds: float = 0.0


OUTPUT_TAIL = 16_000  # characters of a command's output kept


def tail(data: bytes | str | None, limit: int = OUTPUT_TAIL) -> str:
    if data is None:
        return ""
    text = data.decode("utf-8", "replace") if isinstance(data, bytes) else data
    return text[-limit:]


async def run_process(
    argv: list[str],
    *,
    env: Mapping[str, str] | None = None,
    cwd: str | None = None,
    timeout: float | None = None,
    procs: set[asyncio.subprocess.Process] | None = None,
    stdin: bytes | None = None,
) -> ExecResult:
    """Run argv on the host in its own process group to its end; on timeout (or cancellation)
    kill the whole group, so nothing it started outlives it (exit 124 on timeout).

    `procs` holds the process while it runs, so whoever owns that set can kill it (a sandbox's
    `stop`). The local runtime runs commands with it; Apptainer runs `apptainer exec` with it.
    `stdin`: bytes the command reads on its standard input (else /dev/null).
    """
    t0 = time.monotonic()
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv,
            cwd=cwd,
            env=dict(env) if env is not None else None,
            stdin=asyncio.subprocess.DEVNULL if stdin is None else asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            start_new_session=True,
        )
    except FileNotFoundError as e:
        return ExecResult(127, f"{argv[0]}: command not found ({e})", seconds=time.monotonic() - t0)
    if procs is not None:
        procs.add(proc)
    timed_out = False
    out = bytearray()
    try:
        try:
            rc = await asyncio.wait_for(_finish(proc, stdin, out), timeout)
        except TimeoutError:
            timed_out = True
            kill_group(proc.pid)
            rc = await _finish(proc, None, out)
    except asyncio.CancelledError:
        kill_group(proc.pid)
        await _ended(proc)
        raise
    finally:
        if procs is not None:
            procs.discard(proc)
        kill_group(proc.pid)  # helpers the command left behind
        transport = getattr(proc, "_transport", None)  # its pipes: one may be held open still
        if transport is not None:
            transport.close()
    code = EXIT_TIMEOUT if timed_out else exit_code(rc)
    return ExecResult(code, tail(bytes(out)), timed_out=timed_out, seconds=time.monotonic() - t0)


# Seconds a command's output may stay open after the command itself has ended (a process it
# left behind in another session or PID namespace holds it), before it is read no further.
OUTPUT_GRACE = 5.0
_POLL = 0.5  # seconds between looks at whether the command has ended


async def _finish(proc: asyncio.subprocess.Process, stdin: bytes | None, out: bytearray) -> int:
    """The command's output into `out` and its return code, once it has ended. Its end is looked
    for on the host as well (`waitid` without reaping), not only through asyncio's child watcher:
    an output pipe that a process it left behind keeps open is read for OUTPUT_GRACE seconds after
    the command ended, no longer, and a command whose end asyncio does not report is reaped here."""

    async def feed() -> None:
        assert proc.stdin is not None
        with contextlib.suppress(ConnectionError, BrokenPipeError):
            proc.stdin.write(stdin or b"")
            await proc.stdin.drain()
        proc.stdin.close()

    async def read() -> None:
        assert proc.stdout is not None
        while chunk := await proc.stdout.read(1 << 16):
            out.extend(chunk)

    feeding = asyncio.ensure_future(feed()) if stdin is not None else None
    reading = asyncio.ensure_future(read())
    try:
        ended_at: float | None = None
        while True:
            if reading.done() and proc.returncode is not None:
                return proc.returncode
            if ended_at is None and _has_ended(proc.pid):
                ended_at = time.monotonic()
            if ended_at is not None and time.monotonic() - ended_at > OUTPUT_GRACE:
                return await _ended(proc)
            await asyncio.wait({reading}, timeout=_POLL)
            if reading.done() and proc.returncode is None:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(asyncio.shield(proc.wait()), _POLL)
    finally:
        for t in (reading, feeding):
            if t is not None and not t.done():
                t.cancel()
                await asyncio.gather(t, return_exceptions=True)
        if reading.done() and not reading.cancelled() and reading.exception() is not None:
            log.debug("reading a command's output: %s", reading.exception())


def _has_ended(pid: int) -> bool:
    """Whether child `pid` has ended (a zombie, or already reaped), without reaping it."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


async def _ended(proc: asyncio.subprocess.Process) -> int:
    """The return code of a child that has ended or is ending: asyncio's, else reaped here when
    its child watcher has not reported it within OUTPUT_GRACE."""
    with contextlib.suppress(TimeoutError):
        return await asyncio.wait_for(asyncio.shield(proc.wait()), OUTPUT_GRACE)
    try:
        pid, status = os.waitpid(proc.pid, os.WNOHANG)
    except ChildProcessError:  # reaped meanwhile (by asyncio, which reports it now)
        with contextlib.suppress(TimeoutError):
            return await asyncio.wait_for(asyncio.shield(proc.wait()), _POLL)
        return 255
    if pid == 0:
        return await proc.wait()  # still running after all (the output's grace): wait as before
    log.warning("pid %d ended without asyncio's child watcher reporting it; reaped here", proc.pid)
    return os.waitstatus_to_exitcode(status)


@dataclass
class HarnessMount:
    """The host's harness installation, shown read-only inside a container sandbox.

    npm harnesses: `modules` is the npm prefix's `lib/node_modules`; `bin` a host directory of
    relative links (`claude -> ../lib/node_modules/...`) made for it; `node` the node binary the
    JavaScript harnesses run on. Inside the sandbox they appear at NPM_MODULES, HARNESS_BIN and
    NODE_BIN.

    PyPI harnesses: `trees` are (host directory, sandbox path) pairs shown at the same absolute
    paths as on the host — the harness's virtualenv and the interpreter installation it was built
    on, since entry scripts and the venv's `pyvenv.cfg` name them by absolute path; `bin` holds
    links to the entry scripts there (at HARNESS_BIN); `python` is that interpreter (the
    forwarder's, where there is no node); `env` what the harness needs on top in the sandbox.
    """

    modules: Path | None
    bin: Path
    node: Path | None
    trees: list[tuple[Path, str]] = field(default_factory=list)
    python: str | None = None
    env: dict[str, str] = field(default_factory=dict)

    def traversed(self) -> list[str]:
        """The sandbox directories above the trees, which the harness's unprivileged user must be
        able to pass through (an image's /root is 0700; docker makes the missing ones 0755)."""
        inside = [PurePosixPath(p) for _, p in self.trees]
        out: set[str] = set()
        for p in inside:
            for parent in p.parents:
                if str(parent) != "/" and not any(parent == q or parent.is_relative_to(q) for q in inside):
                    out.add(str(parent))
        return sorted(out)


@dataclass
class SandboxSpec:
    """What a runtime needs besides the task to start a sandbox."""

    name: str  # unique per sample: container / instance name
    # A host directory for this sample (logs, copies). Containers see only its `home` (the
    # harness's HOME, read-write): nothing else in it is theirs to write.
    session_dir: Path
    ca: CA  # host paths of our CA
    harness: HarnessMount | None = None
    labels: dict[str, str] = field(default_factory=dict)
    # The host end of the sample's own channel to the proxy (`sandbox/channel.py`); a container
    # runtime binds it in and starts the forwarder, and the sandbox has no network besides it.
    channel: Path | None = None
    # "verifier": a sandbox that scores a sample's artefacts after its agent's sandbox was halted;
    # it gets no harness and nothing of ours mounted; no network, or, where its task allows the
    # internet, a channel of its own (`channel`), under the same egress rules and with no model.
    purpose: Literal["agent", "verifier"] = "agent"
    # Who the harness runs as in a container ("UID:GID"), None for the image's own user (root).
    user: str | None = HARNESS_USER
    # The node binary a verifier's forwarder runs on, where it has a channel (a verifier has no
    # harness installation mounted); None: the image's python3.
    forwarder_node: Path | None = None
    # A verifier's read-only inputs: (host directory, sandbox path) pairs shown read-only (the
    # task's tests from a pristine copy, the canary's plugin), so nothing the tests run can change
    # them; a runtime that cannot mount them says so with `mounts_inputs = False`.
    inputs: list[tuple[Path, str]] = field(default_factory=list)
    # A verifier started from a snapshot of its agent's sandbox (`Runtime.snapshot`) instead of
    # the task's image: Harbor's shared mode.
    image: str | None = None
    # What the sandbox may take of the host when its task names no limit (`Limits.for_task`).
    limits: Limits = field(default_factory=Limits)


@dataclass(frozen=True)
class Snapshot:
    """A halted agent sandbox's filesystem, kept to start its verifier from (`Runtime.snapshot`):
    the runtime's reference to it, and the paths the agent changed in the task's image (added,
    changed or removed; the first CHANGES_LISTED of them)."""

    ref: str
    changed: list[str]
    changed_count: int


CHANGES_LISTED = 10_000


class Sandbox(Protocol):
    name: str
    workdir: str  # the task's workdir as the sandbox sees it
    ca: CA  # our CA's files as the sandbox sees them
    path_prefix: list[str]  # directories to put first on PATH so the harness binaries are found
    # Where the proxy answers inside the sandbox (its channel's forwarder), or None: the proxy's
    # own address (a sandbox on the host's network).
    proxy_address: tuple[str, int] | None

    async def exec(
        self,
        cmd: list[str],
        *,
        env: dict[str, str] | None = None,
        timeout: float | None = None,
        workdir: str | None = None,
    ) -> ExecResult:
        """Run cmd to its end (or kill everything it started after `timeout` seconds)."""
        ...

    async def exec_harness(
        self, cmd: list[str], *, env: dict[str, str] | None = None, timeout: float | None = None
    ) -> ExecResult:
        """Run the harness in the workdir (as the unprivileged user where the sandbox has one);
        once it ends, kill every process it left (within seconds, whatever the image holds)."""
        ...

    async def kill_all(self) -> None:
        """Kill every process in the sandbox; its files stay and `exec` still works."""
        ...

    async def put(self, src: Path, dest: str) -> None:
        """Copy a host file or directory to `dest` (a path in the sandbox)."""
        ...

    async def read(self, path: str, limit: int = READ_LIMIT) -> bytes | None:
        """A regular file's bytes from the sandbox, or None when nothing is at `path`. Strict,
        because verdicts are read with it: `Unreadable` for anything but a regular file (a
        directory, a link, even to a regular file) or one of more than `limit` bytes (known from
        its size before it is read); memory holds at most `limit` bytes whatever is there."""
        ...

    async def alive(self) -> bool: ...

    async def halt(self) -> None:
        """End every process in the sandbox at once (the agent's last chance to touch anything);
        its files stay readable with `read` and `export` until `stop`."""
        ...

    async def export(self, path: str, limit: int, into: BinaryIO) -> int:
        """Write a tar of the directory `path` (its members under the directory's own name) into
        `into`, also after `halt`; returns its size. FileNotFoundError when it does not exist;
        ExportTooLarge past `limit` bytes, found from file sizes before anything is read where the
        runtime can, else while the tar streams (never held whole in memory)."""
        ...

    async def put_tar(self, dest: str, data: BinaryIO) -> None:
        """Unpack a tar (as `export` makes, read from the file `data`) into the existing directory
        `dest`."""
        ...

    # True when `processes` and `seal` see every process of the sandbox from outside it, so a
    # verifier can tell what the tests left behind (Docker); False where it cannot (local).
    supervises: bool

    async def processes(self) -> list[Leftover]:
        """Every process in the sandbox but its init, running or unreaped, as seen from outside."""
        ...

    async def seal(self) -> list[Leftover]:
        """Freeze the sandbox at once, list what `processes` lists, then end it all (as `halt`):
        nothing that ran in it can write anything afterwards; files stay readable."""
        ...

    async def exec_sealed(
        self,
        cmd: list[str],
        *,
        env: dict[str, str] | None = None,
        timeout: float | None = None,
        workdir: str | None = None,
    ) -> tuple[ExecResult, list[Leftover]]:
        """Run cmd (a verifier's tests), then `seal` the moment it ends; returns its result and
        every process it left behind (not there before it began), running or exited. Only
        `read` and `export` work afterwards."""
        ...

    def describe(self) -> dict[str, Any]:
        """Where this sandbox is, for the record (`reward_detail`): container, image, user, network."""
        ...

    async def stop(self) -> None:
        """Stop and remove the sandbox; safe to call twice."""
        ...


class Runtime(Protocol):
    name: str
    isolated: bool  # True when the sandbox has its own filesystem (absolute task paths are safe)
    # True when `start(task, SandboxSpec(purpose="verifier"))` gives a fresh sandbox from the task's
    # image, so a sample is scored where its agent never ran (rollout/verify.py).
    fresh_verifier: bool

    async def check(self) -> None:
        """Raise RuntimeUnavailable, with what to do, when this runtime cannot work here."""
        ...

    async def prepare(self, task: Task) -> None:
        """Make the task's image available (build from its Dockerfile, cached by content)."""
        ...

    # True when a verifier's `SandboxSpec.inputs` are shown read-only (Docker, Apptainer).
    mounts_inputs: bool
    # True when `snapshot` can keep a halted agent sandbox's filesystem for its verifier.
    snapshots: bool

    async def snapshot(self, sandbox: Sandbox, name: str) -> Snapshot:
        """The halted `sandbox`'s filesystem kept under `name` (ExportTooLarge past what the
        runtime keeps), for `start(task, SandboxSpec(image=snapshot.ref))`."""
        ...

    async def drop_snapshot(self, snapshot: Snapshot) -> None:
        """Remove a snapshot; safe to call twice."""
        ...

    def unenforced(self, limits: Limits) -> str | None:
        """What of `limits` this runtime cannot enforce on this host, as far as it knows (after
        `prepare`), for a person to read; None: all of it. A sandbox whose limits do not allow
        that (`Limits.allow_unenforced`) is refused at its start."""
        ...

    async def start(self, task: Task, spec: SandboxSpec) -> Sandbox: ...

    async def cleanup(self, labels: dict[str, str]) -> int:
        """Remove every sandbox carrying these labels (left by a crash); returns how many."""
        ...


# --- handing a sandbox's workdir to its harness user (docker, apptainer) -------------------------

log = logging.getLogger("polar_mitm.sandbox")


async def chown(sandbox: Sandbox, owner: str, paths: list[str]) -> bool:
    r = await sandbox.exec(["chown", "-R", owner, "--", *paths], workdir="/")
    if r.exit_code != 0:
        log.warning("sandbox %s: chown %s: %s", sandbox.name, owner, r.output[-300:])
    return r.exit_code == 0


# One exec (a daemon round trip, three API calls on Docker) for the whole hand-over: the workdir's
# owner read, the trees chowned, the user named, the directories above a PyPI harness's trees
# opened. Paths and ids arrive as arguments, never in the script's text.
_HAND_OVER = r"""
need=$1 user=$2 home=$3 workdir=$4; shift 4
if [ -n "$need" ] && ! command -v "$need" >/dev/null; then echo "the image has no $need"; exit 3; fi
owner=$(stat -c %u:%g -- "$workdir") || exit 4
chown -R "$user" -- "$workdir" ${home:+"$home"} || exit 5
uid=${user%%:*} gid=${user#*:}
grep -q "^[^:]*:[^:]*:$uid:" /etc/passwd || echo "polar:x:$uid:$gid:polar-mitm harness:${home:-/tmp}:/bin/sh" >> /etc/passwd || echo "no name for uid $uid"
grep -q "^[^:]*:[^:]*:$gid:" /etc/group || echo "polar:x:$gid:" >> /etc/group || echo "no name for gid $gid"
for d; do [ -d "$d" ] && { chmod o+x -- "$d" || echo "cannot open $d"; }; done
echo "owner=$owner"
"""


async def hand_over(
    sandbox: Sandbox, user: str, workdir: str, home: str | None, traversed: list[str], *, need: str = ""
) -> str | None:
    """Make the workdir (and HOME) the harness user's, in one exec; returns the workdir's owner
    before, to give it back after (scoring tools such as git refuse a repository owned by another
    user), or None where the hand-over failed (the harness then runs as root).

    Also gives the user a name in the image's /etc/passwd and /etc/group where it has none
    (Node's os.userInfo(), which Qwen Code calls at start, fails for a uid without one), and lets
    it pass through the directories above a PyPI harness's trees (search permission only: an
    image's /root is 0700, and the trees sit at the host's own paths, often under /root).
    `need`: a command the image must have for the harness to run as that user (Apptainer's
    setpriv)."""
    argv = ["sh", "-c", _HAND_OVER, "sh", need, user, home or "", workdir, *traversed]
    r = await sandbox.exec(argv, workdir="/")
    lines = r.output.strip().splitlines()
    owner = (
        lines[-1].removeprefix("owner=")
        if r.exit_code == 0 and lines and lines[-1].startswith("owner=")
        else None
    )
    if owner is None:
        log.warning(
            "sandbox %s: cannot hand %s to %s (exit %s: %s); the harness runs as root",
            sandbox.name, workdir, user, r.exit_code, r.output[-300:],
        )  # fmt: skip
    elif len(lines) > 1:
        log.info(
            "sandbox %s: handing %s to %s: %s", sandbox.name, workdir, user, "; ".join(lines[:-1])[-300:]
        )
    return owner
