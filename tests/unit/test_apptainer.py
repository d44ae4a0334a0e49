"""The apptainer runtime: its command lines (pure functions), binary detection, and its process
handling run for real against a fake `apptainer` script; one test needs the real binary."""

from __future__ import annotations

import asyncio
import os
import shutil
from pathlib import Path

import pytest

from polar_mitm.proxy.certs import CA
from polar_mitm.sandbox import apptainer as ap
from polar_mitm.sandbox.apptainer import ApptainerRuntime, ApptainerSandbox
from polar_mitm.sandbox.base import (
    CA_DIR,
    HARNESS_BIN,
    NODE_BIN,
    NPM_MODULES,
    SESSION_DIR,
    HarnessMount,
    RuntimeUnavailable,
    SandboxError,
    SandboxSpec,
)
from polar_mitm.tasks.model import Task
from tests.support.helpers import process_gone, wait_until_async


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


async def test_prepare_refuses_a_dockerfile_only_task_and_a_missing_sif(tmp_path):
    rt = ApptainerRuntime(binary="apptainer", registry_dir=tmp_path / "reg")
    with pytest.raises(SandboxError, match="cannot build Dockerfiles.*docker build"):
        await rt.prepare(Task(id="t", instruction="x", dockerfile=tmp_path / "Dockerfile"))
    with pytest.raises(SandboxError, match="does not exist"):
        await rt.prepare(Task(id="t", instruction="x", image=str(tmp_path / "missing.sif")))
    (tmp_path / "ok.sif").touch()
    await rt.prepare(Task(id="t", instruction="x", image=str(tmp_path / "ok.sif")))
    await rt.prepare(Task(id="t", instruction="x", image="ubuntu:24.04"))


def test_sandbox_ca_points_into_ca_dir_without_the_key(tmp_path):
    ca = ap.sandbox_ca(make_ca(tmp_path / "ca"))
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
    argv = ap.start_argv("apptainer", "docker://ubuntu:24.04", "sample-1", spec, overlay)
    assert argv == [
        "apptainer", "instance", "start", "--cleanenv", "--no-mount", "home,cwd,tmp",
        "--net", "--network", "none",
        "--overlay", str(overlay),
        "--bind", f"{tmp_path}/session:{SESSION_DIR}",
        "--bind", f"{tmp_path}/ca/mitmproxy-ca-cert.pem:{CA_DIR}/mitmproxy-ca-cert.pem:ro",
        "--bind", f"{tmp_path}/ca/polar-mitm-bundle.pem:{CA_DIR}/polar-mitm-bundle.pem:ro",
        "docker://ubuntu:24.04", "sample-1",
    ]  # fmt: skip
    assert "--containall" not in argv  # no network but loopback (issue 22), the rest as before
    assert not any("mitmproxy-ca.pem" in a for a in argv)  # the private key stays on the host


def test_start_argv_with_harness_and_tmpfs(tmp_path):
    spec = make_spec(tmp_path, harness=True)
    argv = ap.start_argv("/usr/bin/apptainer", "/images/t.sif", "sample-1", spec, None)
    assert argv[:6] == ["/usr/bin/apptainer", "instance", "start", "--cleanenv", "--no-mount", "home,cwd,tmp"]
    assert "--writable-tmpfs" in argv and "--overlay" not in argv
    binds = [argv[i + 1] for i, a in enumerate(argv) if a == "--bind"]
    assert binds == [
        f"{tmp_path}/session:{SESSION_DIR}",
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
    assert argv[6:9] == ["--net", "--network", "none"]
    binds = [argv[i + 1] for i, a in enumerate(argv) if a == "--bind"]
    assert f"{spec.channel}:{CHANNEL_SOCKET}:ro" in binds
    assert f"{FORWARDER_DIR.resolve()}:{FORWARDER_ROOT}:ro" in binds
    spec.purpose = "verifier"  # scoring: no harness, no channel, still no network
    argv = ap.start_argv("apptainer", "/images/t.sif", "v-1", spec, None)
    binds = [argv[i + 1] for i, a in enumerate(argv) if a == "--bind"]
    assert argv[6:9] == ["--net", "--network", "none"]
    assert not [b for b in binds if CHANNEL_SOCKET in b or NPM_MODULES in b or FORWARDER_ROOT in b]


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
    assert ap.stop_argv("apptainer", "s") == ["apptainer", "instance", "stop", "s"]
    assert ap.list_argv("apptainer", "s") == ["apptainer", "instance", "list", "--json", "s"]
    text = '{\n\t"instances": [{"instance": "a", "pid": 1, "img": "/x.sif"}, {"instance": "b"}]\n}'
    assert ap.listed_names(text) == {"a", "b"}
    assert ap.listed_names('{"instances": null}') == set()
    assert ap.listed_names("FATAL: not json") == set()


# --- binary detection ---------------------------------------------------------------------------


async def test_check_without_binary_says_what_to_do(tmp_path, monkeypatch):
    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    with pytest.raises(RuntimeUnavailable) as e:
        await ApptainerRuntime(registry_dir=tmp_path / "reg").check()
    assert str(e.value) == ap.UNAVAILABLE
    assert "install Apptainer (https://apptainer.org) or use --runtime docker / local" in str(e.value)


# --- process handling, against a fake apptainer ------------------------------------------------

FAKE_APPTAINER = r"""#!/bin/bash
# A fake `apptainer` for tests: logs its argv, keeps "instances" as files, runs exec'd commands
# on the host with the instance's binds mapped back to host paths.
state="$FAKE_APPTAINER_STATE"
printf '%s\n' "$*" >> "$state/argv.log"
case "$1" in
--version) echo "apptainer version 1.3.0-fake"; exit 0 ;;
instance)
  case "$2" in
  start)
    shift 2; binds=()
    while [ $# -gt 2 ]; do
      case "$1" in
      --bind) binds+=("$2"); shift 2 ;;
      --overlay)
        if [ -n "$FAKE_APPTAINER_SETUID" ]; then
          echo "FATAL: only root user can use sandbox as overlay in setuid mode" >&2; exit 255
        fi
        shift 2 ;;
      --no-mount|--network) shift 2 ;;
      --cleanenv|--writable-tmpfs|--net) shift ;;
      *) echo "FATAL: unknown option $1" >&2; exit 255 ;;
      esac
    done
    printf '%s\n' "${binds[@]}" > "$state/$2.instance"; exit 0 ;;
  list)
    sep=""; printf '{"instances": ['
    for f in "$state"/*.instance; do
      [ -e "$f" ] || continue; n=$(basename "$f" .instance)
      [ -n "$4" ] && [ "$4" != "$n" ] && continue
      printf '%s{"instance": "%s", "pid": 1}' "$sep" "$n"; sep=", "
    done
    echo ']}'; exit 0 ;;
  stop)
    [ -f "$state/$3.instance" ] || { echo "FATAL: no instance found" >&2; exit 255; }
    rm -f "$state/$3.instance"; exit 0 ;;
  esac ;;
exec)
  shift; envs=(); envfile=""; pwd="/"
  while [[ "$1" != instance://* ]]; do
    case "$1" in
    --pwd) pwd="$2"; shift 2 ;;
    --env) envs+=("$2"); shift 2 ;;
    --env-file) envfile="$2"; shift 2 ;;
    --cleanenv) shift ;;
    *) echo "FATAL: unknown option $1" >&2; exit 255 ;;
    esac
  done
  name="${1#instance://}"; shift
  [ -f "$state/$name.instance" ] || { echo "FATAL: instance $name not found" >&2; exit 255; }
  args=()
  for a in "$@"; do
    while IFS= read -r b; do
      src="${b%%:*}"; rest="${b#*:}"; dst="${rest%%:*}"
      [[ "$a" == "$dst"* ]] && a="$src${a#"$dst"}"
    done < "$state/$name.instance"
    args+=("$a")
  done
  cd "$pwd" || exit 255
  if [ -n "$envfile" ]; then set -a; . "$envfile"; set +a; fi
  for e in "${envs[@]}"; do export "$e"; done
  exec "${args[@]}" ;;
esac
echo "FATAL: fake apptainer cannot do: $*" >&2; exit 255
"""


@pytest.fixture
def fake_apptainer(tmp_path, monkeypatch) -> Path:
    """A fake `apptainer` first on PATH; returns its state directory (argv.log, *.instance)."""
    bindir, state = tmp_path / "fakebin", tmp_path / "fakestate"
    bindir.mkdir()
    state.mkdir()
    exe = bindir / "apptainer"
    exe.write_text(FAKE_APPTAINER)
    exe.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_APPTAINER_STATE", str(state))
    return state


def _calls(state: Path) -> list[str]:
    return (state / "argv.log").read_text().splitlines()


async def test_sandbox_lifecycle_against_fake_apptainer(tmp_path, fake_apptainer):
    """Checks our process handling (start, exec with env and timeout, put, read, alive, stop,
    cleanup) with a fake `apptainer` that runs commands on the host: not Apptainer itself."""
    rt = ApptainerRuntime(registry_dir=tmp_path / "reg")
    await rt.check()
    assert rt.binary == str(tmp_path / "fakebin" / "apptainer")
    workdir = str(tmp_path / "work")  # a host path: the fake runs commands on the host
    task = Task(id="t1", instruction="x", image="alpine:3.20", workdir=workdir)
    spec = make_spec(tmp_path, labels={"polar-mitm.run": "r1"})
    sb = await rt.start(task, spec)
    assert isinstance(sb, ApptainerSandbox)
    name = ap.instance_name(spec.name)
    assert sb.name == name and sb.workdir == workdir and sb.path_prefix == []
    assert sb.ca.cert == Path(CA_DIR) / "mitmproxy-ca-cert.pem"
    start = next(c for c in _calls(fake_apptainer) if c.startswith("instance start"))
    assert start.endswith(f"docker://alpine:3.20 {name}") and "--overlay" in start
    assert (rt.registry_dir / f"{name}.json").exists()
    assert Path(workdir).is_dir()  # made by an exec after the start
    assert await sb.alive()

    r = await sb.exec(["sh", "-c", 'echo hi; echo "$A|$NO_PROXY|$PWD"'], env={"A": "1", "NO_PROXY": "a,b"})
    assert (r.exit_code, r.timed_out) == (0, False)
    assert r.output == f"hi\n1|a,b|{workdir}\n"
    assert "--env-file" in _calls(fake_apptainer)[-1]  # the comma sent it through a file...
    assert not list((spec.session_dir / "env").iterdir())  # ...removed after the exec

    r = await sb.exec(["sh", "-c", "echo out; echo err >&2; exit 3"])
    assert r.exit_code == 3 and "out" in r.output and "err" in r.output

    pidfile = tmp_path / "bg.pid"
    r = await sb.exec(["sh", "-c", f"sleep 30 & echo $! > {pidfile}; wait"], timeout=0.5)
    assert (r.exit_code, r.timed_out) == (124, True) and r.seconds < 10
    bg = int(pidfile.read_text())
    await wait_until_async(lambda: process_gone(bg), timeout=2.5, message="the background child to end")
    assert process_gone(bg), "the timeout left the command's background child running"

    src = tmp_path / "hello.txt"
    src.write_bytes(b"hello\x00\xff")
    dest = tmp_path / "inside" / "deep" / "hello.txt"
    await sb.put(src, str(dest))
    assert dest.read_bytes() == b"hello\x00\xff"
    assert await sb.read(str(dest)) == b"hello\x00\xff"
    tree = tmp_path / "tree"
    (tree / "sub").mkdir(parents=True)
    (tree / "sub" / "f").write_text("f")
    await sb.put(tree, str(tmp_path / "copied"))
    assert (tmp_path / "copied" / "sub" / "f").read_text() == "f"
    assert await sb.read(str(tmp_path / "nope")) is None
    assert await sb.read(str(tmp_path / "copied")) is None  # a directory
    assert not list((spec.session_dir / "xfer").iterdir())

    await sb.stop()
    await sb.stop()  # twice is fine
    assert not await sb.alive()
    assert not (rt.registry_dir / f"{name}.json").exists()
    assert not (spec.session_dir / "overlay").exists()
    with pytest.raises(SandboxError, match="stopped"):
        await sb.exec(["true"])


async def test_stop_kills_running_exec_and_cleanup_stops_by_label(tmp_path, fake_apptainer):
    """Our process handling again (fake `apptainer`): stop() ends a running exec; cleanup()
    stops recorded instances whose labels match and leaves the others."""
    rt = ApptainerRuntime(registry_dir=tmp_path / "reg")
    task = Task(id="t1", instruction="x", image="alpine:3.20", workdir=str(tmp_path / "work"))
    a = await rt.start(
        task, SandboxSpec("a", tmp_path / "sa", make_ca(tmp_path / "ca"), labels={"run": "r1"})
    )
    b = await rt.start(
        task, SandboxSpec("b", tmp_path / "sb", make_ca(tmp_path / "ca"), labels={"run": "r2"})
    )
    marker = tmp_path / "started"
    running = asyncio.create_task(a.exec(["sh", "-c", f"touch {marker}; exec sleep 30"]))
    await wait_until_async(marker.exists, timeout=5, message="the command started")
    await a.stop()
    r = await asyncio.wait_for(running, 5)
    assert r.exit_code == 137 and not r.timed_out

    (fake_apptainer / "b.instance").rename(fake_apptainer / "b.gone")
    with pytest.raises(SandboxError, match="instance b is gone"):
        await b.exec(["true"])
    (fake_apptainer / "b.gone").rename(fake_apptainer / "b.instance")

    assert await rt.cleanup({"run": "r1"}) == 0  # a's record went with its stop
    assert await b.alive()
    assert await rt.cleanup({"run": "r2"}) == 1
    assert not (fake_apptainer / "b.instance").exists()
    assert "instance stop b" in _calls(fake_apptainer)[-1]


async def test_start_failure_is_a_sandbox_error_with_apptainer_output(tmp_path, fake_apptainer):
    """Our handling of a failed `instance start` (fake `apptainer`): the output is in the error."""
    (tmp_path / "fakebin" / "apptainer").write_text(
        "#!/bin/sh\necho 'FATAL: image not found' >&2\nexit 255\n"
    )
    rt = ApptainerRuntime(binary="apptainer", registry_dir=tmp_path / "reg")
    task = Task(id="t1", instruction="x", image="alpine:3.20")
    with pytest.raises(SandboxError, match="FATAL: image not found"):
        await rt.start(task, make_spec(tmp_path))
    assert not list(rt.registry_dir.glob("*.json"))


async def test_overlay_refused_falls_back_to_tmpfs(tmp_path, fake_apptainer, monkeypatch):
    """Our handling of a setuid Apptainer refusing overlay directories (fake `apptainer`): the
    start is retried with --writable-tmpfs, and later starts use it straight away."""
    monkeypatch.setenv("FAKE_APPTAINER_SETUID", "1")
    rt = ApptainerRuntime(registry_dir=tmp_path / "reg")
    task = Task(id="t1", instruction="x", image="alpine:3.20", workdir=str(tmp_path / "work"))
    sb = await rt.start(task, make_spec(tmp_path))
    starts = [c for c in _calls(fake_apptainer) if c.startswith("instance start")]
    assert len(starts) == 2 and "--overlay" in starts[0] and "--writable-tmpfs" in starts[1]
    assert rt.overlay is False and sb.overlay is None
    assert not (tmp_path / "session" / "overlay").exists()
    await sb.stop()


# --- the real thing -----------------------------------------------------------------------------


@pytest.mark.skipif(
    shutil.which("apptainer") is None and shutil.which("singularity") is None,
    reason="Apptainer cannot be installed on this machine: the runtime's command lines are tested above; "
    "this test needs the real binary",
)
async def test_real_apptainer_instance(tmp_path):
    image = os.environ.get("POLAR_MITM_APPTAINER_TEST_IMAGE", "docker://alpine:3.20")
    rt = ApptainerRuntime(registry_dir=tmp_path / "reg")
    await rt.check()
    task = Task(id="real", instruction="x", image=image, workdir="/workspace")
    await rt.prepare(task)
    spec = make_spec(tmp_path)
    sb = await rt.start(task, spec)
    try:
        r = await sb.exec(["echo", "hi"], timeout=60)
        assert (r.exit_code, r.output) == (0, "hi\n")
        src = tmp_path / "note.txt"
        src.write_text("written on the host\n")
        await sb.put(src, "/workspace/note.txt")
        assert await sb.read("/workspace/note.txt") == b"written on the host\n"
        assert await sb.read("/workspace/missing") is None
        assert await sb.read(str(sb.ca.cert)) == spec.ca.cert.read_bytes()
        assert await sb.read(f"{CA_DIR}/{spec.ca.key_and_cert.name}") is None
        probe = f"/tmp/polar-mitm-probe-{tmp_path.name}"
        r = await sb.exec(["touch", probe], timeout=60)
        assert r.exit_code == 0 and not Path(probe).exists()  # the sandbox's /tmp is not the host's
        assert await sb.alive()
    finally:
        await sb.stop()
    assert not await sb.alive()
