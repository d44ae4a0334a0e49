"""The rollout service at a few dozen samples when a process dies mid-run: `polar-mitm serve`
killed with SIGKILL and started again on the same store, and a `polar-mitm node` killed while it
holds leases. Samples are instant (a shell 'harness' that writes its instruction, no model call),
so the runs are about the control plane: every sample scored exactly once, no group lost or
doubled, leases resumed or run again, nodes that carry on by themselves.
"""

from __future__ import annotations

import os
import signal
import sqlite3
import time
from pathlib import Path

import pytest

from polar_mitm.client import RolloutClient
from polar_mitm.procs import kill_group
from polar_mitm.tasks.model import EvaluatorSpec, Task
from tests.support.harness import FakeBackend, port_of
from tests.support.helpers import process_gone, wait_until
from tests.support.service import TOKEN, node_args, served_url, spawn, wait_http

GROUPS, SAMPLES = 20, 4
INSTANT = ["sh", "-c", 'echo "$1" > out.txt', "harness", "{instruction}"]
# A sample that lasts a moment, so that a lease is held whenever the server is killed: with
# instant samples the kill could fall between one batch of leases and the next.
LINGERING = ["sh", "-c", 'sleep 0.3; echo "$1" > out.txt', "harness", "{instruction}"]


@pytest.fixture(autouse=True)
def control_token(monkeypatch, tmp_path):
    monkeypatch.setenv("POLAR_MITM_SERVICE_TOKEN", TOKEN)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))


@pytest.fixture
def backend(tiny_tokenizer_dir):
    b = FakeBackend(tiny_tokenizer_dir)
    yield b
    b.stop()


def submit_all(client: RolloutClient, scores: Path, harness_cmd: list[str] = INSTANT) -> list[str]:
    """GROUPS tasks of SAMPLES instant samples; the evaluator appends one line per scoring run."""
    check = f'grep -q pass out.txt && echo "$PWD" >> {scores}'
    return [
        client.submit(
            Task(id=f"g{i}", instruction="pass", evaluator=EvaluatorSpec(kind="command", command=check)),
            samples=SAMPLES,
            harness="claude-code",
            runtime="local",
            harness_cmd=harness_cmd,
        )
        for i in range(GROUPS)
    ]


def count(db: Path, state: str) -> int:
    con = sqlite3.connect(db)
    try:
        return con.execute("SELECT COUNT(*) FROM service_samples WHERE state = ?", (state,)).fetchone()[0]
    finally:
        con.close()


def finished(db: Path) -> int:
    return count(db, "finished")


def check_every_sample_once(client: RolloutClient, ids: list[str], db: Path, log: Path) -> list:
    groups = list(client.wait(ids, poll=0.3, timeout=180))
    assert sorted(g.task_id for g in groups) == sorted(
        f"g{i}" for i in range(GROUPS)
    )  # none lost, none twice
    for g in groups:
        assert [o.status for o in g.outcomes] == ["completed"] * SAMPLES, log.read_text()[-3000:]
        assert [o.reward for o in g.outcomes] == [1.0] * SAMPLES
        assert sorted(o.index for o in g.outcomes) == list(range(SAMPLES))
        assert g.samples == []  # no model call, no trajectory row
    con = sqlite3.connect(db)
    rows = con.execute("SELECT state, status, COUNT(*) FROM service_samples GROUP BY 1, 2").fetchall()
    con.close()
    assert rows == [("finished", "completed", GROUPS * SAMPLES)]
    return groups


@pytest.mark.slow
def test_a_server_killed_mid_run_restarts_on_its_store_and_loses_nothing(
    tmp_path, backend, tiny_tokenizer_dir
):
    log, db, scores = tmp_path / "log.txt", tmp_path / "s.sqlite", tmp_path / "scores.txt"
    serve = ["serve", "--listen", "127.0.0.1:0", "--nodes", "0", "--allow-local-runtime",
             "--db", str(db)]  # fmt: skip
    server = spawn(serve, log)
    procs = [server]
    try:
        url = served_url(log, server)
        serve[2] = f"127.0.0.1:{port_of(url)}"  # the restart takes the address the nodes know
        nodes = [
            spawn(node_args(url, backend, tiny_tokenizer_dir, tmp_path / f"n{i}.sqlite", f"n{i}"), log)
            for i in range(2)
        ]
        procs += nodes
        client = RolloutClient(url)
        ids = submit_all(client, scores, LINGERING)
        total = GROUPS * SAMPLES
        wait_until(
            lambda: finished(db) >= total // 4 and count(db, "dispatched") > 0,
            timeout=120,
            message="a quarter of the samples, and leases held",
        )
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()
        con = sqlite3.connect(db)
        held = dict(
            con.execute(
                "SELECT task_id || ':' || idx, node_id FROM service_samples WHERE state = 'dispatched'"
            )
        )
        con.close()
        assert held and finished(db) < total, "the run ended before the server was killed"
        time.sleep(1.5)  # the nodes' heartbeats, leases and reports fail meanwhile
        procs.append(spawn(serve, log))
        wait_http(url)
        check_every_sample_once(client, ids, db, log)
        # The nodes carried on by themselves: both still run and are known to the new server.
        assert all(p.poll() is None for p in nodes), log.read_text()[-3000:]
        con = sqlite3.connect(db)
        states = dict(con.execute("SELECT id, state FROM service_nodes"))
        by = dict(con.execute("SELECT task_id || ':' || idx, node_id FROM service_samples"))
        con.close()
        assert states == {"n0": "active", "n1": "active"}
        assert all(by[k] in ("n0", "n1") for k in held)  # the leases held at the kill were finished
    finally:
        for p in procs:
            kill_group(p.pid)
    con = sqlite3.connect(db)
    redone = con.execute("SELECT COUNT(*) FROM service_samples WHERE dispatches > 1").fetchone()[0]
    con.close()
    # Each sample is scored once per run that reported; only a run whose report the dead server
    # never took is run (and scored) again.
    lines = scores.read_text().splitlines()
    assert total <= len(lines) <= total + redone


@pytest.mark.slow
def test_a_node_killed_mid_run_has_its_leases_run_elsewhere(tmp_path, backend, tiny_tokenizer_dir):
    log, db, scores = tmp_path / "log.txt", tmp_path / "s.sqlite", tmp_path / "scores.txt"
    timeout = 3
    server = spawn(
        [
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--nodes",
            "0",
            "--node-timeout",
            str(timeout),
            "--allow-local-runtime",
            "--db",
            str(db),
        ],  # fmt: skip
        log,
    )
    procs = [server]
    try:
        url = served_url(log, server)
        doomed = spawn(node_args(url, backend, tiny_tokenizer_dir, tmp_path / "a.sqlite", "doomed"), log)
        steady = spawn(node_args(url, backend, tiny_tokenizer_dir, tmp_path / "b.sqlite", "steady"), log)
        procs += [doomed, steady]
        client = RolloutClient(url)
        ids = submit_all(client, scores)
        con = sqlite3.connect(db)

        def held_by_doomed() -> int:
            q = "SELECT COUNT(*) FROM service_samples WHERE state = 'dispatched' AND node_id = 'doomed'"
            return con.execute(q).fetchone()[0]

        wait_until(lambda: held_by_doomed() > 0, timeout=120, message="the doomed node to hold leases")
        os.killpg(doomed.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        wait_until(lambda: process_gone(doomed), timeout=10, message="the doomed node to be gone")
        # Within the node timeout (and a poll of the server's sweep), its leases go elsewhere.
        wait_until(lambda: held_by_doomed() == 0, timeout=timeout + 10, message="the leases to be taken back")
        assert time.monotonic() - killed_at < timeout + 10
        con.close()
        groups = check_every_sample_once(client, ids, db, log)
    finally:
        for p in procs:
            kill_group(p.pid)
    assert {o.node_id for g in groups for o in g.outcomes} <= {"doomed", "steady"}
    assert max(o.dispatches for g in groups for o in g.outcomes) <= 2
