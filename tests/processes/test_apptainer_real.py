"""The apptainer runtime on the real binary, attacked from inside as the agent would: the host's
loopback (where the engine and the service listen), its block devices, capabilities, mounts,
processes left behind; and its verifier's tests, which run the agent's code, rewriting the
verdict. Each as root (what CI runs as) and rootless: Apptainer run by an unprivileged user
(`polartest`, made here; the runtime's binary a wrapper that drops to it), with the image, the
session directories and the CA where that user can read them. The image is the Docker test
image, converted once.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from polar_mitm.proxy.certs import CA, ensure_ca
from polar_mitm.sandbox.apptainer import ApptainerRuntime
from polar_mitm.sandbox.apptainer import argv as ap
from polar_mitm.sandbox.apptainer.host import list_instances, namespace_pids
from polar_mitm.sandbox.base import HOME_DIR, Limits, SandboxSpec
from polar_mitm.tasks.model import Task
from tests.support.docker_rollout import TEST_IMAGE

pytestmark = [pytest.mark.apptainer, pytest.mark.docker, pytest.mark.slow]


ROOTLESS_USER, ROOTLESS_UID = "polartest", 2001


@dataclass
class Where:
    runtime: ApptainerRuntime
    base: Path  # where the session directories go
    task: Task
    harness_uid: str  # who the harness runs as
    rootless: bool


def rootless_user() -> None:
    if subprocess.run(["id", ROOTLESS_USER], capture_output=True).returncode != 0:
        subprocess.run(
            ["useradd", "-m", "-u", str(ROOTLESS_UID), ROOTLESS_USER], check=True, capture_output=True
        )


@pytest.fixture(params=["root", "rootless"])
def where(request, apptainer_binary, docker_client, tmp_path):
    if request.param == "root":
        rt = ApptainerRuntime(binary=apptainer_binary, registry_dir=tmp_path / "registry")
        return Where(rt, tmp_path, TASK, "1000", False)
    if os.geteuid() != 0 or not shutil.which("useradd") or not shutil.which("setpriv"):
        pytest.skip("the rootless variant makes its user: it needs root, useradd and setpriv")
    rootless_user()
    apptainer_binary = os.path.realpath(apptainer_binary)
    as_user = ["setpriv", f"--reuid={ROOTLESS_UID}", f"--regid={ROOTLESS_UID}", "--init-groups"]
    if subprocess.run([*as_user, apptainer_binary, "--version"], capture_output=True).returncode != 0:
        pytest.skip(
            f"{apptainer_binary} cannot be run by an unprivileged user (install.sh puts it under /opt as root)"
        )
    base = Path(tempfile.mkdtemp(prefix="polar-rootless-", dir="/tmp"))
    request.addfinalizer(lambda: shutil.rmtree(base, ignore_errors=True))
    base.chmod(0o755)
    os.link(rootless_image(apptainer_binary), base / "image.sif")
    wrapper = base / "apptainer-as-user"
    # The runtime runs as root in this process and Apptainer as the user, so the directories the
    # runtime makes are handed to the user before each call (a rootless user runs both as itself).
    wrapper.write_text(
        f"#!/bin/sh\nchown -R {ROOTLESS_USER}: {base} 2>/dev/null\n"
        f'exec {" ".join(as_user)} env HOME=/home/{ROOTLESS_USER} {apptainer_binary} "$@"\n'
    )
    wrapper.chmod(0o755)
    shutil.chown(base, ROOTLESS_USER)
    rt = ApptainerRuntime(binary=str(wrapper), registry_dir=base / "registry", host_root=False)
    task = TASK.model_copy(update={"image": str(base / "image.sif")})
    return Where(rt, base, task, str(ROOTLESS_UID), True)


def rootless_image(binary: str) -> Path:
    """The test image's SIF where the rootless user can read it (copied once, then linked)."""
    shared = Path("/tmp/polar-rootless-images")
    shared.mkdir(mode=0o755, exist_ok=True)
    sif = Path(asyncio.run(_converted(binary)))
    out = shared / sif.name
    if not out.exists() or out.stat().st_size != sif.stat().st_size:
        shutil.copy(sif, out.with_suffix(".part"))
        os.replace(out.with_suffix(".part"), out)
        out.chmod(0o644)
    return out


async def _converted(binary: str) -> str:
    rt = ApptainerRuntime(binary=binary)
    await rt.prepare(TASK)
    return rt._images[TASK.id]


def ca_for(where: Where) -> CA:
    ca = ensure_ca(where.base / "ca")
    if where.rootless:
        for f in (where.base / "ca").iterdir():
            f.chmod(0o644 if f.name != ca.key_and_cert.name else 0o600)
        (where.base / "ca").chmod(0o755)
    return ca


def session(where: Where, name: str) -> Path:
    d = where.base / name
    d.mkdir(parents=True, exist_ok=True)
    if where.rootless:
        shutil.chown(d, ROOTLESS_USER)
    return d


@pytest.fixture
def host_listener():
    """A listener on the host's 127.0.0.1 (where the engine, the proxy and the service are) that
    counts the connections it accepts."""
    srv = socket.create_server(("127.0.0.1", 0))
    accepted = []

    def serve():
        with contextlib.suppress(OSError):
            while True:
                conn, _ = srv.accept()
                accepted.append(conn)

    threading.Thread(target=serve, daemon=True).start()
    yield srv.getsockname()[1], accepted
    srv.close()


TASK = Task(id="t", instruction="x", image=TEST_IMAGE, workdir="/app")
# What these tests attack is not the limits: where this host cannot apply them (rootless without
# systemd), the instances start without them; the refusal itself is tested on its own.
LIMITS = Limits(allow_unenforced=True)

ATTACK = r"""
echo "uid=$(id -u)"
grep -E '^(CapEff|CapBnd|NoNewPrivs)' /proc/self/status
echo "dev=$(ls /dev | tr '\n' ' ')"
python3 - "$1" <<'EOF'
import socket, sys
try:
    socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=2)
    print("loopback=reached")
except OSError as e:
    print("loopback=refused", e)
EOF
mount -t tmpfs x /mnt 2>/dev/null && echo mount=yes || echo mount=no
echo x > /etc/owned 2>/dev/null && echo etc=writable || echo etc=no
[ -e /root/.cache/polar-mitm ] && echo hosthome=seen || echo hosthome=no
echo 41 > /app/answer.txt && echo workdir=ok
touch "$HOME/settings" && echo home=ok
setsid sh -c 'sleep 300' </dev/null >/dev/null 2>&1 &
echo "left a daemon"
"""


async def test_the_harness_holds_nothing_of_the_host_and_leaves_nothing(where, host_listener):
    runtime, tmp_path = where.runtime, where.base
    port, accepted = host_listener
    ca = ca_for(where)
    sb = await runtime.start(where.task, SandboxSpec("apt-attack", session(where, "s"), ca, limits=LIMITS))
    try:
        assert sb.init_pid > 0 and sb.supervises
        r = await sb.exec_harness(["sh", "-c", ATTACK, "sh", str(port)], env={"HOME": HOME_DIR}, timeout=60)
        out = dict(
            line.split("=", 1)
            for line in r.output.splitlines()
            if "=" in line and " " not in line.split("=", 1)[0]
        )
        caps = {
            k: v.strip()
            for k, v in (
                line.split(":", 1) for line in r.output.splitlines() if line.startswith(("Cap", "NoNew"))
            )
        }
        assert out["uid"] == where.harness_uid, r.output
        assert caps == {"CapEff": "0000000000000000", "CapBnd": "0000000000000000", "NoNewPrivs": "1"}, (
            r.output
        )
        devices = set(out["dev"].split())
        assert devices <= {
            "fd",
            "null",
            "ptmx",
            "pts",
            "random",
            "shm",
            "stderr",
            "stdin",
            "stdout",
            "tty",
            "urandom",
            "zero",
        }, devices
        assert out["loopback"].startswith("refused") and accepted == []
        assert (out["mount"], out["hosthome"]) == ("no", "no"), r.output
        # Rootless, the image's files are the user's own copy-on-write layer: a write lands in
        # the instance's overlay, never the host's /etc or the SIF.
        assert out["etc"] == ("writable" if where.rootless else "no") and not os.path.exists("/etc/owned")
        assert (out["workdir"], out["home"]) == ("ok", "ok"), r.output
        # The daemon it left is gone with the harness's end, as the host sees it.
        assert namespace_pids(sb.init_pid) == []
        assert await sb.read(f"{HOME_DIR}/settings") == b""  # (HOME: an image of --home-size)
        assert await sb.read("/app/answer.txt") == b"41\n"
        assert sb.describe()["user"] == ("1000:1000" if not where.rootless else ap.ROOTLESS)
        assert sb.describe()["network"] == "none"
    finally:
        await sb.stop()
    assert "apt-attack" not in await list_instances(runtime.binary)  # type: ignore[arg-type]
    assert list((tmp_path / "registry").glob("*.json")) == []
    assert not (tmp_path / "s" / "apptainer-agent").exists()


async def test_a_fork_bomb_stops_at_the_pids_limit_and_the_host_kills_it_all(where):
    runtime = where.runtime
    ca = ca_for(where)
    sb = await runtime.start(where.task, SandboxSpec("apt-forks", session(where, "s"), ca, limits=LIMITS))
    try:
        if not runtime.limits:
            assert sb.describe()["limits"].startswith("not applied")  # said, where it cannot
            pytest.skip("Apptainer cannot apply cgroups here (rootless without systemd)")
        r = await sb.exec_harness(
            [
                "sh",
                "-c",
                "for i in $(seq 6000); do setsid sleep 300 </dev/null >/dev/null 2>&1 & done; echo spawned",
            ],
            timeout=120,
        )
        assert "Cannot fork" in r.output or "Resource temporarily unavailable" in r.output, r.output[-500:]
        assert namespace_pids(sb.init_pid) == []
    finally:
        await sb.stop()


VERDICT_CHEATS = {
    # the tests' program leaves a daemon that waits for the verdict and rewrites it, then exits
    "early": "sh -c \"setsid sh -c 'while [ ! -s /logs/verifier/reward.txt ]; do sleep 0.01; done;"
    " echo 1 > /logs/verifier/reward.txt' </dev/null >/dev/null 2>&1 &\"; echo 0 > /logs/verifier/reward.txt; sleep 0.5",
    # ... or one that is still waiting when the tests end
    "late": "sh -c \"setsid sh -c 'sleep 1; echo 1 > /logs/verifier/reward.txt' </dev/null >/dev/null 2>&1 &\";"
    " echo 0 > /logs/verifier/reward.txt",
    # the tests kill their own supervisor after printing a report of their own
    "forge": 'echo 1 > /logs/verifier/reward.txt; echo \'x {"status": 0, "left": []}\';'
    " kill -9 $(awk '{print $4}' /proc/$$/stat)",
    # replace the image's cat and sh, which the host might use to read the verdict
    "binaries": "echo 0 > /logs/verifier/reward.txt; printf '#!/bin/true\\n' > /usr/bin/cat; cp /bin/true /bin/dash",
    "honest": "echo 1 > /logs/verifier/reward.txt",
}


@pytest.mark.parametrize("cheat", list(VERDICT_CHEATS))
async def test_the_verifiers_tests_cannot_rewrite_the_verdict_unseen(where, cheat):
    runtime = where.runtime
    ca = ca_for(where)
    v = await runtime.start(
        where.task, SandboxSpec("apt-v", session(where, "s"), ca, purpose="verifier", limits=LIMITS)
    )
    try:
        assert v.supervisor and v.supervises
        assert (await v.exec(["mkdir", "-p", "/logs/verifier"], workdir="/")).exit_code == 0
        r, left = await v.exec_sealed(["sh", "-c", VERDICT_CHEATS[cheat]], workdir="/", timeout=60)
        verdict = await v.read("/logs/verifier/reward.txt")
        if cheat == "honest":
            assert left == [] and verdict == b"1\n" and r.exit_code == 0, (r.output, left)
        elif cheat == "binaries":
            assert left == [] and verdict == b"0\n"  # read on the host, not with the image's tools
        else:
            assert left, (cheat, r.output, verdict)
        assert namespace_pids(v.init_pid) == []  # sealed: nothing runs in it any more
    finally:
        await v.stop()


HOST_KNOBS = (
    "/proc/sys/kernel/core_pattern /proc/sys/vm/drop_caches /proc/sys/kernel/hostname /proc/sysrq-trigger"
    " /sys/kernel/mm/transparent_hugepage/enabled"
)
KERNEL_ATTACK = rf"""
grep -E '^(CapEff|NoNewPrivs|Seccomp):' /proc/self/status
echo "uidmap=$(tr -s ' ' < /proc/self/uid_map | sed 's/^ //' | tr '\n' ';')"
for f in {HOST_KNOBS}; do  # opened for writing, nothing written
  python3 -c "open('$f', 'r+b')" 2>/dev/null && echo "writable=$f"
done
unshare -U -r true 2>/dev/null && echo unshare=yes || echo unshare=no
python3 - <<'EOF'
import ctypes, os, threading
# clone3 with CLONE_NEWUSER (its flags sit in memory, where no filter reads them): struct
# clone_args, `flags` first and `exit_signal` (SIGCHLD) fifth.
args = (ctypes.c_uint64 * 11)(0x10000000, 0, 0, 0, 17)
r = ctypes.CDLL(None, use_errno=True).syscall(435, args, ctypes.sizeof(args))
if r == 0:
    os._exit(0)
print("clone3=yes" if r > 0 else "clone3=no errno=%d" % ctypes.get_errno())
t = threading.Thread(target=print, args=("threads=ok",))  # (the C library falls back to clone)
t.start()
t.join()
EOF
"""


def host_capabilities(output: str) -> bool:
    """Whether the process that printed KERNEL_ATTACK's lines held a capability in the host's
    user namespace (the initial one maps every uid onto itself)."""
    cap = next(x.split(":", 1)[1].strip() for x in output.splitlines() if x.startswith("CapEff:"))
    uidmap = next(x.split("=", 1)[1] for x in output.splitlines() if x.startswith("uidmap="))
    return int(cap, 16) != 0 and uidmap.startswith("0 0 4294967295")


def no_namespaces(output: str) -> bool:
    """Whether KERNEL_ATTACK's process was refused a user namespace both ways, with its threads
    still starting (`clone3` refused as ENOSYS, so the C library falls back to `clone`)."""
    return {"unshare=no", "clone3=no errno=38", "threads=ok"} <= set(output.splitlines())


async def test_the_verifier_is_never_host_root_and_no_instance_reaches_the_kernel(where):
    """The verifier's tests (which run the agent's code) and the harness, attacked as issue 41
    found them: before, as root the tests held CHOWN, DAC_OVERRIDE, FOWNER, SETUID and SETGID in
    the host's user namespace and opened core_pattern (a write there runs a program of theirs
    as host root at the next core dump), the hostname and /sys knobs for writing; the harness
    could make a user namespace (`unshare -U`, or `clone3`, whose flags no filter can read). Now
    the tests hold no capability of the host's namespace (a user namespace of their own), every
    such file is read-only (or absent) in every instance, and neither the tests nor the harness
    can make a namespace (the seccomp profile of sandbox/seccomp.py), while threads still start."""
    runtime = where.runtime
    ca = ca_for(where)
    v = await runtime.start(
        where.task, SandboxSpec("apt-kv", session(where, "v"), ca, purpose="verifier", limits=LIMITS)
    )
    try:
        r, _ = await v.exec_sealed(["sh", "-c", KERNEL_ATTACK], workdir="/", timeout=60)
        assert "writable=" not in r.output, r.output
        assert not host_capabilities(r.output), r.output
        assert no_namespaces(r.output), r.output
    finally:
        await v.stop()
    agent = await runtime.start(where.task, SandboxSpec("apt-ka", session(where, "a"), ca, limits=LIMITS))
    try:
        r = await agent.exec_harness(["sh", "-c", KERNEL_ATTACK], timeout=60)
        assert "writable=" not in r.output, r.output
        assert not host_capabilities(r.output), r.output
        assert no_namespaces(r.output), r.output
    finally:
        await agent.stop()


FILL = r"""
for d in "$HOME" /tmp; do
  dd if=/dev/zero of="$d/fill" bs=1M count=64 2>/dev/null
  echo "wrote $d $(( $(stat -c %s "$d/fill") >> 20 ))"
done
"""


def disk_used(root: Path) -> int:
    """Bytes of the host's disk the files under `root` hold (their blocks, as du counts them)."""
    return sum(p.lstat().st_blocks * 512 for p in root.rglob("*"))


async def test_home_and_tmp_are_refused_past_their_caps_and_the_host_disk_holds(where):
    """The harness writes 64 MiB to $HOME and to /tmp with caps of 16 MiB each: past the cap the
    writes are refused, and the host's disk holds at most the caps. Before, $HOME was a host
    directory and /tmp the instance's overlay on the host: all 128 MiB landed on the host's disk."""
    runtime = where.runtime
    ca = ca_for(where)
    spec = SandboxSpec(
        "apt-disk", session(where, "s"), ca, limits=Limits(home_mb=16, tmp_mb=16, allow_unenforced=True)
    )
    sb = await runtime.start(where.task, spec)
    try:
        before = disk_used(where.base / "s")
        r = await sb.exec_harness(["sh", "-c", FILL], env={"HOME": HOME_DIR}, timeout=120)
        wrote = {w[1]: int(w[2]) for w in (x.split() for x in r.output.splitlines()) if w[:1] == ["wrote"]}
        assert wrote.keys() == {HOME_DIR, "/tmp"} and max(wrote.values()) <= 16, r.output
        assert disk_used(where.base / "s") - before <= 32 << 20
    finally:
        await sb.stop()


async def test_artefacts_cross_as_a_bounded_tar_into_a_fresh_instance(where):
    runtime, tmp_path, TASK = where.runtime, where.base, where.task
    ca = ca_for(where)
    agent = await runtime.start(TASK, SandboxSpec("apt-art", session(where, "s"), ca, limits=LIMITS))
    try:
        script = (
            "echo 42 > /app/answer.txt; ln -s /etc /app/etc; mkdir -p /app/d; echo x > /app/d/f;"
            " truncate -s 3G /app/sparse 2>/dev/null || true"
        )
        await agent.exec_harness(["sh", "-c", script], timeout=60)
        await agent.halt()
        from polar_mitm.sandbox.base import ExportTooLarge

        with tempfile.TemporaryFile() as spool, pytest.raises(ExportTooLarge):
            t0 = time.monotonic()
            await agent.export("/app", 1 << 30, spool)
        assert time.monotonic() - t0 < 10  # refused from file sizes, nothing read
        await agent.exec(["rm", "-f", "/app/sparse"], workdir="/")
        spool2 = io.BytesIO()
        size = await agent.export("/app", 1 << 30, spool2)
        assert 0 < size == len(spool2.getvalue())
    finally:
        await agent.stop()
    v = await runtime.start(
        TASK, SandboxSpec("apt-art-verifier", session(where, "s"), ca, purpose="verifier", limits=LIMITS)
    )
    try:
        await v.exec(["rm", "-rf", "/app"], workdir="/")
        await v.put_tar("/", spool2)
        r = await v.exec(["sh", "-c", "cat /app/answer.txt /app/d/f; readlink /app/etc"], workdir="/")
        assert r.output.split() == ["42", "x", "/etc"], r.output
    finally:
        await v.stop()
    assert os.listdir(tmp_path / "s") == ["home"]  # neither instance's own directory is left


async def test_limits_it_cannot_enforce_are_said_once_and_stop_a_rollout_unless_allowed(where, caplog):
    """Where Apptainer cannot apply cgroups (here: rootless, without systemd), the runtime finds it
    as it prepares the first image, says so once, and a rollout that asks for a memory limit
    refuses to start, unless allowed (or it asks for none). Before, the instances started without
    the limits, a warning in the log at the first sample's start."""
    from polar_mitm.rollout.jobs import unenforced_limits
    from polar_mitm.rollout.options import RolloutOptions

    rt, TASK = where.runtime, where.task
    await rt.prepare(TASK)
    await rt.prepare(TASK.model_copy(update={"id": "t2"}))
    if rt.limits:
        assert not [r for r in caplog.records if "cannot apply cgroups" in r.getMessage()]
        assert unenforced_limits(RolloutOptions(), rt, [TASK]) is None
        pytest.skip("Apptainer applies cgroups here: nothing to refuse")
    said = [r for r in caplog.records if "cannot apply cgroups" in r.getMessage()]
    assert len(said) == 1
    refusal = unenforced_limits(RolloutOptions(), rt, [TASK])
    assert refusal is not None and "--allow-unenforced-limits" in refusal
    assert unenforced_limits(RolloutOptions(allow_unenforced_limits=True), rt, [TASK]) is None
    assert unenforced_limits(RolloutOptions(memory=0), rt, [TASK]) is None
    assert unenforced_limits(RolloutOptions(memory=0), rt, [TASK.model_copy(update={"memory_mb": 512})])


async def test_a_dockerfile_builds_without_docker_from_a_generated_definition(
    apptainer_binary, docker_client, tmp_path
):
    """The path for hosts without Docker: the Dockerfile translated (sandbox/dockerfile.py) and
    built by `apptainer build`; FROM comes from the local daemon here (no registry), the rest is
    what the translation wrote."""
    from polar_mitm.sandbox.sif import SifCache

    ctx = tmp_path / "ctx"
    (ctx / "src").mkdir(parents=True)
    (ctx / "src" / "calc.py").write_text("def add(a, b):\n    return a + b\n")
    (ctx / "requirements.txt").write_text("nothing\n")
    (ctx / "Dockerfile").write_text(
        f"FROM {TEST_IMAGE}\nENV GREETING=hello\nWORKDIR /srv/app\nCOPY requirements.txt .\n"
        'COPY src/ ./src/\nRUN test -f src/calc.py && echo "$GREETING" > built.txt\nCMD ["sh"]\n'
    )
    sifs = SifCache(apptainer_binary, tmp_path / "sif", dockerfiles="apptainer", bootstrap="docker-daemon")
    rt = ApptainerRuntime(binary=apptainer_binary, registry_dir=tmp_path / "registry", sifs=sifs)
    task = Task(id="df", instruction="x", dockerfile=ctx / "Dockerfile", workdir="/app")
    await rt.prepare(task)
    assert Path(rt._images["df"]).name.startswith("dockerfile-") and len(sifs.conversions) == 1
    sb = await rt.start(
        task, SandboxSpec("apt-df", tmp_path / "s", ensure_ca(tmp_path / "ca"), limits=LIMITS)
    )
    try:
        r = await sb.exec(
            [
                "sh",
                "-c",
                "cat /srv/app/built.txt /srv/app/requirements.txt; ls /srv/app/src; ls /.polar-mitm-context 2>&1 | head -1; echo $GREETING",
            ]
        )
        lines = r.output.split("\n")
        assert lines[:3] == ["hello", "nothing", "calc.py"] and "No such file" in lines[3], r.output
        assert lines[4] == "hello"  # ENV reaches the image's environment too
    finally:
        await sb.stop()
    await rt.prepare(Task(id="df2", instruction="x", dockerfile=ctx / "Dockerfile", workdir="/app"))
    assert len(sifs.conversions) == 1  # the same context: the cached SIF
