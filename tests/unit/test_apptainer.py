"""The apptainer runtime: its command lines (pure functions), binary detection, and its process
handling run for real against a fake `apptainer` script; one test needs the real binary."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from polar_mitm.proxy.certs import CA
from polar_mitm.sandbox.apptainer import ApptainerRuntime
from polar_mitm.sandbox.apptainer import argv as ap
from polar_mitm.sandbox.base import (
    CA_DIR,
    HARNESS_BIN,
    HOME_DIR,
    NODE_BIN,
    NPM_MODULES,
    SESSION_DIR,
    HarnessMount,
    Limits,
    RuntimeUnavailable,
    SandboxError,
    SandboxSpec,
    sandbox_ca,
)
from polar_mitm.tasks.model import Task


def make_ca(d: Path) -> CA:
    d.mkdir(parents=True, exist_ok=True)
    files = {n: d / n for n in ("mitmproxy-ca.pem", "mitmproxy-ca-cert.pem", "polar-mitm-bundle.pem")}
    for p in files.values():
        p.write_text("-----BEGIN CERTIFICATE-----\n")
    return CA(
        dir=d,
        key_and_cert=files["mitmproxy-ca.pem"],
        cert=files["mitmproxy-ca-cert.pem"],
        bundle=files["polar-mitm-bundle.pem"],
    )


def make_spec(tmp_path: Path, *, harness: bool = False, labels: dict[str, str] | None = None) -> SandboxSpec:
    mount = None
    if harness:
        node = tmp_path / "node" / "bin" / "node"
        node.parent.mkdir(parents=True)
        node.touch()
        mount = HarnessMount(
            modules=tmp_path / "npm" / "lib" / "node_modules", bin=tmp_path / "hbin", node=node
        )
    return SandboxSpec(
        name="run1/task-a#0",
        session_dir=tmp_path / "session",
        ca=make_ca(tmp_path / "ca"),
        harness=mount,
        labels=labels or {},
    )


# --- names and images ---------------------------------------------------------------------------


def test_instance_name_keeps_safe_names_and_hashes_changed_ones():
    assert ap.instance_name("pm-run1-task_a.0") == "pm-run1-task_a.0"
    a, b = ap.instance_name("run1/task-a#0"), ap.instance_name("run1:task-a#0")
    assert a.startswith("run1-task-a-0-") and b.startswith("run1-task-a-0-")
    assert a != b  # two names that sanitize alike stay apart
    for name in (a, b, ap.instance_name(".hidden"), ap.instance_name("///"), ap.instance_name("x" * 300)):
        assert ap._NAME_UNSAFE.search(name) is None and not name.startswith((".", "-"))
        assert 0 < len(name) <= ap.NAME_MAX


@pytest.mark.parametrize(
    ("image", "ref"),
    [
        ("ubuntu:24.04", "docker://ubuntu:24.04"),
        ("python", "docker://python"),
        ("ghcr.io/org/img@sha256:abc", "docker://ghcr.io/org/img@sha256:abc"),
        ("localhost:5000/img:1", "docker://localhost:5000/img:1"),
        ("docker://ubuntu:24.04", "docker://ubuntu:24.04"),
        ("oras://ghcr.io/org/img:1", "oras://ghcr.io/org/img:1"),
        ("docker-daemon:myimg:latest", "docker-daemon:myimg:latest"),
        ("/images/task.sif", "/images/task.sif"),
        ("images/task.sif", "images/task.sif"),
        ("./rootfs", "./rootfs"),
    ],
)
def test_image_ref(image, ref):
    assert ap.image_ref(image) == ref


async def test_prepare_resolves_paths_and_refuses_a_missing_sif(tmp_path, monkeypatch):
    monkeypatch.setenv("DOCKER_HOST", "unix:///nonexistent.sock")  # no local daemon: no conversion
    rt = ApptainerRuntime(binary="apptainer", registry_dir=tmp_path / "reg", sif_dir=tmp_path / "sif")
    with pytest.raises(SandboxError, match="does not exist"):
        await rt.prepare(Task(id="a", instruction="x", image=str(tmp_path / "missing.sif")))
    (tmp_path / "ok.sif").touch()
    await rt.prepare(Task(id="b", instruction="x", image=str(tmp_path / "ok.sif")))
    await rt.prepare(Task(id="c", instruction="x", image="ubuntu:24.04"))
    await rt.prepare(Task(id="d", instruction="x", image="oras://ghcr.io/o/i:1"))
    assert rt._images == {
        "b": str(tmp_path / "ok.sif"),
        "c": "docker://ubuntu:24.04",
        "d": "oras://ghcr.io/o/i:1",
    }
    with pytest.raises(SandboxError, match="does not exist"):
        await rt.prepare(Task(id="e", instruction="x", dockerfile=tmp_path / "Dockerfile"))
    (tmp_path / "Dockerfile").write_text("FROM a AS build\nFROM b\n")  # no Docker: translated, or refused
    with pytest.raises(SandboxError, match="several stages cannot be built without Docker"):
        await rt.prepare(Task(id="f", instruction="x", dockerfile=tmp_path / "Dockerfile"))


def test_sandbox_ca_points_into_ca_dir_without_the_key(tmp_path):
    ca = sandbox_ca(make_ca(tmp_path / "ca"))
    assert ca.dir == Path(CA_DIR)
    assert ca.cert == Path(CA_DIR) / "mitmproxy-ca-cert.pem"
    assert ca.bundle == Path(CA_DIR) / "polar-mitm-bundle.pem"
    assert ca.key_and_cert == Path(CA_DIR) / "none"  # the private key is not bound


def test_harness_path():
    assert ap.harness_path(SandboxSpec("s", Path("/s"), make_ca_stub())) == []
    mount = HarnessMount(modules=Path("/m"), bin=Path("/b"), node=Path("/n/bin/node"))
    assert ap.harness_path(SandboxSpec("s", Path("/s"), make_ca_stub(), mount)) == [HARNESS_BIN, NODE_BIN]
    mount.node = None
    assert ap.harness_path(SandboxSpec("s", Path("/s"), make_ca_stub(), mount)) == [HARNESS_BIN]


def make_ca_stub() -> CA:
    d = Path("/ca")
    return CA(dir=d, key_and_cert=d / "k.pem", cert=d / "c.pem", bundle=d / "b.pem")


# --- command lines ------------------------------------------------------------------------------


def test_start_argv_without_harness(tmp_path):
    spec = make_spec(tmp_path)
    overlay = tmp_path / "session" / "overlay"
    argv = ap.start_argv(
        "apptainer", "docker://ubuntu:24.04", "sample-1", spec, overlay, ["--pids-limit", "9"]
    )
    xfer = (tmp_path / "session" / "apptainer-agent" / "xfer").resolve()
    assert argv == [
        "apptainer", "instance", "start", "--cleanenv", "--contain", "--no-mount", "home,cwd,tmp,sys",
        "--net", "--network", "none",
        "--overlay", str(overlay), "--pids-limit", "9",
        "--bind", f"{xfer}:{ap.XFER_DIR}",
        "--bind", f"{tmp_path}/session/home:{HOME_DIR}",
        "--bind", f"{tmp_path}/ca/mitmproxy-ca-cert.pem:{CA_DIR}/mitmproxy-ca-cert.pem:ro",
        "--bind", f"{tmp_path}/ca/polar-mitm-bundle.pem:{CA_DIR}/polar-mitm-bundle.pem:ro",
        "docker://ubuntu:24.04", "sample-1",
    ]  # fmt: skip
    assert "--containall" not in argv  # no network but loopback (issue 22), the rest as before
    assert not any("mitmproxy-ca.pem" in a for a in argv)  # the private key stays on the host
    assert not any(a.endswith(f":{SESSION_DIR}") for a in argv)  # only HOME of the session directory


def test_kernel_options_keep_every_instance_off_the_kernel_and_the_verifier_off_host_root(tmp_path):
    agent, verifier = make_spec(tmp_path), dataclasses.replace(make_spec(tmp_path), purpose="verifier")
    ro = [
        a
        for p in ("/proc/sys", "/proc/sysrq-trigger", "/proc/irq", "/proc/bus")
        for a in ("--bind", f"{p}:{p}:ro")
    ]
    assert ap.kernel_options(agent, host_root=True) == ro
    assert ap.kernel_options(verifier, host_root=True) == [*ro, "--userns"]
    assert ap.kernel_options(verifier, host_root=False) == ro  # Apptainer's user namespace already
    assert ap.kernel_options(agent, host_root=True, knobs=("/proc/sys",)) == [
        "--bind",
        "/proc/sys:/proc/sys:ro",
    ]
    argv = ap.start_argv("apptainer", "i.sif", "v", verifier, None, [], ["--userns"])
    assert argv[argv.index("--userns") + 1 :][-2:] == ["i.sif", "v"]


def test_every_instance_loads_the_one_seccomp_profile_with_no_new_privileges(tmp_path):
    from polar_mitm.sandbox.seccomp import DENIED, apptainer_profile, verifier_profile

    agent, verifier = make_spec(tmp_path), dataclasses.replace(make_spec(tmp_path), purpose="verifier")
    f = tmp_path / "seccomp.json"
    assert ap.kernel_options(agent, host_root=True, knobs=(), seccomp=f) == [
        "--no-privs",
        "--security",
        f"seccomp:{f}",
    ]
    assert ap.kernel_options(verifier, host_root=True, knobs=(), seccomp=f)[-1] == "--userns"
    assert ap.kernel_options(agent, host_root=False, knobs=(), seccomp=f) == ["--security", f"seccomp:{f}"]
    # The same refusals as Docker's verifier, but clone3: ENOSYS by a trace nobody attaches.
    apptainer, docker = apptainer_profile()["syscalls"], verifier_profile()["syscalls"]
    assert apptainer[:-1] == docker[:-1] and set(DENIED) <= set(apptainer[0]["names"])
    assert {"ptrace", "unshare", "setns", "mount"} <= set(apptainer[0]["names"])
    assert apptainer[-1] == {"names": ["clone3"], "action": "SCMP_ACT_TRACE"}


def test_start_argv_with_harness_and_tmpfs(tmp_path):
    spec = make_spec(tmp_path, harness=True)
    argv = ap.start_argv("/usr/bin/apptainer", "/images/t.sif", "sample-1", spec, None)
    assert argv[:5] == ["/usr/bin/apptainer", "instance", "start", "--cleanenv", "--contain"]
    assert "--writable-tmpfs" in argv and "--overlay" not in argv
    binds = [argv[i + 1] for i, a in enumerate(argv) if a == "--bind"]
    assert binds[1:] == [
        f"{tmp_path}/session/home:{HOME_DIR}",
        f"{tmp_path}/ca/mitmproxy-ca-cert.pem:{CA_DIR}/mitmproxy-ca-cert.pem:ro",
        f"{tmp_path}/ca/polar-mitm-bundle.pem:{CA_DIR}/polar-mitm-bundle.pem:ro",
        f"{tmp_path}/npm/lib/node_modules:{NPM_MODULES}:ro",
        f"{tmp_path}/hbin:{HARNESS_BIN}:ro",
        f"{tmp_path}/node/bin:{NODE_BIN}:ro",
    ]
    assert argv[-2:] == ["/images/t.sif", "sample-1"]


def test_start_argv_binds_the_channel_socket_and_forwarder_read_only(tmp_path):
    """No network but the sample's own channel to the proxy: its socket and the forwarder."""
    from polar_mitm.sandbox.base import CHANNEL_SOCKET, FORWARDER_ROOT
    from polar_mitm.sandbox.channel import FORWARDER_DIR

    spec = make_spec(tmp_path, harness=True)
    spec.channel = tmp_path / "ch" / "proxy.sock"
    argv = ap.start_argv("apptainer", "/images/t.sif", "sample-1", spec, None)
    assert argv[7:10] == ["--net", "--network", "none"]
    binds = [argv[i + 1] for i, a in enumerate(argv) if a == "--bind"]
    assert f"{spec.channel}:{CHANNEL_SOCKET}:ro" in binds
    assert f"{FORWARDER_DIR.resolve()}:{FORWARDER_ROOT}:ro" in binds
    spec.purpose = "verifier"  # scoring: no harness, no CA, no home; its own channel where it has one
    spec.channel = None
    argv = ap.start_argv("apptainer", "/images/t.sif", "v-1", spec, None)
    binds = [argv[i + 1] for i, a in enumerate(argv) if a == "--bind"]
    assert argv[7:10] == ["--net", "--network", "none"]
    xfer = (tmp_path / "session" / "apptainer-verifier" / "xfer").resolve()
    assert binds == [f"{xfer}:{ap.XFER_DIR}", f"{ap.REAPER_HOST.resolve()}:{ap.REAPER}:ro"]


def test_privileges_and_the_harness_user():
    caps = ",".join(f"CAP_{c}" for c in ("CHOWN", "DAC_OVERRIDE", "FOWNER", "SETUID", "SETGID"))
    assert ap.privilege_options("root", host_root=True) == ["--no-privs", "--add-caps", caps]
    assert ap.privilege_options("harness", host_root=True) == [
        "--no-privs",
        "--add-caps",
        caps + ",CAP_SETPCAP",
    ]
    assert ap.privilege_options("harness", host_root=False) == []
    assert ap.as_user(["claude", "-p"], "1000:1000") == [
        "setpriv", "--reuid=1000", "--regid=1000", "--clear-groups", "--inh-caps=-all",
        "--bounding-set=-all", "--no-new-privs", "--", "claude", "-p",
    ]  # fmt: skip


def test_the_supervisors_report_is_found_by_its_secret_only():
    out = 'tests\nabc {"status": 0, "left": []}\nmore\nSECRET {"status": 1, "left": [[5, "Z", "sh"]]}\n'
    text, report = ap.report_of(out, "SECRET")
    assert text == 'tests\nabc {"status": 0, "left": []}\nmore' and report == {
        "status": 1,
        "left": [[5, "Z", "sh"]],
    }
    assert ap.report_of('forged {"status": 0, "left": []}\n', "SECRET") == (
        'forged {"status": 0, "left": []}\n',
        None,
    )


def test_limits_from_the_task():
    none = Limits(memory_mb=None, cpus=None)
    assert ap.limit_options(none.for_task(Task(id="t", instruction="x"))) == ["--pids-limit", "4096"]
    defaults = Limits().for_task(Task(id="t", instruction="x"))  # the rollout's, where a task names none
    assert ap.limit_options(defaults) == ["--pids-limit", "4096", "--memory", str(4096 << 20), "--cpus", "2"]
    t = Task(id="t", instruction="x", memory_mb=512, cpus=1.5)
    assert ap.limit_options(Limits().for_task(t)) == [
        "--pids-limit",
        "4096",
        "--memory",
        str(512 << 20),
        "--cpus",
        "1.5",
    ]


def test_bind_refuses_paths_apptainer_cannot_express(tmp_path):
    with pytest.raises(SandboxError, match="cannot bind"):
        ap.bind_option(tmp_path / "a,b", SESSION_DIR)
    with pytest.raises(SandboxError, match="cannot bind"):
        ap.bind_option(tmp_path / "a:b", SESSION_DIR)


def test_exec_argv_with_inline_env(tmp_path):
    opts, text = ap.env_options({"A": "1", "B": "x=y z"}, tmp_path / "e.env")
    assert text is None
    argv = ap.exec_argv("apptainer", "sample-1", ["echo", "hi"], "/workspace", opts)
    assert argv == [
        "apptainer", "exec", "--cleanenv", "--pwd", "/workspace",
        "--env", "A=1", "--env", "B=x=y z",
        "instance://sample-1", "echo", "hi",
    ]  # fmt: skip


def test_exec_argv_without_env():
    assert ap.env_options({}, Path("/unused")) == ([], None)
    assert ap.exec_argv("apptainer", "s", ["true"], "/w", []) == [
        "apptainer", "exec", "--cleanenv", "--pwd", "/w", "instance://s", "true",
    ]  # fmt: skip


@pytest.mark.parametrize(
    "env",
    [
        {"NO_PROXY": "localhost,127.0.0.1"},  # --env splits on commas
        {"JSON": '{"a": 1}'},  # a quote starts a CSV field
        {"PROMPT": "line one\nline two"},
        {"BIG": "x" * (ap.ENV_INLINE_MAX_CHARS + 1)},
        {f"V{i}": "1" for i in range(ap.ENV_INLINE_MAX_VARS + 1)},
    ],
)
def test_env_file_chosen_when_inline_env_would_break(env, tmp_path):
    opts, text = ap.env_options(env, tmp_path / "e.env")
    assert opts == ["--env-file", str(tmp_path / "e.env")]
    assert text is not None and "--env" not in opts


def test_env_file_text_is_shell_that_round_trips(tmp_path):
    """Apptainer evaluates the env file as shell: sourcing it in sh must give back every value."""
    env = {"A": "a,b", "Q": 'it\'s "quoted" $HOME `x`', "N": "1\n2", "E": ""}
    f = tmp_path / "e.env"
    f.write_text(ap.env_file_text(env))
    script = f"set -a; . {f}; " + "; ".join(f'printf "%s\\0" "${k}"' for k in env)
    out = __import__("subprocess").run(["sh", "-c", script], capture_output=True, env={}, check=True).stdout
    assert out.decode().split("\0")[:-1] == list(env.values())


def test_exec_env_puts_harness_dirs_first_on_path():
    prefix = [HARNESS_BIN, NODE_BIN]
    assert ap.exec_env({"A": "1"}, prefix) == {"A": "1", "PREPEND_PATH": f"{HARNESS_BIN}:{NODE_BIN}"}
    assert ap.exec_env({"PATH": "/usr/bin"}, prefix) == {"PATH": f"{HARNESS_BIN}:{NODE_BIN}:/usr/bin"}
    assert ap.exec_env(None, []) == {}


def test_stop_and_list_argv_and_parse():
    assert ap.stop_argv("apptainer", "s") == ["apptainer", "instance", "stop", "--force", "s"]
    assert ap.list_argv("apptainer", "s") == ["apptainer", "instance", "list", "--json", "s"]
    text = '{\n\t"instances": [{"instance": "a", "pid": 1, "img": "/x.sif"}, {"instance": "b"}]\n}'
    assert ap.listed_names(text) == {"a", "b"}
    assert ap.listed(text) == {"a": 1, "b": 0}
    assert ap.listed_names('{"instances": null}') == set()
    assert ap.listed_names("FATAL: not json") == set()


# --- binary detection ---------------------------------------------------------------------------


async def test_check_without_binary_says_what_to_do(tmp_path, monkeypatch):
    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    monkeypatch.setenv("POLAR_MITM_CACHE", str(empty))
    monkeypatch.delenv("POLAR_MITM_APPTAINER", raising=False)
    with pytest.raises(RuntimeUnavailable) as e:
        await ApptainerRuntime(registry_dir=tmp_path / "reg").check()
    assert str(e.value) == ap.UNAVAILABLE
    assert "install Apptainer (https://apptainer.org) or use --runtime docker / local" in str(e.value)
    assert "scripts/install.sh builds one" in str(e.value)


# --- limits it cannot enforce -------------------------------------------------------------------


def _recording_binary(tmp_path: Path) -> tuple[str, Path]:
    """A fake `apptainer` that records each call and starts nothing."""
    calls = tmp_path / "calls"
    binary = tmp_path / "apptainer"
    binary.write_text(f'#!/bin/sh\necho "$@" >> {calls}\necho \'{{"instances": []}}\'\n')
    binary.chmod(0o755)
    return str(binary), calls


async def test_a_sandbox_whose_limits_cannot_be_enforced_is_refused_at_its_start(tmp_path):
    """Where the probe found no cgroups, or there is no `mke2fs` for the /tmp and HOME images, an
    instance would run without that bound: every start refuses, whoever starts it (a rollout, a
    service's node, a verifier), before Apptainer is called, and leaves no record. Before, only
    `rollout`'s own check refused; a node's samples started unbounded with a warning in its log."""
    binary, calls = _recording_binary(tmp_path)
    rt = ApptainerRuntime(binary=binary, registry_dir=tmp_path / "reg", sif_dir=tmp_path / "sif")
    task = Task(id="t", instruction="x", image=str(tmp_path / "t.sif"))
    rt._images[task.id], rt._probed = str(tmp_path / "t.sif"), True
    rt.limits = False  # what probe_limits concludes without cgroups

    spec = make_spec(tmp_path)
    spec.session_dir.mkdir(parents=True)
    with pytest.raises(SandboxError, match="memory, CPU and pids limits.*--allow-unenforced-limits"):
        await rt.start(task, spec)
    assert not calls.exists() and not list((tmp_path / "reg").glob("*.json"))

    rt.limits, rt.mke2fs = True, None
    with pytest.raises(SandboxError, match="sizes of /tmp and HOME"):
        await rt.start(task, dataclasses.replace(spec, limits=Limits(memory_mb=None)))
    assert not calls.exists()

    # What is asked for is what is checked: no size asked, or leave given, and it starts.
    assert rt.unenforced(Limits(tmp_mb=None, home_mb=None)) is None
    rt.limits = False
    assert rt.unenforced(Limits(memory_mb=None, tmp_mb=None, home_mb=None)) is None
    allowed = dataclasses.replace(spec, limits=Limits(allow_unenforced=True))
    sandbox = await rt.start(task, allowed)  # (the fake says it started)
    assert "instance start" in calls.read_text()
    await sandbox.stop()
