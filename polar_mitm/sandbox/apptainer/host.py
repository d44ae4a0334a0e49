"""The host's side of Apptainer: finding the binary, running its command lines, the processes of
an instance's PID namespace as the host sees them, the running instances, and the file system
images that bound an instance's /tmp and HOME.
"""

from __future__ import annotations

import asyncio
import os
import pwd
import shutil
from pathlib import Path

from polar_mitm.cache import cache_dir
from polar_mitm.sandbox.apptainer.argv import BINARIES, disk_argv, disk_images, list_argv, listed
from polar_mitm.sandbox.base import HOME_DIR, ExecResult, Limits, SandboxError, SandboxSpec, run_process


def find_binary() -> str | None:
    """`POLAR_MITM_APPTAINER`, else `apptainer` (or `singularity`) on PATH, else the one
    scripts/install.sh linked into polar-mitm's cache, when it answers --version."""
    from spython.utils import check_install

    given = os.environ.get("POLAR_MITM_APPTAINER")
    cands: list[str | None] = [given] if given else []
    cands += [shutil.which(n) for n in BINARIES]
    cands += [shutil.which(n, path=str(cache_dir() / "bin")) for n in BINARIES]
    for path in cands:
        if path and check_install(path):
            return path
    return None


async def run_argv(
    argv: list[str],
    timeout: float | None = None,
    procs: set[asyncio.subprocess.Process] | None = None,
    stdin: bytes | None = None,
) -> ExecResult:
    """`run_process` for Apptainer's command lines: killing `apptainer exec` ends the command in
    the instance too (it runs as its child)."""
    return await run_process(argv, timeout=timeout, procs=procs, stdin=stdin)


def namespace_pids(init: int) -> list[int]:
    """The host pids of the processes in the PID namespace whose init is host pid `init`, but it."""
    try:
        ns = os.readlink(f"/proc/{init}/ns/pid")
    except OSError:
        return []
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == init:
            continue
        try:
            if os.readlink(f"/proc/{name}/ns/pid") == ns:
                out.append(int(name))
        except OSError:
            continue
    return out


def signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


async def list_instances(binary: str, name: str | None = None) -> dict[str, int]:
    """The running instances (all of the user's, or just `name`) and their inits' host pids."""
    r = await run_argv(list_argv(binary, name), timeout=60)
    if r.exit_code != 0:
        return {}
    return listed(r.output[r.output.find("{") :] if "{" in r.output else "")


async def make_disk_images(spec: SandboxSpec, limits: Limits, mke2fs: str) -> dict[str, Path]:
    """The file system images `disk_images` names, made: what the sandbox writes there is refused
    past the size (ENOSPC) and takes at most that of the host's disk. HOME's holds a copy of the
    sample's `home` (the recipe's files); each root is owned by the session directory's owner
    and that user's group (who runs Apptainer, rootless: a group it does not have would be no
    one's in its user namespace; root hands HOME over to the harness's user, as the workdir)."""
    images = disk_images(spec, limits)
    uid = spec.session_dir.stat().st_uid
    try:
        owner = f"{uid}:{pwd.getpwuid(uid).pw_gid}"
    except KeyError:
        owner = f"{uid}:{spec.session_dir.stat().st_gid}"
    sizes = {"/tmp": limits.tmp_mb, HOME_DIR: limits.home_mb}
    for inside, image in images.items():
        size = int(sizes[inside] or 0)
        with open(image, "wb") as f:
            f.truncate(size << 20)
        seed = spec.session_dir / "home" if inside == HOME_DIR else None
        r = await run_process(disk_argv(mke2fs, image, size, owner, seed), timeout=120)
        if r.exit_code != 0:
            raise SandboxError(f"apptainer: cannot make {image.name} for {inside}: {r.output[-500:]}")
    return images
