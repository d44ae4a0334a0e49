"""The `apptainer` runtime: each sample in its own Apptainer instance (HPC clusters without Docker).

Tested on the real binary (Apptainer 1.4.5, non-setuid, as root and as an unprivileged user:
tests/processes/test_apptainer_real.py). Each sample gets an instance started from the task's
image as a SIF (`sandbox/sif.py`: converted once per image content and cached), with:

- **no network** but loopback (`--net --network none`); the proxy is reached through the sample's
  own channel (its Unix socket and the forwarder, read-only; `sandbox/channel.py`);
- **a minimal /dev** (`--contain`: no host block device, no host /tmp or home) and none of the
  host's home, working directory or /tmp (`--no-mount home,cwd,tmp`);
- **no privilege**: as root on the host, the harness runs as HARNESS_USER with no capability
  (the image's `setpriv`, inside an exec with no-new-privileges), and root's own steps (setup,
  scoring) keep only ROOT_CAPS (`--no-privs --add-caps`); run by an unprivileged user, every
  process is that user's, with no capability (Apptainer's user namespace); every process under
  the one seccomp profile of `sandbox/seccomp.py` (no new namespace, mount, ptrace, ...);
- the task's memory, CPU and a pids limit (`--memory`, `--cpus`, `--pids-limit`) where Apptainer
  can apply cgroups (cgroup v2, or cgroupfs with `systemd cgroups = no` as root); where it
  cannot, the instance starts without them, once logged and recorded in `describe()`;
- its writes in an overlay directory of its own on the host (so the host reads a verdict file
  without running anything in the sandbox), the harness's HOME bound from the sample's `home`,
  our CA's public files and the (read-only) harness installation at the paths `sandbox/base.py`
  names, and a transfer directory for copies in and out.

The instance has its own PID namespace: the host lists and kills its processes by that namespace
(`processes`, `kill_all`, `seal`), whatever the image holds or the harness replaced. Its init
reaps orphans, so a verifier's tests run under `forwarder/reap.py`, a child subreaper that keeps
what they abandon in sight (see there); the host checks its report and seals the instance after.

A verifier (`SandboxSpec.purpose = "verifier"`) is a fresh instance from the same SIF with
nothing of ours bound but its transfer directory and the supervisor (and its channel, where the
task lets its verifier reach the internet); the agent's workdir comes in as a tar
(`rollout/verify.py`). The agent's tar is made by the agent instance's own `tar` once every
process in it is killed: a replaced `tar` can only change what the artefacts are, which the agent
controls anyway; the host reads it as untrusted (bounded by the overlay's file sizes first, then
by bytes; members outside the workdir, devices and paths through links dropped).

The command lines are built by the pure functions below and run as asyncio subprocesses. spython
finds the binary (`spython.utils.check_install`); its `Client` is not used because it always runs
`singularity` (hosts with only `apptainer` have none) and its `execute` blocks without a timeout.
Apptainer keeps no labels, so each instance we start is recorded as a JSON file in a registry
directory (`$POLAR_MITM_CACHE/apptainer/instances`); `cleanup(labels)` stops the recorded
instances whose labels match.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import pwd
import re
import secrets
import shlex
import shutil
import signal
import stat
import tarfile
import time
import uuid
from collections.abc import Mapping
from pathlib import Path, PurePosixPath
from typing import Any, BinaryIO, Literal

from pydantic import BaseModel, Field

from polar_mitm.cache import cache_dir
from polar_mitm.procs import kill_group
from polar_mitm.sandbox.base import (
    CHANNEL_SOCKET,
    FORWARDER_ROOT,
    HARNESS_BIN,
    HARNESS_ROOT,
    HOME_DIR,
    NODE_BIN,
    NPM_MODULES,
    READ_LIMIT,
    ROOT_CAPS,
    ExecResult,
    ExportTooLarge,
    Leftover,
    Limits,
    RuntimeUnavailable,
    SandboxError,
    SandboxSpec,
    Unreadable,
    ca_mounts,
    chown,
    hand_over,
    host_process,
    run_process,
    sandbox_ca,
    tree_size,
)
from polar_mitm.sandbox.channel import FORWARD_PORT, FORWARDER_DIR
from polar_mitm.sandbox.seccomp import apptainer_profile
from polar_mitm.sandbox.sif import TRANSPORTS, SifCache, is_path
from polar_mitm.tasks.model import Task

log = logging.getLogger("polar_mitm.apptainer")

BINARIES = ("apptainer", "singularity")  # `singularity` is Apptainer's compatibility name too
UNAVAILABLE = (
    "apptainer: no 'apptainer' (or 'singularity') found: not on PATH, not POLAR_MITM_APPTAINER, "
    "not in polar-mitm's cache (scripts/install.sh builds one there); install Apptainer "
    "(https://apptainer.org) or use --runtime docker / local"
)
# Host paths Apptainer would otherwise mount: the sandbox sees only its image and our binds.
NO_MOUNT = "home,cwd,tmp,sys"  # (no /sys at all: Docker's is read-only, Apptainer's writable)
# The kernel's knobs in /proc, bound read-only over themselves in every instance (Docker's
# ReadonlyPaths): a root that could write /proc/sys/kernel/core_pattern runs a program of its own
# as host root at the next core dump anywhere.
KERNEL_RO = ("/proc/sys", "/proc/sysrq-trigger", "/proc/irq", "/proc/bus")
NO_NETWORK = ["--net", "--network", "none"]  # a network namespace of its own, loopback only
CONTAIN = "--contain"  # a minimal /dev (no host disk), empty /tmp and home
XFER_DIR = f"{HARNESS_ROOT}/xfer"  # the sandbox's end of its transfer directory
REAPER = f"{HARNESS_ROOT}/reap.py"  # a verifier's test supervisor (forwarder/reap.py), read-only
REAPER_HOST = FORWARDER_DIR / "reap.py"
_NAME_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]")  # Apptainer's instance names: ^[a-zA-Z0-9._-]+$
NAME_MAX = 100
# `--env K=V` is parsed as CSV (pflag's string-to-string): a comma splits the pair, a quote
# starts a quoted field, so such values go through an env file, as do long or many variables.
_ENV_INLINE_UNSAFE = re.compile(r"[,\"\n\r]")
ENV_INLINE_MAX_VARS = 32
ENV_INLINE_MAX_CHARS = 4096
EXIT_NOT_A_FILE = 3  # `read`'s shell line: nothing is at the path
EXIT_NOT_REGULAR = 4  # ... something is, but not a regular file
EXIT_TOO_LARGE = 5  # ... a regular file, larger than the bound
EXIT_NO_DIR = 3  # `export`'s shell line: the directory is missing
CGROUPS_REFUSED = ("cannot use cgroups", "cgroups", "while applying cgroups config")
ROOTLESS = "rootless: the user running Apptainer, without capabilities"
STOP_WAIT = 5.0  # seconds for a killed namespace to empty


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
    """What a task's `image` is without a local Docker daemon or conversion (`sif.SifCache`
    resolves the rest): a path is kept, a reference with one of Apptainer's transports too, and
    anything else is a Docker image name that becomes `docker://NAME`."""
    image = image.strip()
    if is_path(image):
        return os.path.expanduser(image)
    if not is_local_image(image):
        return image
    return f"docker://{image}"


def is_local_image(ref: str) -> bool:
    """True for an image_ref that is a file or directory on the host (not a transport reference)."""
    return "://" not in ref and ref.split(":", 1)[0] not in TRANSPORTS


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


def own_dir(spec: SandboxSpec) -> Path:
    """The host directory of one instance's own state (overlay, transfers, env files): the agent's
    and its verifier's are apart, and neither is visible to the other."""
    return spec.session_dir / f"apptainer-{spec.purpose}"


def image_bind(image: Path, dst: str) -> str:
    """A `--bind` of a file system image (`make_disk_images`) as the directory `dst`, read-write."""
    return f"{bind_option(image.resolve(), dst)}:image-src=/"


def binds(spec: SandboxSpec, images: Mapping[str, Path] | None = None) -> list[str]:
    """An agent: its HOME (the sample's `home`, read-write), our CA's public files, the harness
    installation and the channel's socket and forwarder (read-only). A verifier: the supervisor
    and, where it may reach the internet, its channel, the forwarder and the node it runs on.
    Both: the transfer directory, and `images` ({sandbox path: image file}: /tmp, an agent's
    HOME) in place of a directory. The CA files are bound one by one: the directory also holds
    the private key."""
    images = images or {}
    out = [bind_option((own_dir(spec) / "xfer").resolve(), XFER_DIR)]
    out += [image_bind(image, inside) for inside, image in images.items() if inside != HOME_DIR]
    if spec.purpose == "verifier":
        out.append(bind_option(REAPER_HOST.resolve(), REAPER, read_only=True))
        out += [bind_option(host.resolve(), inside, read_only=True) for host, inside in spec.inputs]
        if spec.channel is not None:
            out.append(bind_option(spec.channel, CHANNEL_SOCKET, read_only=True))
            out.append(bind_option(FORWARDER_DIR.resolve(), FORWARDER_ROOT, read_only=True))
            if spec.forwarder_node is not None:
                out.append(bind_option(spec.forwarder_node.resolve(), f"{NODE_BIN}/node", read_only=True))
        return out
    home = images.get(HOME_DIR)
    out.append(
        image_bind(home, HOME_DIR) if home else bind_option((spec.session_dir / "home").resolve(), HOME_DIR)
    )
    for host, inside in ca_mounts(spec.ca):
        out.append(bind_option(host.resolve(), inside, read_only=True))
    if spec.channel is not None:
        out.append(bind_option(spec.channel, CHANNEL_SOCKET, read_only=True))
        out.append(bind_option(FORWARDER_DIR.resolve(), FORWARDER_ROOT, read_only=True))
    if spec.harness is not None:
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


def limit_options(limits: Limits) -> list[str]:
    """The sample's memory, CPUs and processes (`Limits.for_task`: the task's own, else the
    rollout's defaults) as `instance start` options (cgroups)."""
    out = ["--pids-limit", str(limits.pids)]
    if limits.memory_mb:
        out += ["--memory", str(int(limits.memory_mb) << 20)]
    if limits.cpus:
        out += ["--cpus", f"{limits.cpus:g}"]
    return out


def disk_argv(mke2fs: str, image: Path, size_mb: int, owner: str, seed: Path | None = None) -> list[str]:
    """`mke2fs` making an ext3 file system (what Apptainer binds) in the sparse file `image` of
    `size_mb`, its root owned by `owner` ("UID:GID") and holding a copy of the directory `seed`'s
    files: no reserved blocks, a small journal (4 MiB from 64 MiB up, else mke2fs's own), and
    nothing written that the file system does not use (a 1 GiB image holds about 5 MB)."""
    seeded = ["-d", str(seed)] if seed is not None else []
    journal = ["-J", "size=4"] if size_mb >= 64 else []
    lazy = f"root_owner={owner},lazy_itable_init=1,lazy_journal_init=1"
    return [mke2fs, "-q", "-F", "-t", "ext3", "-m", "0", *journal, "-E", lazy, *seeded, str(image)]


def disk_images(spec: SandboxSpec, limits: Limits) -> dict[str, Path]:
    """{sandbox path: the image file to make for it}: /tmp of `tmp_mb` in every instance, an
    agent's HOME of `home_mb`, each in the instance's own directory (removed with it)."""
    sizes = {"/tmp": limits.tmp_mb, HOME_DIR: limits.home_mb if spec.purpose == "agent" else None}
    return {inside: own_dir(spec) / f"{inside.rsplit('/', 1)[-1]}.img" for inside, mb in sizes.items() if mb}


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


def kernel_options(
    spec: SandboxSpec, *, host_root: bool, knobs: tuple[str, ...] = KERNEL_RO, seccomp: Path | None = None
) -> list[str]:
    """What keeps an instance off the host's kernel, as Docker keeps a container: the kernel's
    knobs under /proc read-only (KERNEL_RO) and no /sys; as root, a verifier in a user namespace
    of its own (`--userns`), so that its root (the tests run the agent's code as root) holds no
    capability of the host's namespace (run by an unprivileged user, Apptainer's own user
    namespace does that); and the `seccomp` profile file (`seccomp.apptainer_profile`: no new
    namespace, mount, module, keyring, ptrace, ...), which every exec joining the instance loads.
    An exec without capabilities may load it only with no-new-privileges, and as root a joining
    exec takes that bit from the instance's start, so the start has `--no-privs` too."""
    out = [arg for path in knobs for arg in ("--bind", f"{path}:{path}:ro")]
    if seccomp is not None:
        out += [*(["--no-privs"] if host_root else []), "--security", f"seccomp:{seccomp}"]
    return [*out, "--userns"] if host_root and spec.purpose == "verifier" else out


def start_argv(
    binary: str,
    image: str,
    name: str,
    spec: SandboxSpec,
    overlay: Path | None,
    limits: list[str] | None = None,
    kernel: list[str] | None = None,
    images: Mapping[str, Path] | None = None,
) -> list[str]:
    """`instance start`: no network but loopback, a minimal /dev, no host home/cwd/tmp/sys, the
    environment left out (variables come with each exec), writes going to `overlay` (a directory
    on the host) or, without one, to a tmpfs, the cgroup limits asked for, `kernel_options` and
    the file system `images` bound (`binds`)."""
    argv = [binary, "instance", "start", "--cleanenv", CONTAIN, "--no-mount", NO_MOUNT, *NO_NETWORK]
    argv += ["--overlay", str(overlay)] if overlay is not None else ["--writable-tmpfs"]
    argv += limits or []
    argv += kernel or []
    for bind in binds(spec, images):
        argv += ["--bind", bind]
    return [*argv, image, name]


Privileges = Literal["root", "harness"]


def privilege_options(kind: Privileges, *, host_root: bool) -> list[str]:
    """The exec options of who runs. Run by root: root with ROOT_CAPS only and no-new-privileges
    (the harness then drops to its user: `as_user`); by another user: nothing to add (that
    user, with no capability)."""
    if not host_root:
        return []
    # The harness's exec also holds SETPCAP, for `setpriv` to empty the bounding set as it drops
    # to the harness's user (as_user): afterwards it has no capability of any set.
    caps = [*ROOT_CAPS, "SETPCAP"] if kind == "harness" else ROOT_CAPS
    return ["--no-privs", "--add-caps", ",".join(f"CAP_{c}" for c in caps)]


def as_user(cmd: list[str], user: str) -> list[str]:
    """cmd run as `user` ("UID:GID") with no capability, no supplementary group and
    no-new-privileges, by the image's `setpriv` (util-linux). Apptainer's own `--security uid:`
    cannot join an instance that has cgroup limits unless systemd manages them."""
    uid, _, gid = user.partition(":")
    return [
        "setpriv", f"--reuid={uid}", f"--regid={gid or uid}", "--clear-groups",
        "--inh-caps=-all", "--bounding-set=-all", "--no-new-privs", "--", *cmd,
    ]  # fmt: skip


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


def exec_argv(
    binary: str, name: str, cmd: list[str], workdir: str, env_opts: list[str], privs: list[str] | None = None
) -> list[str]:
    """`exec` in the running instance, in `workdir`, with only the image's environment and ours."""
    return [
        binary,
        "exec",
        "--cleanenv",
        *(privs or []),
        "--pwd",
        workdir,
        *env_opts,
        f"instance://{name}",
        *cmd,
    ]


def stop_argv(binary: str, name: str) -> list[str]:
    return [binary, "instance", "stop", "--force", name]


def list_argv(binary: str, name: str | None = None) -> list[str]:
    return [binary, "instance", "list", "--json", *([name] if name else [])]


def listed(text: str) -> dict[str, int]:
    """{instance name: its init's host pid} in `instance list --json` output."""
    try:
        data = json.loads(text)
    except ValueError:
        return {}
    out = {}
    for i in data.get("instances") or []:
        name = i.get("instance") or i.get("daemon_name")
        if name:
            out[name] = int(i.get("pid") or 0)
    return out


def listed_names(text: str) -> set[str]:
    """Instance names in `instance list --json` output (`{"instances": [{"instance": NAME, ...}]}`)."""
    return set(listed(text))


def report_of(output: str, secret: str) -> tuple[str, dict[str, Any] | None]:
    """The tests' output without the supervisor's last line, and that line's report (None when
    it printed none: killed, or it could not run)."""
    at = output.rfind(f"\n{secret} ")
    if at < 0:
        return output, None
    line = output[at + 1 :].split("\n", 1)[0]
    try:
        report = json.loads(line[len(secret) + 1 :])
    except ValueError:
        return output, None
    return output[:at], report if isinstance(report, dict) else None


# --- processes ----------------------------------------------------------------------------------


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


def safe_members(src: BinaryIO, into: BinaryIO, top: str) -> list[str]:
    """Copy the tar `src` into `into` keeping only members under `top/` that stay there: no
    absolute or `..` paths, no devices or fifos, no hard link to outside, no member reached through
    a symbolic link of the archive. Returns the names dropped (streamed: neither held whole)."""
    dropped: list[str] = []
    links: set[str] = set()
    src.seek(0)
    with tarfile.open(fileobj=src, mode="r|") as tin, tarfile.open(fileobj=into, mode="w|") as tout:
        for m in tin:
            p = PurePosixPath(m.name)
            parts = p.parts
            bad = (
                p.is_absolute()
                or ".." in parts
                or not parts
                or parts[0] != top
                or m.ischr()
                or m.isblk()
                or m.isfifo()
                or any(str(PurePosixPath(*parts[:i])) in links for i in range(1, len(parts)))
            )
            if m.islnk():
                target = PurePosixPath(m.linkname)
                bad = bad or target.is_absolute() or ".." in target.parts or target.parts[:1] != (top,)
            if bad:
                dropped.append(m.name)
                continue
            if m.issym():
                links.add(str(p))
            tout.addfile(m, tin.extractfile(m) if m.isfile() else None)
    return dropped


def read_beneath(root: Path, path: str, limit: int = READ_LIMIT) -> bytes | None:
    """The regular file at `path` under the directory `root` (an overlay's upper directory), no
    link followed on the way; None when nothing is there, `Unreadable` when it is not a regular
    file or holds more than `limit` bytes (by its size, before a byte is read)."""
    parts = [p for p in PurePosixPath(path).parts if p not in ("/", "")]
    if not parts or ".." in parts:
        return None
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for part in parts[:-1]:
            nfd = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            os.close(fd)
            fd = nfd
        try:
            st = os.stat(parts[-1], dir_fd=fd, follow_symlinks=False)
        except FileNotFoundError:
            return None
        if not stat.S_ISREG(st.st_mode):
            raise Unreadable(f"{path} is not a regular file (mode {stat.filemode(st.st_mode)})")
        f = os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=fd)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as e:  # a link on the way (ELOOP), or a directory standing for the file
        raise Unreadable(f"{path}: {e.strerror}") from None
    finally:
        os.close(fd)
    with os.fdopen(f, "rb") as fh:
        st = os.fstat(fh.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise Unreadable(f"{path} is not a regular file")
        if st.st_size > limit:
            raise Unreadable(f"{path} holds {st.st_size} bytes, more than the {limit} read")
        return fh.read(limit)


# --- registry -----------------------------------------------------------------------------------


def default_registry_dir() -> Path:
    return cache_dir() / "apptainer" / "instances"


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


async def list_instances(binary: str, name: str | None = None) -> dict[str, int]:
    """The running instances (all of the user's, or just `name`) and their inits' host pids."""
    r = await run_argv(list_argv(binary, name), timeout=60)
    if r.exit_code != 0:
        return {}
    return listed(r.output[r.output.find("{") :] if "{" in r.output else "")


# --- runtime ------------------------------------------------------------------------------------


class ApptainerRuntime:
    """`--runtime apptainer`.

    `binary`: the apptainer (or singularity) executable, else found by `check()` (find_binary).
    `registry_dir`: where started instances are recorded for `cleanup` (default above).
    `overlay`: True for a writable overlay directory per instance on the host (what lets the
    host read a sealed verifier's files and bound an export by file sizes); False for
    `--writable-tmpfs` (in memory; such instances are not supervised). Hosts that run Apptainer
    setuid allow overlay directories to root only: when a start fails on the overlay, the runtime
    retries it, and the later ones, with the tmpfs.
    """

    name = "apptainer"
    isolated = True
    fresh_verifier = True
    mounts_inputs = True
    snapshots = False

    async def snapshot(self, sandbox: Any, name: str) -> Any:
        raise SandboxError(f"the {self.name} runtime keeps no snapshots; its verifier runs separate")

    async def drop_snapshot(self, snapshot: Any) -> None:
        return None

    def __init__(
        self,
        *,
        binary: str | None = None,
        registry_dir: Path | None = None,
        overlay: bool = True,
        sif_dir: Path | None = None,
        sifs: SifCache | None = None,
        host_root: bool | None = None,
    ):
        self.binary = binary
        self.registry_dir = registry_dir or default_registry_dir()
        self.overlay = overlay
        self.sif_dir = sif_dir
        self.limits = True  # cleared when Apptainer cannot apply cgroups here
        self._probed = False  # whether `probe_limits` ran
        # What makes the /tmp and HOME images (cleared where it is missing or they cannot be bound).
        self.mke2fs = shutil.which("mke2fs", path=f"{os.environ.get('PATH', '')}:/usr/sbin:/sbin")
        # Whether Apptainer runs as root (else rootless: every process is its user's); by default
        # this process's user. A binary that is a wrapper running Apptainer as another user says.
        self.host_root = os.geteuid() == 0 if host_root is None else host_root
        self._sifs: SifCache | None = sifs
        self._images: dict[str, str] = {}

    async def _binary(self) -> str:
        if self.binary is None:
            self.binary = await asyncio.to_thread(find_binary)
        if self.binary is None:
            raise RuntimeUnavailable(UNAVAILABLE)
        return self.binary

    async def check(self) -> None:
        await self._binary()

    @property
    def sifs(self) -> SifCache:
        assert self.binary is not None
        if self._sifs is None:
            self._sifs = SifCache(self.binary, self.sif_dir)
        return self._sifs

    async def prepare(self, task: Task) -> None:
        """The task's image as Apptainer starts it (converted once per image; see sandbox/sif.py);
        with the first, whether Apptainer can apply cgroups here (`probe_limits`)."""
        if task.id not in self._images:
            binary = await self._binary()
            self._images[task.id] = await self.sifs.resolve(task)
            if not self._probed:
                self._probed = True
                await self.probe_limits(binary, self._images[task.id])

    async def probe_limits(self, binary: str, image: str) -> None:
        """Start (and stop) an instance with a memory limit: where Apptainer cannot apply cgroups,
        `limits` is False from here on, said once, before any sample starts (a rollout then
        refuses to start unless allowed: `Pipeline._refuse_unenforced_limits`)."""
        name = instance_name(f"polar-probe-{uuid.uuid4().hex[:8]}")
        argv = [binary, "instance", "start", CONTAIN, "--no-mount", NO_MOUNT, "--memory", str(64 << 20)]
        r = await run_argv([*argv, image, name], timeout=120)
        if r.exit_code == 0:
            await run_argv(stop_argv(binary, name), timeout=60)
        elif "cgroups" in r.output:
            self._no_cgroups(r.output)

    def _no_cgroups(self, output: str) -> None:
        self.limits = False
        log.warning(
            "apptainer cannot apply cgroups here (%s): instances start without the memory, CPU and "
            "pids limits (as root without systemd: `systemd cgroups = no` in apptainer.conf)",
            output.strip().splitlines()[-1][-200:] if output.strip() else "",
        )

    async def _start_instance(
        self,
        binary: str,
        image: str,
        name: str,
        spec: SandboxSpec,
        task: Task,
        overlay: Path | None,
        images: dict[str, Path] | None = None,
    ) -> ExecResult:
        limits = limit_options(spec.limits.for_task(task)) if self.limits else []
        knobs = tuple(p for p in KERNEL_RO if os.path.exists(p))  # (a kernel may lack sysrq)
        profile = own_dir(spec) / "seccomp.json"  # read by Apptainer at the start, as its user
        profile.write_text(json.dumps(apptainer_profile()))
        kernel = kernel_options(spec, host_root=self.host_root, knobs=knobs, seccomp=profile)
        r = await run_argv(start_argv(binary, image, name, spec, overlay, limits, kernel, images))
        if r.exit_code != 0 and limits and "cgroups" in r.output:
            self._no_cgroups(r.output)
            r = await run_argv(start_argv(binary, image, name, spec, overlay, [], kernel, images))
        return r

    async def _disk_images(self, spec: SandboxSpec, task: Task) -> dict[str, Path]:
        """The instance's /tmp and HOME as file system images of their caps (`make_disk_images`),
        or none where this host cannot make or bind them (said once)."""
        if self.mke2fs is None:
            return {}
        try:
            return await make_disk_images(spec, spec.limits.for_task(task), self.mke2fs)
        except SandboxError as e:
            self._unbounded_disk(str(e))
            return {}

    def _unbounded_disk(self, why: str) -> None:
        self.mke2fs = None
        log.warning(
            "apptainer: the sandboxes' /tmp and HOME are not bounded here (%s): they take the host's disk",
            why[-300:],
        )

    async def start(self, task: Task, spec: SandboxSpec) -> ApptainerSandbox:
        binary = await self._binary()
        await self.prepare(task)
        image = self._images[task.id]
        name = instance_name(spec.name)
        mine = own_dir(spec)
        shutil.rmtree(mine, ignore_errors=True)
        (mine / "xfer").mkdir(parents=True)
        if spec.purpose == "agent":
            (spec.session_dir / "home").mkdir(parents=True, exist_ok=True)
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
        overlay = mine / "overlay" if self.overlay else None
        if overlay is not None:
            overlay.mkdir(parents=True, exist_ok=True)
        images = await self._disk_images(spec, task)
        result = await self._start_instance(binary, image, name, spec, task, overlay, images)
        if result.exit_code != 0 and images:  # (rootless without fuse2fs, say)
            retry = await self._start_instance(binary, image, name, spec, task, overlay)
            if retry.exit_code == 0:
                self._unbounded_disk(result.output.strip().splitlines()[-1] if result.output.strip() else "")
                images, result = {}, retry
        if result.exit_code != 0 and overlay is not None and "overlay" in result.output.lower():
            self.overlay = False
            shutil.rmtree(overlay, ignore_errors=True)
            overlay = None
            result = await self._start_instance(binary, image, name, spec, task, None, images)
        if result.exit_code != 0:
            record_path.unlink(missing_ok=True)
            raise SandboxError(
                f"apptainer: instance start for {task.id!r} ({image}) failed: {result.output[-2000:]}"
            )
        pid = (await list_instances(binary, name)).get(name, 0)
        sandbox = ApptainerSandbox(
            binary=binary,
            name=name,
            workdir=task.workdir,
            spec=spec,
            image=image,
            record_path=record_path,
            overlay=overlay,
            init_pid=pid,
            limits="applied" if self.limits else "not applied: Apptainer cannot use cgroups here",
            host_root=self.host_root,
        )
        try:
            # (a /tmp image's root is its owner's: /tmp is everyone's, sticky)
            script = 'mkdir -p -- "$1"' + (" && chmod 1777 /tmp" if "/tmp" in images else "")
            made = await sandbox.exec(["sh", "-c", script, "sh", task.workdir], workdir="/")
            if made.exit_code != 0:
                raise SandboxError(
                    f"apptainer: cannot create the workdir {task.workdir} in {name}: {made.output}"
                )
            if spec.purpose == "verifier":
                found = await sandbox.exec(["sh", "-c", "command -v python3"], workdir="/")
                path = (
                    found.output.strip().splitlines()[-1]
                    if found.exit_code == 0 and found.output.strip()
                    else ""
                )
                sandbox.supervisor = path if path.startswith("/") else None
                if sandbox.supervisor is None:
                    log.warning("instance %s: the image has no python3: its tests run unsupervised", name)
            if spec.channel is not None:
                agent = spec.purpose == "agent"
                await sandbox.start_forwarder(
                    node=(spec.harness is not None and spec.harness.node is not None)
                    if agent
                    else spec.forwarder_node is not None,
                    python=spec.harness.python if agent and spec.harness is not None else None,
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
