"""One running Apptainer instance (`ApptainerSandbox`): execs, files across its transfer
directory, its processes seen and killed from the host, its verifier's tests supervised and
sealed. Its command lines come from `argv.py`, its host-side helpers from `host.py`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import shutil
import signal
import tarfile
import time
import uuid
from pathlib import Path, PurePosixPath
from typing import Any, BinaryIO

from polar_mitm.procs import kill_group
from polar_mitm.sandbox.apptainer.argv import (
    EXIT_NO_DIR,
    EXIT_NOT_A_FILE,
    EXIT_NOT_REGULAR,
    EXIT_TOO_LARGE,
    REAPER,
    ROOTLESS,
    STOP_WAIT,
    XFER_DIR,
    Privileges,
    as_user,
    env_options,
    exec_argv,
    exec_env,
    harness_path,
    own_dir,
    privilege_options,
    report_of,
    stop_argv,
)
from polar_mitm.sandbox.apptainer.host import list_instances, namespace_pids, run_argv, signal_all
from polar_mitm.sandbox.base import (
    CHANNEL_SOCKET,
    FORWARDER_ROOT,
    HOME_DIR,
    NODE_BIN,
    READ_LIMIT,
    ExecResult,
    ExportTooLarge,
    Leftover,
    SandboxError,
    SandboxSpec,
    Unreadable,
    chown,
    hand_over,
    host_process,
    sandbox_ca,
)
from polar_mitm.sandbox.channel import FORWARD_PORT
from polar_mitm.sandbox.untrusted import read_beneath, safe_members, tree_size

log = logging.getLogger("polar_mitm.apptainer")


class ApptainerSandbox:
    """One running instance. Files cross through its transfer directory, which both sides see."""

    def __init__(
        self,
        *,
        binary: str,
        name: str,
        workdir: str,
        spec: SandboxSpec,
        image: str = "",
        record_path: Path | None = None,
        overlay: Path | None = None,
        init_pid: int = 0,
        limits: str = "applied",
        host_root: bool | None = None,
    ):
        self.binary = binary
        self.name = name
        self.workdir = workdir
        self.image = image
        self.purpose = spec.purpose
        self.ca = sandbox_ca(spec.ca)
        self.path_prefix = harness_path(spec)
        self.proxy_address = ("127.0.0.1", FORWARD_PORT) if spec.channel is not None else None
        self.dir = own_dir(spec)
        self.record_path = record_path
        self.overlay = overlay
        self.init_pid = init_pid
        self.limits = limits
        self.host_root = os.geteuid() == 0 if host_root is None else host_root
        self.user = spec.user if spec.purpose == "agent" and self.host_root else None
        self.traversed = (
            spec.harness.traversed() if spec.harness is not None and spec.purpose == "agent" else []
        )
        self.supervisor: str | None = None  # the interpreter that runs REAPER, for a verifier
        self.supervises = self.seen
        self._procs: set[asyncio.subprocess.Process] = set()
        self._stopped = False
        self._sealed = False

    @property
    def seen(self) -> bool:
        """Its processes are seen from the host (its own PID namespace) and its files read there
        (the overlay directory)."""
        return self.overlay is not None and self.init_pid > 0

    def _xfer(self) -> tuple[Path, str]:
        """A fresh transfer directory: its host path and its path in the sandbox."""
        rel = uuid.uuid4().hex
        host = self.dir / "xfer" / rel
        host.mkdir(parents=True)
        return host, f"{XFER_DIR}/{rel}"

    async def exec(
        self,
        cmd: list[str],
        *,
        env: dict[str, str] | None = None,
        timeout: float | None = None,
        workdir: str | None = None,
        privileges: Privileges = "root",
        stdin: bytes | None = None,
    ) -> ExecResult:
        if self._stopped:
            raise SandboxError(f"sandbox {self.name} is stopped")
        full_env = exec_env(env, self.path_prefix)
        home = full_env.pop("HOME", None)
        if home is not None:  # Apptainer sets HOME itself and refuses another through --env
            cmd = ["env", f"HOME={home}", *cmd]
        env_file = self.dir / "env" / f"{uuid.uuid4().hex}.env"
        opts, text = env_options(full_env, env_file)
        if text is not None:
            env_file.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(env_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # may hold credentials
            with os.fdopen(fd, "w") as f:
                f.write(text)
        if privileges == "harness" and self.user is not None:
            cmd = as_user(cmd, self.user)
        privs = privilege_options(privileges if self.user is not None else "root", host_root=self.host_root)
        argv = exec_argv(self.binary, self.name, cmd, workdir or self.workdir, opts, privs)
        try:
            result = await run_argv(argv, timeout, self._procs, stdin)
        finally:
            env_file.unlink(missing_ok=True)
        if result.exit_code == 255 and not self._stopped and not await self.alive():
            raise SandboxError(f"apptainer: instance {self.name} is gone: {result.output[-2000:]}")
        return result

    async def exec_harness(
        self, cmd: list[str], *, env: dict[str, str] | None = None, timeout: float | None = None
    ) -> ExecResult:
        owner = await self._hand_over()
        try:
            r = await self.exec(cmd, env=env, timeout=timeout, privileges="harness")
        finally:
            await self.kill_all()
        if owner is not None:
            await chown(self, owner, [self.workdir])
        return r

    async def _hand_over(self) -> str | None:
        """Make the workdir and HOME the harness user's (`sandbox.base.hand_over`); returns the
        workdir's owner before. Where that fails, or the image has no setpriv, the harness runs
        as root, without capabilities."""
        if self.user is None:
            return None
        owner = await hand_over(self, self.user, self.workdir, HOME_DIR, self.traversed, need="setpriv")
        if owner is None:
            self.user = None
        return owner

    def _pids(self) -> list[int]:
        return namespace_pids(self.init_pid) if self.init_pid > 0 else []

    async def kill_all(self) -> None:
        """SIGKILL to every process in the instance's PID namespace but its init (setsid'd or
        not: the host sees them all), and to the `apptainer exec` groups we started; the instance
        stays, its files too, and `exec` still works."""
        for proc in list(self._procs):
            kill_group(proc.pid)
        await self._kill_namespace()

    async def _kill_namespace(self) -> None:
        deadline = time.monotonic() + STOP_WAIT
        while (pids := self._pids()) and time.monotonic() < deadline:
            signal_all(pids, signal.SIGKILL)
            await asyncio.sleep(0.02)

    async def start_forwarder(self, node: bool, python: str | None = None) -> None:
        """The forwarder on 127.0.0.1:FORWARD_PORT to the channel socket (see `sandbox/docker.py`):
        on our node, else the Python harness's mounted interpreter, else the image's python3."""
        tries = [[f"{NODE_BIN}/node", f"{FORWARDER_ROOT}/forward.js"]] if node else []
        if python:
            tries.append([python, f"{FORWARDER_ROOT}/forward.py"])
        tries.append(["python3", f"{FORWARDER_ROOT}/forward.py"])
        for argv in tries:
            r = await self.exec([*argv, CHANNEL_SOCKET, str(FORWARD_PORT)], workdir="/", timeout=30)
            if r.exit_code == 0:
                return
        raise SandboxError(
            f"apptainer: cannot start the proxy forwarder in {self.name} (needs node or python3)"
        )

    async def _exec_checked(self, cmd: list[str], what: str) -> ExecResult:
        result = await self.exec(cmd, workdir="/")
        if result.exit_code != 0:
            raise SandboxError(
                f"apptainer: {what} failed in {self.name} (exit {result.exit_code}): {result.output}"
            )
        return result

    async def put(self, src: Path, dest: str) -> None:
        host, inside = self._xfer()
        try:
            staged = host / (src.name or "root")
            if src.is_dir():
                shutil.copytree(src, staged, symlinks=True)
                script = 'mkdir -p -- "$2" && cp -a -- "$1"/. "$2"/'
            else:
                shutil.copy2(src, staged)
                script = 'mkdir -p -- "$(dirname "$2")" && cp -a -- "$1" "$2"'
            await self._exec_checked(
                ["sh", "-c", script, "sh", f"{inside}/{staged.name}", dest], f"copying {src} to {dest}"
            )
        finally:
            shutil.rmtree(host, ignore_errors=True)

    async def read(self, path: str, limit: int = READ_LIMIT) -> bytes | None:
        if self._sealed and self.overlay is not None:
            # Nothing runs in the sandbox once it is sealed: the file is read from its overlay on
            # the host (the tests may have replaced every binary in it).
            return await asyncio.to_thread(read_beneath, self.overlay / "upper", path, limit)
        host, inside = self._xfer()
        try:
            script = (
                f'[ -e "$1" ] || [ -L "$1" ] || exit {EXIT_NOT_A_FILE}; '
                f'[ -f "$1" ] && [ ! -L "$1" ] || exit {EXIT_NOT_REGULAR}; '
                f'[ "$(stat -c %s -- "$1")" -le {int(limit)} ] || exit {EXIT_TOO_LARGE}; '
                'head -c "$3" -- "$1" > "$2"'
            )
            result = await self.exec(["sh", "-c", script, "sh", path, f"{inside}/data", str(limit)])
            if result.exit_code == EXIT_NOT_A_FILE:
                return None
            if result.exit_code == EXIT_NOT_REGULAR:
                raise Unreadable(f"{path} is not a regular file")
            if result.exit_code == EXIT_TOO_LARGE:
                raise Unreadable(f"{path} holds more than the {limit} bytes read")
            if result.exit_code != 0:
                raise SandboxError(
                    f"apptainer: reading {path} failed in {self.name} (exit {result.exit_code}): {result.output}"
                )
            with open(host / "data", "rb") as f:
                return f.read(limit)
        finally:
            shutil.rmtree(host, ignore_errors=True)

    async def alive(self) -> bool:
        if self._stopped:
            return False
        return self.name in await list_instances(self.binary, self.name)

    async def halt(self) -> None:
        """Every process in the instance ends at once (the host kills its PID namespace but the
        init); its files stay, for `export`."""
        await self.kill_all()

    async def export(self, path: str, limit: int, into: BinaryIO) -> int:
        path = PurePosixPath(path).as_posix()
        parent, base = os.path.split(path.rstrip("/"))
        if self.overlay is not None:
            claimed = await asyncio.to_thread(tree_size, self.overlay / "upper" / path.lstrip("/"), limit)
            if claimed > limit:
                raise ExportTooLarge(
                    f"instance {self.name}: {path} holds more than {limit} bytes (by its files' sizes)"
                )
        host, inside = self._xfer()
        try:
            script = (
                f'cd -- "$1" 2>/dev/null && [ -d "$2" ] || exit {EXIT_NO_DIR}; '
                f'tar -cf - -- "$2" | head -c {limit + 1} > "$3"'
            )
            r = await self.exec(
                ["sh", "-c", script, "sh", parent or "/", base, f"{inside}/out.tar"], workdir="/", timeout=600
            )
            if r.exit_code == EXIT_NO_DIR:
                raise FileNotFoundError(f"instance {self.name}: {path} does not exist")
            out = host / "out.tar"
            if r.exit_code != 0 or not out.is_file():
                raise SandboxError(
                    f"instance {self.name}: export {path} failed (exit {r.exit_code}): {r.output[-500:]}"
                )
            size = out.stat().st_size
            if size > limit:
                raise ExportTooLarge(f"instance {self.name}: {path} holds more than {limit} bytes")
            start = into.tell()
            with open(out, "rb") as f:
                try:
                    dropped = await asyncio.to_thread(safe_members, f, into, base)
                except tarfile.TarError as e:
                    raise SandboxError(
                        f"instance {self.name}: the tar of {path} is unreadable: {e}"
                    ) from None
            if dropped:
                log.info(
                    "instance %s: %d members of %s's tar dropped (outside it): %s",
                    self.name,
                    len(dropped),
                    path,
                    dropped[:5],
                )
            return into.tell() - start
        finally:
            shutil.rmtree(host, ignore_errors=True)

    async def put_tar(self, dest: str, data: BinaryIO) -> None:
        host, inside = self._xfer()
        try:
            data.seek(0)
            with open(host / "in.tar", "wb") as f:
                shutil.copyfileobj(data, f, 1 << 20)
            await self._exec_checked(["tar", "-xf", f"{inside}/in.tar", "-C", dest], f"unpacking into {dest}")
        finally:
            shutil.rmtree(host, ignore_errors=True)

    async def processes(self) -> list[Leftover]:
        return [host_process(p) for p in sorted(self._pids())]

    async def seal(self) -> list[Leftover]:
        """Every process of the instance stopped (SIGSTOP until none runs: a stopped process
        cannot fork or write), listed, then killed; its files stay readable, from the host."""
        self._sealed = True
        for _ in range(50):
            pids = self._pids()
            running = [p for p in pids if host_process(p).state not in ("T", "t", "Z", "?")]
            if not running:
                break
            signal_all(running, signal.SIGSTOP)
            await asyncio.sleep(0.01)
        left = await self.processes()
        await self.kill_all()
        return left

    async def exec_sealed(
        self,
        cmd: list[str],
        *,
        env: dict[str, str] | None = None,
        timeout: float | None = None,
        workdir: str | None = None,
    ) -> tuple[ExecResult, list[Leftover]]:
        """The tests under the supervisor (forwarder/reap.py) with a secret on its stdin; what it
        saw abandoned, and what the host still finds, are what they left. A supervisor that
        printed no report (killed by the tests) leaves a suspect entry of its own."""
        before = {p.pid for p in await self.processes()}
        if self.supervisor is None:
            r = await self.exec(cmd, env=env, timeout=timeout, workdir=workdir)
            left = [p for p in await self.seal() if p.pid not in before]
            return r, left
        secret = secrets.token_hex(16)
        r = await self.exec(
            [self.supervisor, REAPER, *cmd],
            env=env,
            timeout=timeout,
            workdir=workdir,
            stdin=f"{secret}\n".encode(),
        )
        output, report = report_of(r.output, secret)
        left = [p for p in await self.seal() if p.pid not in before]
        if report is None:
            if not r.timed_out:
                left.append(Leftover(0, "?", "the tests' supervisor printed no report (was it killed?)"))
        else:
            left += [Leftover(int(p), str(s), str(c)) for p, s, c in report.get("left") or []]
            if int(report.get("status", -1)) != r.exit_code:
                left.append(
                    Leftover(
                        0, "?", f"the supervisor reported exit {report.get('status')}, the exec {r.exit_code}"
                    )
                )
        return ExecResult(r.exit_code, output, timed_out=r.timed_out, seconds=r.seconds), left

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "runtime": "apptainer",
            "instance": self.name,
            "image": self.image,
            "network": "none",
        }
        out["user"] = self.user or ("root, without capabilities" if self.host_root else ROOTLESS)
        out["limits"] = self.limits
        if self.purpose == "verifier":
            out["supervisor"] = "reap.py" if self.supervisor else "none (the image has no python3)"
        return out

    async def stop(self) -> None:
        first = not self._stopped
        self._stopped = True
        for proc in list(self._procs):
            kill_group(proc.pid)
        if first:
            await self._kill_namespace()
            for attempt in range(5):  # a stop can fail while another apptainer command holds the instance
                r = await run_argv(stop_argv(self.binary, self.name), timeout=60)
                if self.name not in await list_instances(self.binary, self.name):
                    break
                log.info("instance %s: stop %d failed: %s", self.name, attempt + 1, r.output[-300:])
                await asyncio.sleep(0.5 * (attempt + 1))
            else:
                log.warning(
                    "instance %s could not be stopped; `apptainer instance stop %s`", self.name, self.name
                )
        if self.record_path is not None:
            self.record_path.unlink(missing_ok=True)
        shutil.rmtree(self.dir, ignore_errors=True)
