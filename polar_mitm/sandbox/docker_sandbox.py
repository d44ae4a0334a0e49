"""One sample's container (`DockerSandbox`): execs through the daemon's calls (`sandbox/daemon.py`),
the harness as its unprivileged user with every process killed at its end, files in and out as
tars read as untrusted (`sandbox/untrusted.py`), the verifier's tests sealed (frozen, listed,
killed) before the verdict is read. Started by `sandbox/docker.py`'s `DockerRuntime`.
"""

from __future__ import annotations

import asyncio
import io
import logging
import os
import tarfile
import time
from pathlib import Path, PurePosixPath
from typing import Any, BinaryIO, Protocol

from polar_mitm.proxy.certs import CA
from polar_mitm.sandbox.base import (
    HARNESS_ROOT,
    HOME_DIR,
    READ_LIMIT,
    ExecResult,
    ExportTooLarge,
    Leftover,
    SandboxError,
    Unreadable,
    chown,
    exec_then_seal,
    hand_over,
    host_process,
    tail,
)
from polar_mitm.sandbox.daemon import CHUNK, DaemonCalls, DaemonRefused, SdkCalls
from polar_mitm.sandbox.untrusted import tar_file, tree_size

log = logging.getLogger("polar_mitm.docker")


class Daemon(Protocol):
    """What a container needs of the runtime that started it (`DockerRuntime`): the daemon's
    calls, and its removal."""

    @property
    def calls(self) -> DaemonCalls | SdkCalls: ...

    async def remove(self, container: Any) -> None: ...


DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
HOME_SEED = f"{HARNESS_ROOT}/home-seed"  # the sample's `home`, read-only, copied into a HOME tmpfs


def _tar_of(src: Path, arcname: str) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        tar.add(str(src), arcname=arcname)
    return buf.getvalue()


class DockerSandbox:
    def __init__(
        self,
        runtime: Daemon,
        container: Any,
        workdir: str,
        ca: CA,
        path_prefix: list[str],
        base_path: str,
        *,
        user: str | None = None,
        proxy_address: tuple[str, int] | None = None,
        home: str | None = None,
        traversed: list[str] | None = None,
        quiet: bool = False,
    ):
        self.runtime = runtime
        self.container = container
        self.name = container.name
        self.workdir = workdir
        self.ca = ca
        self.path_prefix = path_prefix
        self.base_path = base_path
        self.user = user  # the harness's user, when it is not root
        self.proxy_address = proxy_address
        self.home = home
        self.traversed = traversed or []  # directories above the harness's trees (HarnessMount)
        self.quiet = quiet  # nothing of its own runs but its init (a verifier without a channel)
        self._stopped = False
        self._halted = False
        # While a verifier's tests run (exec_sealed): what a seal on their timeout found.
        self._sealing: list[Leftover] | None = None

    @property
    def calls(self) -> DaemonCalls | SdkCalls:
        return self.runtime.calls

    def _env(self, env: dict[str, str] | None) -> dict[str, str]:
        out = dict(env or {})
        path = out.get("PATH") or self.base_path
        out["PATH"] = ":".join([*self.path_prefix, path]) if self.path_prefix else path
        return out

    def _run(self, cmd: list[str], env: dict[str, str], workdir: str, user: str = "") -> tuple[int, bytes]:
        return self.calls.run(self.container.id, cmd, env, workdir, user)

    async def exec(
        self,
        cmd: list[str],
        *,
        env: dict[str, str] | None = None,
        timeout: float | None = None,
        workdir: str | None = None,
        user: str = "",
    ) -> ExecResult:
        if self._stopped or self._halted:
            raise SandboxError(f"container {self.name} is {'stopped' if self._stopped else 'halted'}")
        t0 = time.monotonic()
        fut = asyncio.ensure_future(
            asyncio.to_thread(self._run, cmd, self._env(env), workdir or self.workdir, user)
        )
        timed_out = False
        try:
            code, out = await asyncio.wait_for(asyncio.shield(fut), timeout)
        except TimeoutError:
            timed_out = True
            if self._sealing is not None:  # the tests overran: sealed as they stand, not restarted
                self._sealing.extend(await self.seal())
            else:
                await self._kill_all()
            code, out = await self._settle(fut)
        except asyncio.CancelledError:
            await asyncio.shield(self._kill_all(restart=False))  # it is being stopped
            raise
        except Exception as e:  # the daemon refused: the container is gone or broken
            raise SandboxError(f"container {self.name}: exec {cmd[0]} failed: {e}") from e
        return ExecResult(
            124 if timed_out else code, tail(out), timed_out=timed_out, seconds=time.monotonic() - t0
        )

    async def _settle(self, fut: asyncio.Future) -> tuple[int, bytes]:
        try:
            return await asyncio.wait_for(fut, 15)
        except Exception:
            return 124, b""

    async def _kill_all(self, restart: bool = True) -> None:
        try:
            await self.kill_all(restart=restart)
        except Exception as e:
            log.debug("kill in %s: %s", self.name, e)

    async def kill_all(self, *, restart: bool = True) -> None:
        """Kill the container (SIGKILL: every process in it, at once, whatever binaries the image
        has or the harness replaced) and start it again, the same filesystem, for scoring; the exec
        that overran returns. Its entrypoint (the forwarder, or `sleep infinity`) starts again."""

        def kill() -> None:
            try:
                self.calls.kill(self.container.id)
            except DaemonRefused as e:
                if "is not running" in str(e):
                    return  # it died by itself: it stays dead, and whoever runs it says so
                raise
            if restart:
                self.calls.wait(self.container.id, 30)
                self.calls.start(self.container.id)

        try:
            await asyncio.to_thread(kill)
        except Exception as e:  # the daemon refused or timed out
            raise SandboxError(f"container {self.name}: killing its processes failed: {e}") from e

    async def exec_harness(
        self, cmd: list[str], *, env: dict[str, str] | None = None, timeout: float | None = None
    ) -> ExecResult:
        owner = await self._hand_over()
        r = await self.exec(cmd, env=env, timeout=timeout, user=self.user or "")
        if await self._still_alive(r):  # a container that died stays dead: the pipeline says so
            if not r.timed_out:  # an overrun was killed already
                await self.kill_all()
            if owner is not None:
                await self._chown(owner, [self.workdir])
        return r

    async def _still_alive(self, r: ExecResult) -> bool:
        """Whether the container outlived the command. A command killed with it (exit 137, or no
        exit code) can return before the daemon has seen the container die: give it a moment."""
        if r.exit_code not in (137, -1) or r.timed_out:
            return await self.alive()
        for _ in range(10):
            if not await self.alive():
                return False
            await asyncio.sleep(0.2)
        return True

    async def _hand_over(self) -> str | None:
        """Make the workdir (and HOME) the harness user's (`sandbox.base.hand_over`); returns the
        workdir's owner before. An image where that fails runs the harness as root."""
        if self.user is None:
            return None
        owner = await hand_over(self, self.user, self.workdir, self.home, self.traversed)
        if owner is None:
            self.user = None
        return owner

    async def _chown(self, owner: str, paths: list[str]) -> bool:
        return await chown(self, owner, paths)

    async def put(self, src: Path, dest: str) -> None:
        d = PurePosixPath(dest)
        if d.parent != d.parent.parent:  # "/" is there: no exec (three daemon calls) to make it
            code, out = await asyncio.to_thread(
                self._run, ["mkdir", "-p", str(d.parent)], self._env(None), "/"
            )
            if code != 0:
                raise SandboxError(f"container {self.name}: mkdir {d.parent}: {tail(out, 500)}")
        data = await asyncio.to_thread(_tar_of, src, d.name)
        try:
            await asyncio.to_thread(self.calls.put_archive, self.container.id, str(d.parent), data)
        except Exception as e:
            raise SandboxError(f"container {self.name}: copy {src} to {dest}: {e}") from e

    async def read(self, path: str, limit: int = READ_LIMIT) -> bytes | None:
        def get() -> bytes | None:
            try:
                stream = self.calls.get_archive(self.container.id, path, CHUNK)
            except DaemonRefused as e:
                if e.status == 404:
                    return None
                raise
            try:
                return tar_file(iter(stream), path, limit)
            except tarfile.TarError as e:
                raise Unreadable(f"{path}: the daemon's archive of it is unreadable: {e}") from None
            finally:
                close = getattr(stream, "close", None)
                if close is not None:
                    close()  # stop the daemon's tar rather than draining it

        try:
            return await asyncio.to_thread(get)
        except Unreadable:
            raise
        except Exception as e:
            raise SandboxError(f"container {self.name}: read {path}: {e}") from e

    async def alive(self) -> bool:
        try:
            state = (await asyncio.to_thread(self.calls.inspect, self.container.id)).get("State") or {}
        except Exception:
            return False
        return state.get("Status") == "running"

    async def halt(self) -> None:
        """SIGKILL to the container's PID 1: the kernel ends every process in its PID namespace
        (setsid'd or not); the stopped container's files stay readable (`get_archive`)."""
        self._halted = True

        def kill() -> None:
            try:
                self.calls.kill(self.container.id)
            except DaemonRefused as e:  # 409: not running (it died, or halted already)
                if e.status not in (404, 409):
                    raise
            self.calls.wait(self.container.id, 30)

        try:
            await asyncio.to_thread(kill)
        except Exception as e:
            raise SandboxError(f"container {self.name}: halting it failed: {e}") from e

    async def export(self, path: str, limit: int, into: BinaryIO) -> int:
        def get() -> int:
            claimed = self._changed_size(path, limit)
            if claimed is not None and claimed > limit:
                raise ExportTooLarge(
                    f"container {self.name}: {path} holds more than {limit} bytes (by its files' sizes)"
                )
            try:
                stream = self.calls.get_archive(self.container.id, path, CHUNK)
            except DaemonRefused as e:
                if e.status != 404:
                    raise
                raise FileNotFoundError(f"container {self.name}: {path} does not exist") from None
            n = 0
            try:
                for chunk in stream:
                    n += len(chunk)
                    if n > limit:
                        raise ExportTooLarge(f"container {self.name}: {path} holds more than {limit} bytes")
                    into.write(chunk)
            finally:
                close = getattr(stream, "close", None)
                if close is not None:
                    close()  # stop the daemon's tar rather than draining it
            return n

        try:
            return await asyncio.to_thread(get)
        except (SandboxError, FileNotFoundError):
            raise
        except Exception as e:
            raise SandboxError(f"container {self.name}: export {path}: {e}") from e

    def _changed_size(self, path: str, limit: int) -> int | None:
        """What the container's own layer holds under `path` by file sizes (the overlay's upper
        directory, read on this host without opening a file), or None where it cannot be seen
        (another storage driver, a remote daemon). The image's files are not counted: they are
        the task's, not the agent's."""
        try:
            attrs = self.calls.inspect(self.container.id)
            upper = ((attrs.get("GraphDriver") or {}).get("Data") or {}).get("UpperDir")
        except Exception:
            return None
        if not upper or not os.path.isdir(upper):
            return None
        return tree_size(os.path.join(upper, path.lstrip("/")), limit)

    async def put_tar(self, dest: str, data: BinaryIO) -> None:
        data.seek(0)
        try:
            await asyncio.to_thread(self.calls.put_archive, self.container.id, dest, data)
        except Exception as e:
            raise SandboxError(f"container {self.name}: unpacking into {dest}: {e}") from e

    supervises = True

    async def exec_sealed(
        self,
        cmd: list[str],
        *,
        env: dict[str, str] | None = None,
        timeout: float | None = None,
        workdir: str | None = None,
    ) -> tuple[ExecResult, list[Leftover]]:
        # A verifier without a channel runs nothing but its init (`sleep infinity`, never listed)
        # and our own commands, each ended before the tests: whatever is there after them is
        # theirs, so nothing is listed before.
        before: set[int] | None = set() if self.quiet else None
        if before is None:
            before = {p.pid for p in await self.processes()}
        self._sealing = []
        try:
            r, left = await exec_then_seal(
                self, cmd, env=env, timeout=timeout, workdir=workdir, before=before
            )
        finally:
            sealed, self._sealing = self._sealing, None
        return r, [*(p for p in sealed if p.pid not in before), *left]

    def _host_processes(self) -> list[Leftover]:
        """The container's processes but its init, read from this host's /proc: the children of
        its init (those the init never reaps stay there as zombies) and everything the daemon's
        `top` lists. Where /proc is not this host's (a remote daemon), `top` alone."""
        state = self.calls.inspect(self.container.id).get("State") or {}
        init = int(state.get("Pid") or 0)
        found: dict[int, Leftover] = {}
        if init > 0:
            try:
                kids = Path(f"/proc/{init}/task/{init}/children").read_text().split()
            except OSError:
                kids = []
            for pid in map(int, kids):
                found[pid] = host_process(pid)
        if init <= 0 and state.get("Status") != "paused":
            return []
        try:
            top = self.calls.top(self.container.id, "-o pid,stat,args")
        except Exception:
            top = {}
        for row in top.get("Processes") or []:
            pid = int(row[0])
            if pid != init and pid not in found:
                found[pid] = Leftover(pid, (row[1] or "?")[:1], row[2] if len(row) > 2 else "")
        return sorted(found.values(), key=lambda p: p.pid)

    async def processes(self) -> list[Leftover]:
        try:
            return await asyncio.to_thread(self._host_processes)
        except Exception as e:
            raise SandboxError(f"container {self.name}: listing its processes failed: {e}") from e

    async def seal(self) -> list[Leftover]:
        """`docker pause` (the cgroup freezer: every process stops where it is, at once), the
        processes listed while frozen, then SIGKILL to all; `read` and `export` still work.

        The freezer can fail on a busy cgroup ("unable to freeze": a fork loop); then the listing
        happens unfrozen, which loses nothing: whatever writes after the command ended is a
        process the init never reaps, listed running or as a zombie."""

        def freeze() -> None:
            self.calls.pause(self.container.id)

        try:
            await asyncio.to_thread(freeze)
        except Exception as e:
            log.info("container %s: not frozen (%s); listing its processes as they run", self.name, e)
        left = await self.processes()
        await self.halt()
        return left

    def describe(self) -> dict[str, Any]:
        attrs = self.container.attrs or {}
        config, host = attrs.get("Config") or {}, attrs.get("HostConfig") or {}
        return {
            "runtime": "docker",
            "container": self.name,
            "container_id": (self.container.id or "")[:12],
            "image": config.get("Image"),
            "user": config.get("User") or "root",
            "network": host.get("NetworkMode"),
        }

    async def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        await self.runtime.remove(self.container)


async def seed_home(sb: DockerSandbox) -> None:
    """The sample's `home` (the recipe's files, at HOME_SEED) copied into the HOME tmpfs, as root
    before the hand-over (the daemon's archive calls write beneath a tmpfs, not into it)."""
    r = await sb.exec(["cp", "-a", f"{HOME_SEED}/.", f"{HOME_DIR}/"], workdir="/")
    if r.exit_code != 0:
        await sb.stop()
        raise SandboxError(f"container {sb.name}: cannot copy the harness's HOME files in: {r.output[-500:]}")
