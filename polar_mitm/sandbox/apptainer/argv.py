"""Apptainer's command lines and what is read from its output: pure functions of a sample's
`SandboxSpec` and options, tested alone (tests/unit/test_apptainer.py). The runtime
(`runtime.py`) and the sandbox (`sandbox.py`) run them; see the package's docstring for why each
option is there.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from polar_mitm.sandbox.base import (
    CHANNEL_SOCKET,
    FORWARDER_ROOT,
    HARNESS_BIN,
    HARNESS_ROOT,
    HOME_DIR,
    NODE_BIN,
    NPM_MODULES,
    ROOT_CAPS,
    Limits,
    SandboxError,
    SandboxSpec,
    ca_mounts,
)
from polar_mitm.sandbox.channel import FORWARDER_DIR
from polar_mitm.sandbox.sif import TRANSPORTS, is_path

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
