"""`polar-mitm node` as a user starts it: it registers once and goes on to send heartbeats.

The bug this is shaped like: the command started the node, then ran it (which starts it again),
so the second registration, with the node credential, found the id held by a live node (its own
first one) and waited until that was lost (`--node-timeout`) before any heartbeat or lease.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time

import httpx
import pytest

from tests.support.harness import free_port
from tests.support.service import node_args, spawn, wait_http

pytestmark = pytest.mark.slow
TOKEN = "node-command-token"


def test_a_node_registers_once_and_sends_heartbeats_long_before_its_timeout(
    tmp_path, monkeypatch, backend_process, tiny_tokenizer_dir
):
    monkeypatch.setenv("POLAR_MITM_SERVICE_TOKEN", TOKEN)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "log.txt"
    # A node that stopped answering would be lost only after 60 s: a heartbeat well before that
    # comes from a node that runs, not from one that re-registered.
    procs = [spawn(["serve", "--listen", f"127.0.0.1:{port}", "--nodes", "0", "--node-timeout", "60",
                    "--db", str(tmp_path / "s.sqlite")], log)]  # fmt: skip
    try:
        wait_http(url)
        procs.append(
            spawn(node_args(url, backend_process, tiny_tokenizer_dir, tmp_path / "n.sqlite", "n1"), log)
        )
        deadline = time.time() + 30
        nodes: list[dict] = []
        while time.time() < deadline:
            nodes = httpx.get(f"{url}/v1/nodes", headers={"authorization": f"Bearer {TOKEN}"}).json()
            if nodes and nodes[0]["load"] is not None:
                break
            time.sleep(0.2)
        assert [n["node_id"] for n in nodes] == ["n1"], log.read_text()[-3000:]
        assert nodes[0]["load"] is not None, f"no heartbeat within 30 s:\n{log.read_text()[-3000:]}"
        assert "is still held" not in log.read_text()
    finally:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
