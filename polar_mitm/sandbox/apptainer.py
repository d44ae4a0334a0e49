"""The `apptainer` runtime: each sample in its own Apptainer instance (HPC clusters without Docker).

One instance per sample, started from the task's image with no network (`--net --network none`:
its own namespace with loopback only), without the host's home, working directory or /tmp, with a
writable overlay directory in the sample's session directory, and with our session directory, CA
certificate and bundle, (read-only) harness installation, and the sample's channel to the proxy
(its Unix socket and the forwarder, read-only; `sandbox/channel.py`) bound in at the paths
`sandbox/base.py` names. Untested against a real Apptainer here (no binary can be installed). Commands run with
`apptainer exec instance://NAME`, with a clean environment plus the variables asked for.

The command lines are built by the pure functions below (`start_argv`, `exec_argv`, `env_options`,
`image_ref`, `instance_name`) and run as asyncio subprocesses. spython finds the binary
(`spython.utils.check_install`) and lists instances (`spython.utils.run_command`); its `Client`
is not used because it always runs `singularity` (hosts with only `apptainer` have none) and its
`execute` blocks without a timeout.

Apptainer keeps no labels, so each instance we start is recorded as a JSON file in a registry
directory (`$POLAR_MITM_CACHE/apptainer/instances`, else `~/.cache/polar-mitm/apptainer/instances`);
`cleanup(labels)` stops the recorded instances whose labels match.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import re
import shlex
import shutil
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any, BinaryIO

from pydantic import BaseModel, Field

from polar_mitm.procs import kill_group
from polar_mitm.sandbox.base import (
    CHANNEL_SOCKET,
    FORWARDER_ROOT,
    HARNESS_BIN,
    NODE_BIN,
    NPM_MODULES,
    SESSION_DIR,
    ExecResult,
    Leftover,
    RuntimeUnavailable,
    SandboxError,
    SandboxSpec,
    ca_mounts,
    run_process,
    sandbox_ca,
)
from polar_mitm.sandbox.channel import FORWARD_PORT, FORWARDER_DIR
from polar_mitm.tasks.model import Task

BINARIES = ("apptainer", "singularity")  # `singularity` is Apptainer's compatibility name too
UNAVAILABLE = (
    "apptainer: neither 'apptainer' nor 'singularity' is on PATH; install Apptainer "
    "(https://apptainer.org) or use --runtime docker / local"
)
# Host paths Apptainer would otherwise mount: the sandbox sees only its image and our binds.
# (`--containall` would also do this, but it gives the instance its own network namespace.)
NO_MOUNT = "home,cwd,tmp"
NO_NETWORK = ["--net", "--network", "none"]  # a network namespace of its own, loopback only
# Apptainer's own transports (`internal/pkg/util/uri`): a reference starting with one is kept.
TRANSPORTS = frozenset(
    {
        "library",
        "shub",
        "docker",
        "docker-archive",
        "docker-daemon",
        "oci",
        "oci-archive",
        "http",
        "https",
        "oras",
        "ipfs",
    }
)
_NAME_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]")  # Apptainer's instance names: ^[a-zA-Z0-9._-]+$
NAME_MAX = 100
# `--env K=V` is parsed as CSV (pflag's string-to-string): a comma splits the pair, a quote
# starts a quoted field, so such values go through an env file, as do long or many variables.
_ENV_INLINE_UNSAFE = re.compile(r"[,\"\n\r]")
ENV_INLINE_MAX_VARS = 32
ENV_INLINE_MAX_CHARS = 4096
EXIT_NOT_A_FILE = 3  # `read`'s shell line: the path is missing or not a regular file


# --- names and images ---------------------------------------------------------------------------


def instance_name(name: str) -> str:
    """`name` as an Apptainer instance name: characters outside [A-Za-z0-9_.-] become "-"; a name
    that had to change (or is too long) gets a short hash of the original so two never collide."""
    safe = _NAME_UNSAFE.sub("-", name).lstrip(".-")
    if safe == name and 0 < len(name) <= NAME_MAX:
        return name
    digest = hashlib.sha1(name.encode()).hexdigest()[:8]
    return f"{safe[: NAME_MAX - 9] or 'sandbox'}-{digest}"


def image_ref(image: str) -> str:
    """What `apptainer instance start` is given for a task's `image`.

    A path (`.sif`, `.simg`, or starting with `/`, `.` or `~`) is used as is; a reference with one
    of Apptainer's transports (`docker://`, `docker-daemon:`, `oras://`, `library://`, ...) too;
    anything else is a Docker image name (`ubuntu:24.04`, `ghcr.io/org/img@sha256:...`) and becomes
    `docker://NAME`: Apptainer pulls it and converts it to a SIF in its own cache
    (`$APPTAINER_CACHEDIR`) on first use and reuses the conversion after.
    """
    image = image.strip()
    if image.startswith(("/", ".", "~")) or image.endswith((".sif", ".simg")):
        return os.path.expanduser(image)
    if not is_local_image(image):
        return image
    return f"docker://{image}"


def is_local_image(ref: str) -> bool:
    """True for an image_ref that is a file or directory on the host (not a transport reference)."""
    return "://" not in ref and ref.split(":", 1)[0] not in TRANSPORTS


def task_image(task: Task) -> str:
    """The task's image reference for Apptainer, or a SandboxError saying what to do."""
    if task.image:
        return image_ref(task.image)
    if task.dockerfile is not None:
        raise SandboxError(
            f"apptainer: task {task.id!r} has only a Dockerfile ({task.dockerfile}) and Apptainer "
            "cannot build Dockerfiles: build it with docker (`docker build -t NAME ...`), then set "
            "the task's image to NAME (a pushed image, or docker-daemon:NAME for the local daemon), "
            "or use --runtime docker"
        )
    raise SandboxError(f"apptainer: task {task.id!r} names no image (a .sif file or a docker image)")


# --- command lines ------------------------------------------------------------------------------


def bind_option(src: Path | str, dst: str, *, read_only: bool = False) -> str:
    """A `--bind` value; Apptainer splits binds on "," and fields on ":", so neither may appear."""
    src = str(src)
    for path in (src, dst):
        if "," in path or ":" in path:
            raise SandboxError(
                f"apptainer: cannot bind {path!r}: Apptainer's --bind cannot express a path with ',' "
                "or ':'; move it (or the session directory) to a path without them"
            )
    return f"{src}:{dst}:ro" if read_only else f"{src}:{dst}"


def binds(spec: SandboxSpec) -> list[str]:
    """The session directory (read-write), our CA's public files, the harness installation and
    the channel's socket and forwarder (read-only). The CA files are bound one by one: the
    directory also holds the private key."""
    out = [bind_option(spec.session_dir.resolve(), SESSION_DIR)]
    for host, inside in ca_mounts(spec.ca):
        out.append(bind_option(host.resolve(), inside, read_only=True))
    if spec.channel is not None and spec.purpose == "agent":
        out.append(bind_option(spec.channel, CHANNEL_SOCKET, read_only=True))
        out.append(bind_option(FORWARDER_DIR.resolve(), FORWARDER_ROOT, read_only=True))
    if spec.harness is not None and spec.purpose == "agent":
        if spec.harness.modules is not None:
            out.append(bind_option(spec.harness.modules.resolve(), NPM_MODULES, read_only=True))
        for host, inside in spec.harness.trees:  # a PyPI harness: at the host's own paths
            out.append(bind_option(host.resolve(), inside, read_only=True))
        out.append(bind_option(spec.harness.bin.resolve(), HARNESS_BIN, read_only=True))
        if spec.harness.node is not None:
            out.append(bind_option(spec.harness.node.resolve().parent, NODE_BIN, read_only=True))
    return out


def harness_path(spec: SandboxSpec) -> list[str]:
    """The sandbox directories to put first on PATH: the harness links, then node's directory."""
    if spec.harness is None or spec.purpose != "agent":
        return []
    return [HARNESS_BIN, NODE_BIN] if spec.harness.node is not None else [HARNESS_BIN]


def start_argv(binary: str, image: str, name: str, spec: SandboxSpec, overlay: Path | None) -> list[str]:
    """`instance start`: no network but loopback (`--net --network none`; the proxy is reached
    through the channel's socket), no host home/cwd/tmp, the environment left out (variables come
    with each exec), writes going to `overlay` (a directory, kept for the instance's life and not
    limited in size) or, without one, to a tmpfs."""
    argv = [binary, "instance", "start", "--cleanenv", "--no-mount", NO_MOUNT, *NO_NETWORK]
    argv += ["--overlay", str(overlay)] if overlay is not None else ["--writable-tmpfs"]
    for bind in binds(spec):
        argv += ["--bind", bind]
    return [*argv, image, name]


def needs_env_file(env: Mapping[str, str]) -> bool:
    """True when `--env K=V` flags cannot carry env faithfully (see _ENV_INLINE_UNSAFE)."""
    if len(env) > ENV_INLINE_MAX_VARS:
        return True
    return any(_ENV_INLINE_UNSAFE.search(v) or len(v) > ENV_INLINE_MAX_CHARS for v in env.values())


def env_file_text(env: Mapping[str, str]) -> str:
    """An `--env-file`: Apptainer evaluates it as a shell script (no commands run) and takes the
    variables it assigns, so each value is shell-quoted."""
    return "".join(f"{k}={shlex.quote(v)}\n" for k, v in env.items())


def env_options(env: Mapping[str, str], env_file: Path) -> tuple[list[str], str | None]:
    """The exec options that pass `env`, and the text to write to `env_file` when they use it."""
    if not env:
        return [], None
    if needs_env_file(env):
        return ["--env-file", str(env_file)], env_file_text(env)
    out: list[str] = []
    for k, v in env.items():
        out += ["--env", f"{k}={v}"]
    return out, None


def exec_env(env: Mapping[str, str] | None, path_prefix: list[str]) -> dict[str, str]:
    """env with the harness directories first on PATH: prepended to a PATH given here, else
    through Apptainer's PREPEND_PATH (so the image's own PATH stays behind them)."""
    out = dict(env or {})
    if path_prefix:
        if "PATH" in out:
            out["PATH"] = ":".join([*path_prefix, out["PATH"]])
        else:
            out["PREPEND_PATH"] = ":".join(path_prefix)
    return out


def exec_argv(binary: str, name: str, cmd: list[str], workdir: str, env_opts: list[str]) -> list[str]:
    """`exec` in the running instance, in `workdir`, with only the image's environment and ours."""
    return [binary, "exec", "--cleanenv", "--pwd", workdir, *env_opts, f"instance://{name}", *cmd]


def stop_argv(binary: str, name: str) -> list[str]:
    return [binary, "instance", "stop", name]


def list_argv(binary: str, name: str | None = None) -> list[str]:
    return [binary, "instance", "list", "--json", *([name] if name else [])]


def listed_names(text: str) -> set[str]:
    """Instance names in `instance list --json` output (`{"instances": [{"instance": NAME, ...}]}`)."""
    try:
        data = json.loads(text)
    except ValueError:
        return set()
    return {i.get("instance") or i.get("daemon_name") for i in data.get("instances") or []} - {None}


# --- processes ----------------------------------------------------------------------------------


def find_binary() -> str | None:
    """The full path of `apptainer` (or `singularity`) when it is on PATH and answers --version."""
    from spython.utils import check_install

    for name in BINARIES:
        path = shutil.which(name)
        if path and check_install(path):
            return path
    return None


async def run_argv(
    argv: list[str], timeout: float | None = None, procs: set[asyncio.subprocess.Process] | None = None
) -> ExecResult:
    """`run_process` for Apptainer's command lines: killing `apptainer exec` ends the command in
    the instance too (it runs as its child)."""
    return await run_process(argv, timeout=timeout, procs=procs)


# --- registry -----------------------------------------------------------------------------------


def default_registry_dir() -> Path:
    root = os.environ.get("POLAR_MITM_CACHE")
    return (Path(root) if root else Path.home() / ".cache" / "polar-mitm") / "apptainer" / "instances"


class InstanceRecord(BaseModel):
    """One instance we started, kept until it is stopped (what `cleanup` finds after a crash)."""

    name: str
    binary: str
    image: str
    session_dir: Path
    labels: dict[str, str] = Field(default_factory=dict)
    started_at: float


# --- sandbox ------------------------------------------------------------------------------------


class ApptainerSandbox:
    """One running instance. Files cross through the session directory, which both sides see."""

    def __init__(
        self,
        *,
        binary: str,
        name: str,
        workdir: str,
        spec: SandboxSpec,
        record_path: Path | None = None,
        overlay: Path | None = None,
    ):
        self.binary = binary
        self.name = name
        self.workdir = workdir
        self.ca = sandbox_ca(spec.ca)
        self.path_prefix = harness_path(spec)
        self.proxy_address = ("127.0.0.1", FORWARD_PORT) if spec.channel is not None else None
        self.session_dir = spec.session_dir
        self.record_path = record_path
        self.overlay = overlay
        self._procs: set[asyncio.subprocess.Process] = set()
        self._stopped = False

    def _xfer(self) -> tuple[Path, str]:
        """A fresh transfer directory: its host path and its path in the sandbox."""
        rel = Path("xfer") / uuid.uuid4().hex
        host = self.session_dir / rel
        host.mkdir(parents=True)
        return host, f"{SESSION_DIR}/{rel.as_posix()}"

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
        full_env = exec_env(env, self.path_prefix)
        env_file = self.session_dir / "env" / f"{uuid.uuid4().hex}.env"
        opts, text = env_options(full_env, env_file)
        if text is not None:
            env_file.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(env_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # may hold credentials
            with os.fdopen(fd, "w") as f:
                f.write(text)
        argv = exec_argv(self.binary, self.name, cmd, workdir or self.workdir, opts)
        try:
            result = await run_argv(argv, timeout, self._procs)
        finally:
            env_file.unlink(missing_ok=True)
        if result.exit_code == 255 and not self._stopped and not await self.alive():
            raise SandboxError(f"apptainer: instance {self.name} is gone: {result.output[-2000:]}")
        return result

    async def exec_harness(
        self, cmd: list[str], *, env: dict[str, str] | None = None, timeout: float | None = None
    ) -> ExecResult:
        r = await self.exec(cmd, env=env, timeout=timeout)
        await self.kill_all()
        return r

    async def kill_all(self) -> None:
        """Kill the `apptainer exec` process groups we started (what they started in the instance
        is their child; a process that left its group stays: Apptainer has no container-wide kill
        short of stopping the instance)."""
        for proc in list(self._procs):
            kill_group(proc.pid)

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
        result = await self.exec(cmd)
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

    async def read(self, path: str) -> bytes | None:
        host, inside = self._xfer()
        try:
            script = f'[ -f "$1" ] || exit {EXIT_NOT_A_FILE}; cp -- "$1" "$2"'
            result = await self.exec(["sh", "-c", script, "sh", path, f"{inside}/data"])
            if result.exit_code == EXIT_NOT_A_FILE:
                return None
            if result.exit_code != 0:
                raise SandboxError(
                    f"apptainer: reading {path} failed in {self.name} (exit {result.exit_code}): {result.output}"
                )
            return (host / "data").read_bytes()
        finally:
            shutil.rmtree(host, ignore_errors=True)

    async def alive(self) -> bool:
        if self._stopped:
            return False
        return self.name in await list_instances(self.binary, self.name)

    # Scoring stays in the instance (`ApptainerRuntime.fresh_verifier` is False): a fresh,
    # trustworthy copy of an instance's files is not built yet (untested here, no Apptainer).
    async def halt(self) -> None:
        for proc in list(self._procs):
            kill_group(proc.pid)

    async def export(self, path: str, limit: int, into: BinaryIO) -> int:
        raise SandboxError(f"instance {self.name}: export is not supported by the apptainer runtime")

    async def put_tar(self, dest: str, data: BinaryIO) -> None:
        raise SandboxError(f"instance {self.name}: put_tar is not supported by the apptainer runtime")

    supervises = False  # scoring stays in the instance (see above)

    async def processes(self) -> list[Leftover]:
        return []

    async def seal(self) -> list[Leftover]:
        await self.halt()
        return []

    def describe(self) -> dict[str, Any]:
        return {"runtime": "apptainer", "instance": self.name}

    async def stop(self) -> None:
        first = not self._stopped
        self._stopped = True
        for proc in list(self._procs):
            kill_group(proc.pid)
        if first:
            await run_argv(stop_argv(self.binary, self.name), timeout=60)  # non-zero: already gone
        if self.record_path is not None:
            self.record_path.unlink(missing_ok=True)
        shutil.rmtree(self.session_dir / "xfer", ignore_errors=True)
        if self.overlay is not None:
            shutil.rmtree(self.overlay, ignore_errors=True)


async def list_instances(binary: str, name: str | None = None) -> set[str]:
    """Names of the running instances (all of the user's, or just `name`), through spython."""
    from spython.utils import run_command

    result = await asyncio.to_thread(run_command, list_argv(binary, name), quiet=True)
    if not result or result.get("return_code") != 0:
        return set()
    return set().union(*(listed_names(m) for m in result.get("message") or []))


# --- runtime ------------------------------------------------------------------------------------


class ApptainerRuntime:
    """`--runtime apptainer`.

    `binary`: the apptainer (or singularity) executable, else found on PATH by `check()`.
    `registry_dir`: where started instances are recorded for `cleanup` (default above).
    `overlay`: True for a writable overlay directory per sample under its session directory;
    False for `--writable-tmpfs` (in memory, small by default: Apptainer's `sessiondir max size`).
    Hosts that run Apptainer setuid allow overlay directories to root only: when a start fails on
    the overlay, the runtime retries it, and the later ones, with the tmpfs.
    """

    name = "apptainer"
    isolated = True
    fresh_verifier = False  # scored in the agent's own instance, as the detail records

    def __init__(self, *, binary: str | None = None, registry_dir: Path | None = None, overlay: bool = True):
        self.binary = binary
        self.registry_dir = registry_dir or default_registry_dir()
        self.overlay = overlay

    async def _binary(self) -> str:
        if self.binary is None:
            self.binary = await asyncio.to_thread(find_binary)
        if self.binary is None:
            raise RuntimeUnavailable(UNAVAILABLE)
        return self.binary

    async def check(self) -> None:
        await self._binary()

    async def prepare(self, task: Task) -> None:
        """Check the task's image can be given to Apptainer (a docker reference is pulled and
        converted by Apptainer itself on the first start, cached in its own cache)."""
        image = task_image(task)
        if is_local_image(image) and not Path(image).exists():
            raise SandboxError(f"apptainer: task {task.id!r}: image file {image} does not exist")

    async def start(self, task: Task, spec: SandboxSpec) -> ApptainerSandbox:
        binary = await self._binary()
        image = task_image(task)
        name = instance_name(spec.name)
        spec.session_dir.mkdir(parents=True, exist_ok=True)
        self.registry_dir.mkdir(parents=True, exist_ok=True)
        record_path = self.registry_dir / f"{name}.json"
        record = InstanceRecord(
            name=name,
            binary=binary,
            image=image,
            session_dir=spec.session_dir,
            labels=spec.labels,
            started_at=time.time(),
        )
        record_path.write_text(record.model_dump_json())  # before the start: a crash mid-start is found too
        overlay = spec.session_dir / "overlay" if self.overlay else None
        if overlay is not None:
            overlay.mkdir(parents=True, exist_ok=True)
        result = await run_argv(start_argv(binary, image, name, spec, overlay))
        if result.exit_code != 0 and overlay is not None and "overlay" in result.output.lower():
            self.overlay = False
            shutil.rmtree(overlay, ignore_errors=True)
            overlay = None
            result = await run_argv(start_argv(binary, image, name, spec, None))
        if result.exit_code != 0:
            record_path.unlink(missing_ok=True)
            raise SandboxError(f"apptainer: instance start for {task.id!r} ({image}) failed: {result.output}")
        sandbox = ApptainerSandbox(
            binary=binary,
            name=name,
            workdir=task.workdir,
            spec=spec,
            record_path=record_path,
            overlay=overlay,
        )
        # The workdir, and $HOME: without the host's home mounted, the path Apptainer gives HOME
        # does not exist in the image, and harnesses keep their settings there.
        made = await sandbox.exec(
            ["sh", "-c", 'mkdir -p -- "$1" ${HOME:+"$HOME"}', "sh", task.workdir], workdir="/"
        )
        if made.exit_code != 0:
            await sandbox.stop()
            raise SandboxError(
                f"apptainer: cannot create the workdir {task.workdir} in {name}: {made.output}"
            )
        if spec.channel is not None and spec.purpose == "agent":
            try:
                await sandbox.start_forwarder(
                    node=spec.harness is not None and spec.harness.node is not None,
                    python=spec.harness.python if spec.harness is not None else None,
                )
            except BaseException:
                await sandbox.stop()
                raise
        return sandbox

    async def cleanup(self, labels: dict[str, str]) -> int:
        """Stop every recorded instance whose labels include all of `labels`."""
        if not self.registry_dir.is_dir():
            return 0
        count = 0
        for path in sorted(self.registry_dir.glob("*.json")):
            try:
                record = InstanceRecord.model_validate_json(path.read_text())
            except (OSError, ValueError):
                continue
            if any(record.labels.get(k) != v for k, v in labels.items()):
                continue
            await run_argv(stop_argv(self.binary or record.binary, record.name), timeout=60)
            path.unlink(missing_ok=True)
            count += 1
        return count
