"""The `local` runtime: each sample in its own temporary directory on the host.

No isolation: commands run as host processes with the task's workdir mapped to a fresh temporary
directory (what `polar-mitm run` does for one harness), with an allow-list of the host's
variables (`harness/local.py`'s `host_env`), not the host's environment. Good for quick loops and for tasks whose
commands stay inside their workdir; tasks that write to absolute paths (Harbor's `/logs`,
SWE-bench's `/testbed`) need a container runtime.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import stat
import tarfile
from pathlib import Path
from typing import Any, BinaryIO

from polar_mitm.procs import kill_group
from polar_mitm.proxy.certs import CA
from polar_mitm.sandbox.base import (
    READ_LIMIT,
    ExecResult,
    ExportTooLarge,
    Leftover,
    Limits,
    SandboxError,
    SandboxSpec,
    Unreadable,
    exec_then_seal,
    host_env,
    run_process,
)
from polar_mitm.sandbox.untrusted import tree_size
from polar_mitm.tasks.model import Task


class TempdirSandbox:
    def __init__(self, root: Path, ca: CA, path_prefix: list[str]):
        self.root = root
        self.name = root.name
        self.workdir = str(root / "work")
        self.ca = ca
        self.path_prefix = path_prefix
        self.proxy_address: tuple[str, int] | None = None  # host processes use the proxy's own
        self._procs: set[asyncio.subprocess.Process] = set()
        self._stopped = False

    def host_path(self, path: str) -> Path:
        """A sandbox path on the host: relative paths and paths under the workdir stay in it."""
        p = Path(path)
        return p if p.is_absolute() else Path(self.workdir) / p

    async def exec(
        self,
        cmd: list[str],
        *,
        env: dict[str, str] | None = None,
        timeout: float | None = None,
        workdir: str | None = None,
    ) -> ExecResult:
        if self._stopped:
            raise SandboxError(f"sandbox {self.name} is stopped")
        full_env = {**host_env(), **(env or {})}
        if self.path_prefix:
            full_env["PATH"] = os.pathsep.join([*self.path_prefix, full_env.get("PATH", "")])
        full_env["PWD"] = workdir or self.workdir
        return await run_process(
            cmd, env=full_env, cwd=workdir or self.workdir, timeout=timeout, procs=self._procs
        )

    async def exec_harness(
        self, cmd: list[str], *, env: dict[str, str] | None = None, timeout: float | None = None
    ) -> ExecResult:
        """The harness as a host process of ours; its process group is killed at its end (a
        process that left the group is beyond reach: this runtime isolates nothing)."""
        r = await self.exec(cmd, env=env, timeout=timeout)
        await self.kill_all()
        return r

    async def kill_all(self) -> None:
        for proc in list(self._procs):
            kill_group(proc.pid)

    async def put(self, src: Path, dest: str) -> None:
        target = self.host_path(dest)
        target.parent.mkdir(parents=True, exist_ok=True)
        if src.is_dir():
            shutil.copytree(src, target, dirs_exist_ok=True, symlinks=True)
        else:
            shutil.copy2(src, target)

    async def read(self, path: str, limit: int = READ_LIMIT) -> bytes | None:
        p = self.host_path(path)
        try:
            st = p.lstat()
        except (FileNotFoundError, NotADirectoryError):
            return None
        if not stat.S_ISREG(st.st_mode):
            raise Unreadable(f"{path} is not a regular file (mode {stat.filemode(st.st_mode)})")
        if st.st_size > limit:
            raise Unreadable(f"{path} holds {st.st_size} bytes, more than the {limit} read")
        with open(p, "rb") as f:
            return f.read(limit)

    async def alive(self) -> bool:
        return not self._stopped and self.root.is_dir()

    async def halt(self) -> None:
        """Kills the process groups of the commands it ran; a process that left its group
        (setsid) survives: this runtime does not isolate (see `describe`)."""
        for proc in list(self._procs):
            kill_group(proc.pid)

    async def export(self, path: str, limit: int, into: BinaryIO) -> int:
        src = self.host_path(path)
        if not src.is_dir():
            raise FileNotFoundError(f"sandbox {self.name}: {path} is not a directory")

        def pack() -> int:
            if tree_size(src, limit) > limit:
                raise ExportTooLarge(f"sandbox {self.name}: {path} holds more than {limit} bytes")
            start = into.tell()
            with tarfile.open(fileobj=into, mode="w") as tar:
                tar.add(str(src), arcname=src.name)
            return into.tell() - start

        return await asyncio.to_thread(pack)

    async def put_tar(self, dest: str, data: BinaryIO) -> None:
        def unpack() -> None:
            with tarfile.open(fileobj=data) as tar:
                tar.extractall(self.host_path(dest), filter="data")  # nothing outside dest

        await asyncio.to_thread(unpack)

    supervises = False  # host processes: one that left its group (setsid) is not seen

    async def exec_sealed(
        self,
        cmd: list[str],
        *,
        env: dict[str, str] | None = None,
        timeout: float | None = None,
        workdir: str | None = None,
    ) -> tuple[ExecResult, list[Leftover]]:
        return await exec_then_seal(self, cmd, env=env, timeout=timeout, workdir=workdir)

    async def processes(self) -> list[Leftover]:
        return []

    async def seal(self) -> list[Leftover]:
        await self.halt()
        return []

    def describe(self) -> dict[str, Any]:
        return {"runtime": "local", "directory": str(self.root), "user": os.environ.get("USER", "")}

    async def stop(self) -> None:
        self._stopped = True
        for proc in list(self._procs):
            kill_group(proc.pid)
        shutil.rmtree(self.root, ignore_errors=True)


class TempdirRuntime:
    """`--runtime local`."""

    name = "local"
    isolated = False
    fresh_verifier = False  # a host directory: scored in place, as the detail records
    mounts_inputs = False
    snapshots = False

    def unenforced(self, limits: Limits) -> str | None:
        return None  # the host itself, trusted (`--runtime local`): no sandbox, nothing to bound

    async def snapshot(self, sandbox: Any, name: str) -> Any:
        raise SandboxError(f"the {self.name} runtime keeps no snapshots; its verifier runs separate")

    async def drop_snapshot(self, snapshot: Any) -> None:
        return None

    async def check(self) -> None:
        return None

    async def prepare(self, task: Task) -> None:
        return None

    async def start(self, task: Task, spec: SandboxSpec) -> TempdirSandbox:
        root = spec.session_dir / "sandbox"
        (root / "work").mkdir(parents=True, exist_ok=True)
        prefix = [str(spec.harness.bin)] if spec.harness is not None else []
        return TempdirSandbox(root, spec.ca, prefix)

    async def cleanup(self, labels: dict[str, str]) -> int:
        return 0
