"""Ray for the rollout service (`serve --ray`): a Ray of the server's own listens on 127.0.0.1
only, and `--ray auto` with no cluster says in one line what to do. Each starts real Ray
processes in a process of its own (slow)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time

import pytest

from polar_mitm.netaddr import is_loopback
from polar_mitm.service.ray_nodes import SINGLE_NODE_ENV
from tests.support.harness import POLAR
from tests.support.helpers import descendants

pytestmark = pytest.mark.slow

# The driver: a Ray of its own the way `serve --ray local` starts one, two CPUs, then waits.
DRIVER = (
    "from polar_mitm.service.ray_nodes import connect\n"
    "connect('local', num_cpus=2)\n"
    "print('up', flush=True)\n"
    "import time; time.sleep(300)\n"
)


def listening(pids: set[int]) -> list[tuple[str, str]]:
    """(process name, local address) of every TCP/UDP socket these processes listen on (ss)."""
    out = subprocess.run(["ss", "-ltunpH"], capture_output=True, text=True, timeout=30).stdout
    found = []
    for line in out.splitlines():
        owners = {int(p) for p in re.findall(r"pid=(\d+)", line)}
        if owners & pids:
            local = line.split()[4]
            name = (re.findall(r'\(\("([^"]+)"', line) or ["?"])[0]
            found.append((name, local))
    return found


def host_of(local: str) -> str:
    host = local.rsplit(":", 1)[0].strip("[]")
    return host.removeprefix("::ffff:")


def test_a_ray_of_our_own_listens_on_loopback_only(tmp_path):
    pytest.importorskip("ray")
    env = {k: v for k, v in os.environ.items() if k not in (SINGLE_NODE_ENV, "RAY_ADDRESS")}
    log = (tmp_path / "driver.log").open("wb")
    driver = subprocess.Popen(
        [sys.executable, "-c", DRIVER], stdout=subprocess.PIPE, stderr=log, env=env, start_new_session=True
    )
    tree: set[int] = set()
    try:
        assert driver.stdout is not None and driver.stdout.readline().strip() == b"up", (
            tmp_path / "driver.log"
        ).read_text()[-2000:]
        # Up means the GCS and the raylet answer; wait for a worker to listen too.
        deadline = time.time() + 60
        socks: list[tuple[str, str]] = []
        while time.time() < deadline:
            tree = descendants(driver.pid)
            socks = listening(tree)
            names = {n for n, _ in socks}
            if {"gcs_server", "raylet"} <= names and any(n.startswith("ray::") for n in names):
                break
            time.sleep(0.2)
        names = {n for n, _ in socks}
        assert {"gcs_server", "raylet"} <= names, socks
        exposed = [(n, a) for n, a in socks if not is_loopback(host_of(a))]
        assert not exposed, f"Ray listens beyond loopback: {exposed}"
    finally:
        tree |= descendants(driver.pid)
        for pid in sorted(tree, reverse=True):
            try:
                os.kill(pid, 9)
            except (ProcessLookupError, PermissionError):
                pass
        driver.wait(timeout=30)


def test_serve_ray_auto_without_a_cluster_says_what_to_do_in_one_line(tmp_path):
    """In a PID namespace of its own (so no other Ray on this machine is found) and a Ray temp
    dir of its own (so no address left by an earlier `ray start` is read)."""
    pytest.importorskip("ray")
    if subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"], capture_output=True).returncode:
        pytest.skip("needs a PID namespace of its own (unshare, as root)")
    ray_tmp = tempfile.mkdtemp(prefix="pmr", dir="/tmp")  # Ray's socket paths must stay short
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env |= {"RAY_TMPDIR": ray_tmp, "XDG_CONFIG_HOME": str(tmp_path / "config")}
    out = subprocess.run(
        ["unshare", "--pid", "--fork", "--mount-proc", *POLAR, "serve", "--listen", "127.0.0.1:0",
         "--ray", "auto", "--nodes", "1", "--db", str(tmp_path / "s.sqlite")],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    said = out.stdout + out.stderr
    assert out.returncode == 1, said[-3000:]
    assert "Traceback" not in said, said[-3000:]
    [error] = [line for line in said.splitlines() if line.startswith("Error:")]
    assert "ray start --head" in error and "--ray local" in error, error
