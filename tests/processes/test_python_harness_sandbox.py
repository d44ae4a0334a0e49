"""A PyPI harness in a real Docker sandbox: its virtualenv and the interpreter installation it was
built on, mounted read-only at the host's own paths (harness/install.py, HarnessMount.trees).

The "harness" is an entry script in a virtualenv this test makes on the interpreter the project
runs on (a pyenv installation under /root here, whose /root is 0700 in the image too). It runs
from the sandbox's bin of links as the unprivileged harness user, then as root (what
`--harness-user root` gives), and tries to plant code where every later sample would run it:
a `.pth` file and a bytecode file in the virtualenv, its own entry script, the interpreter's
site-packages. It also looks around for the host's other files.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from polar_mitm import recipes
from polar_mitm.recipes import Recipe
from polar_mitm.tasks.model import Task

IMAGE = "polar-mitm/rollout-base:bookworm"

PROBE = r"""
import json, os, ssl, sys, sysconfig

out = {"uid": os.getuid(), "prefix": sys.prefix, "base": sys.base_prefix,
       "ssl": ssl.OPENSSL_VERSION, "dont_write_bytecode": sys.dont_write_bytecode}
site = sysconfig.get_paths()["purelib"]
base_site = sysconfig.get_paths(vars={"base": sys.base_prefix, "platbase": sys.base_prefix})["purelib"]
targets = {
    "venv_pth": os.path.join(site, "pwned.pth"),
    "venv_pyc": os.path.join(site, "__pycache__", "pwned.cpython.pyc"),
    "entry_script": os.path.realpath(sys.argv[0]),
}
if os.getuid() != 0:  # root's write there would land in the host's shared interpreter, were it writable
    targets["base_site"] = os.path.join(base_site, "pwned.pth")
for name, path in targets.items():
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "a") as f:
            f.write("import os\n")
        out[name] = "ok"
    except OSError as e:
        out[name] = f"failed: {e.strerror}"
for name, path in {"list_root": "/root", "list_versions": os.path.dirname(sys.base_prefix),
                   "list_venvs": os.path.dirname(sys.prefix)}.items():
    try:
        out[name] = sorted(os.listdir(path))
    except OSError as e:
        out[name] = f"failed: {e.strerror}"
print(json.dumps(out))
"""


def make_harness(tmp_path: Path, *, alias: bool = False) -> tuple[Path, Path, Path]:
    """A virtualenv on this interpreter's base installation with one entry script, `probe`,
    written as pip writes them (its `#!` names the venv's interpreter by absolute path). With
    `alias`, the venv reaches its interpreter through a symlinked directory (`pyalias` -> the
    installation), as a pyenv version reached through another name would. Returns the venv,
    the installation and the path the venv names it by."""
    venv = tmp_path / "venvs" / "probe"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    base = Path(sys.base_prefix).resolve()
    named = base
    if alias:
        named = tmp_path / "pyalias"
        named.symlink_to(base)
        (venv / "bin" / version).unlink()
        (venv / "bin" / version).symlink_to(named / "bin" / version)
        cfg = venv / "pyvenv.cfg"
        cfg.write_text(
            "".join(f"home = {named}/bin\n" if line.startswith("home") else line + "\n"
                    for line in cfg.read_text().splitlines())
        )  # fmt: skip
    script = venv / "bin" / "probe"
    script.write_text(f"#!{venv}/bin/{version}\n{PROBE}")
    script.chmod(0o755)
    return venv, base, named


def test_the_mount_is_the_venv_and_its_interpreter_at_their_own_paths(tmp_path, monkeypatch):
    from polar_mitm.harness.install import HarnessNotInstalled, harness_mount

    if Path(sys.base_prefix).resolve() in (Path("/usr"), Path("/usr/local")):
        pytest.skip("this interpreter is the system's own: a container cannot be shown it")
    venv, base, _ = make_harness(tmp_path)
    monkeypatch.setenv("PATH", f"{venv}/bin:/usr/bin:/bin")
    monkeypatch.setenv("POLAR_MITM_CACHE", str(tmp_path / "cache"))
    mount = harness_mount(Recipe(name="probe", binaries=["probe"], pypi="probe"))
    assert sorted(mount.trees) == sorted([(venv, str(venv)), (base, sys.base_prefix)])
    assert mount.modules is None and mount.node is None
    assert mount.python == f"{venv}/bin/python{sys.version_info.major}.{sys.version_info.minor}"
    assert (mount.bin / "probe").readlink() == venv / "bin" / "probe"
    assert mount.env == {"PYTHONDONTWRITEBYTECODE": "1"}
    assert "/" not in mount.traversed() and str(venv) not in mount.traversed()
    # A virtualenv on the system's Python (installed in /usr) cannot be shown: /usr is the image's.
    (venv / "pyvenv.cfg").write_text("home = /usr/bin\n")
    (venv / "bin" / "probe").write_text(f"#!{venv}/bin/python3\n")
    (venv / "bin" / "python3").unlink(missing_ok=True)
    (venv / "bin" / "python3").symlink_to("/usr/bin/python3")
    with pytest.raises(HarnessNotInstalled, match="system's Python"):
        harness_mount(Recipe(name="probe", binaries=["probe"], pypi="probe"))


def test_a_missing_virtualenv_is_named_with_its_install_command(tmp_path, monkeypatch):
    """A PyPI harness whose virtualenv is gone (its link in the cache's bin dangles) is refused
    before any container starts, with the command that installs it."""
    from polar_mitm.harness.install import HarnessNotInstalled, harness_mount

    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "mini").symlink_to(tmp_path / "venvs" / "mini-swe-agent" / "bin" / "mini")
    monkeypatch.setenv("POLAR_MITM_CACHE", str(tmp_path))
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    with pytest.raises(HarnessNotInstalled, match=r"pip install mini-swe-agent") as e:
        harness_mount(recipes.get("mini-swe-agent"))
    assert "scripts/install.sh" in str(e.value)


def test_apptainer_binds_the_trees_read_only_at_their_own_paths(tmp_path, monkeypatch, certs_dir):
    from polar_mitm.harness.install import harness_mount
    from polar_mitm.proxy.certs import ensure_ca
    from polar_mitm.sandbox.apptainer import argv as apptainer
    from polar_mitm.sandbox.base import NPM_MODULES, SandboxSpec

    venv, base, _ = make_harness(tmp_path)
    monkeypatch.setenv("PATH", f"{venv}/bin:/usr/bin:/bin")
    monkeypatch.setenv("POLAR_MITM_CACHE", str(tmp_path / "cache"))
    mount = harness_mount(Recipe(name="probe", binaries=["probe"], pypi="probe"))
    binds = apptainer.binds(SandboxSpec("s", tmp_path / "s", ensure_ca(certs_dir), mount))
    assert f"{venv}:{venv}:ro" in binds and f"{base}:{sys.base_prefix}:ro" in binds
    assert not any(NPM_MODULES in b for b in binds)


@pytest.mark.docker
@pytest.mark.slow
@pytest.mark.parametrize("alias", [False, True], ids=["direct", "through-a-symlinked-dir"])
async def test_a_python_harness_runs_unprivileged_and_cannot_change_its_installation(
    tmp_path, docker_client, certs_dir, monkeypatch, alias
):
    from polar_mitm.harness.install import harness_mount
    from polar_mitm.proxy.certs import ensure_ca
    from polar_mitm.sandbox.base import SandboxSpec
    from polar_mitm.sandbox.channel import Channel
    from polar_mitm.sandbox.docker import DockerRuntime

    async def answer(reader, writer):  # the host's end of the sample's channel
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.0 200 OK\r\ncontent-length: 2\r\n\r\nhi")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    channel = await Channel("s_pyh", "tok", server.sockets[0].getsockname()[1]).start()
    venv, base, named = make_harness(tmp_path, alias=alias)
    monkeypatch.setenv("PATH", f"{venv}/bin:/usr/bin:/bin")
    monkeypatch.setenv("POLAR_MITM_CACHE", str(tmp_path / "cache"))
    mount = harness_mount(Recipe(name="probe", binaries=["probe"], pypi="probe"))
    # One host directory, shown at each name the venv and the binary's RUNPATH use.
    assert {inside for host, inside in mount.trees if host == base} == {str(named), str(base)}
    spec = SandboxSpec(
        name=f"polar-pyharness-{time.time_ns()}", session_dir=tmp_path / "s", ca=ensure_ca(certs_dir),
        harness=mount, channel=channel.socket_path, labels={"polar-mitm.rollout": "pyharness-test"},
    )  # fmt: skip
    sb = await DockerRuntime().start(Task(id="pyharness", instruction="x", image=IMAGE), spec)
    try:
        await channel.wait_ready(10)  # the forwarder, on the mounted interpreter, listens
        top = await asyncio.to_thread(sb.container.top)
        user = await sb.exec_harness(["probe"], env={"HOME": "/tmp", **mount.env}, timeout=60)
        root = await sb.exec(["probe"], env=mount.env, timeout=60)
        attrs = await asyncio.to_thread(lambda: docker_client.containers.get(sb.name).attrs)
    finally:
        await sb.stop()
        await channel.close()
        server.close()
    [forwarder] = [p[-1] for p in top["Processes"] if "forward." in p[-1]]
    assert forwarder.startswith(f"{mount.python} ") and "forward.py" in forwarder
    assert user.exit_code == 0 and root.exit_code == 0, (user.output, root.output)
    u, r = json.loads(user.output.strip().splitlines()[-1]), json.loads(root.output.strip().splitlines()[-1])
    # It ran from the links, as the harness user, on the mounted interpreter, with its ssl.
    assert u["uid"] == 1000 and r["uid"] == 0
    assert u["prefix"] == str(venv) and u["base"] in (str(named), sys.base_prefix)
    assert u["ssl"].startswith("OpenSSL")
    assert u["dont_write_bytecode"] is True
    # Nothing it wrote lands in the installation, as the harness user or as root.
    for probe in (u, r):
        for name in ("venv_pth", "venv_pyc", "entry_script"):
            assert probe[name].startswith("failed"), (name, probe[name])
    assert u["base_site"].startswith("failed")
    assert not list(venv.rglob("pwned*")) and "import os" not in (venv / "bin" / "probe").read_text()[-20:]
    # The directories above the trees can be passed through, not listed; nothing else is there.
    assert u["list_root"] == "failed: Permission denied"
    assert r["list_venvs"] == ["probe"]
    if not alias:
        assert u["list_versions"] == [base.name]
    trees = {inside for _, inside in mount.trees}
    mounted = {m["Destination"]: m["RW"] for m in attrs["Mounts"]}
    assert trees <= set(mounted) and not any(mounted[t] for t in trees)


# --- editable installs (`pip install -e`): their source trees are shown too -----------------------

EDIT_PROBE = r"""
import json, os
import editmod, finderpkg

out = {"editmod": editmod.WORD, "finderpkg": finderpkg.WORD}
for name, mod in (("edit_write", editmod), ("finder_write", finderpkg)):
    try:
        with open(os.path.join(os.path.dirname(mod.__file__), "pwned.py"), "a") as f:
            f.write("x = 1\n")
        out[name] = "ok"
    except OSError as e:
        out[name] = f"failed: {e.strerror}"
print(json.dumps(out))
"""


def add_editable_installs(tmp_path: Path, venv: Path) -> tuple[Path, Path]:
    """Two editable installs into `venv`, as the build backends write them: a `.pth` path line
    (hatchling, flit, pdm, uv) to a source tree holding `editmod`, and a setuptools editable
    finder whose MAPPING names the package directory of `finderpkg`; an entry script
    `editprobe` imports both. Returns the two source directories."""
    site = next(venv.glob("lib/python*/site-packages"))
    src = tmp_path / "projects" / "edit" / "src"
    src.mkdir(parents=True)
    (src / "editmod.py").write_text("WORD = 'edited'\n")
    pkg = tmp_path / "projects" / "finder" / "finderpkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("WORD = 'found'\n")
    (site / "_editmod.pth").write_text(f"{src}\n")
    finder = "__editable___finderpkg_0_1_finder"
    (site / f"{finder}.py").write_text(
        "import sys\n"
        "from importlib.machinery import PathFinder\n"
        f"MAPPING: dict[str, str] = {{'finderpkg': {str(pkg)!r}}}\n"
        "class Finder:\n"
        "    @classmethod\n"
        "    def find_spec(cls, name, path=None, target=None):\n"
        "        if name in MAPPING:\n"
        "            import os\n"
        "            return PathFinder.find_spec(name, [os.path.dirname(MAPPING[name])])\n"
        "def install():\n"
        "    sys.meta_path.append(Finder)\n"
    )
    (site / "__editable__.finderpkg-0.1.pth").write_text(f"import {finder}; {finder}.install()\n")
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    script = venv / "bin" / "editprobe"
    script.write_text(f"#!{venv}/bin/{version}\n{EDIT_PROBE}")
    script.chmod(0o755)
    return src, pkg


def test_editable_installs_are_shown_at_their_own_paths_and_system_ones_refused(tmp_path, monkeypatch):
    from polar_mitm.harness.install import HarnessNotInstalled, harness_mount

    venv, base, _ = make_harness(tmp_path)
    src, pkg = add_editable_installs(tmp_path, venv)
    site = next(venv.glob("lib/python*/site-packages"))
    # Paths Python itself passes over are passed over: one that does not exist, one in the venv.
    (venv / "src" / "clone").mkdir(parents=True)
    (site / "_more.pth").write_text(f"# a comment\n{tmp_path}/gone\n{venv}/src/clone\n")
    assert subprocess.run([venv / "bin" / "editprobe"], capture_output=True).returncode == 0  # on the host
    monkeypatch.setenv("PATH", f"{venv}/bin:/usr/bin:/bin")
    monkeypatch.setenv("POLAR_MITM_CACHE", str(tmp_path / "cache"))
    recipe = Recipe(name="probe", binaries=["editprobe"], pypi="probe")
    mount = harness_mount(recipe)
    assert sorted(mount.trees) == sorted(
        [(venv, str(venv)), (base, sys.base_prefix), (src, str(src)), (pkg, str(pkg))]
    )
    # An editable install from a directory of the image's own would hide it: refused, named.
    (site / "_system.pth").write_text("/usr/lib/python3/dist-packages\n")
    with pytest.raises(HarnessNotInstalled, match="editable install from /usr/lib/python3/dist-packages"):
        harness_mount(recipe)


@pytest.mark.docker
@pytest.mark.slow
async def test_an_editable_harness_imports_its_sources_in_the_container_and_cannot_change_them(
    tmp_path, docker_client, certs_dir, monkeypatch
):
    from polar_mitm.harness.install import harness_mount
    from polar_mitm.proxy.certs import ensure_ca
    from polar_mitm.sandbox.base import SandboxSpec
    from polar_mitm.sandbox.docker import DockerRuntime

    venv, _, _ = make_harness(tmp_path)
    src, pkg = add_editable_installs(tmp_path, venv)
    monkeypatch.setenv("PATH", f"{venv}/bin:/usr/bin:/bin")
    monkeypatch.setenv("POLAR_MITM_CACHE", str(tmp_path / "cache"))
    mount = harness_mount(Recipe(name="probe", binaries=["editprobe"], pypi="probe"))
    spec = SandboxSpec(
        name=f"polar-pyedit-{time.time_ns()}", session_dir=tmp_path / "s", ca=ensure_ca(certs_dir),
        harness=mount, labels={"polar-mitm.rollout": "pyharness-test"},
    )  # fmt: skip
    sb = await DockerRuntime().start(Task(id="pyedit", instruction="x", image=IMAGE), spec)
    try:
        user = await sb.exec_harness(["editprobe"], env={"HOME": "/tmp", **mount.env}, timeout=60)
        root = await sb.exec(["editprobe"], env=mount.env, timeout=60)
    finally:
        await sb.stop()
    assert user.exit_code == 0 and root.exit_code == 0, (user.output, root.output)
    for out in (user.output, root.output):
        got = json.loads(out.strip().splitlines()[-1])
        assert (got["editmod"], got["finderpkg"]) == ("edited", "found")
        assert got["edit_write"].startswith("failed") and got["finder_write"].startswith("failed"), got
    assert not list(src.glob("pwned*")) and not list(pkg.glob("pwned*"))
