"""The rollout service attacked as a network client (or a compromised node) would attack it: a
real server on 127.0.0.1, real HTTP, real SQLite. The operator holds the control token and the
machine; everyone else gets nothing done, a node only what a node does, and every input is
bounded. `serve` itself (token file, --listen) runs as a real process.
"""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import threading
import time

import httpx
import pytest

from polar_mitm.client import RolloutClient
from polar_mitm.service.config import ServerConfig
from polar_mitm.service.server import RolloutServer
from polar_mitm.tasks.model import EvaluatorSpec, Task
from tests.support.harness import POLAR, port_of
from tests.support.service import served_url, spawn, wait_http


def task(task_id: str = "t", **kw) -> dict:
    t = Task(id=task_id, instruction="x", evaluator=EvaluatorSpec(kind="command", command="true"), **kw)
    return t.model_dump(mode="json")


def request(**kw) -> dict:
    return {"task": task(), "num_samples": 1, "harness": "claude-code", "runtime": "docker", **kw}


def bearer(token: str | None) -> dict[str, str]:
    return {"authorization": f"Bearer {token}"} if token else {}


@pytest.fixture
async def make_server(tmp_path):
    """A real server on 127.0.0.1; options it does not know are left out (so each attack also runs
    against a server that has none of them)."""
    started: list[RolloutServer] = []

    async def make(db: str = "s.sqlite", **kw) -> RolloutServer:
        known = ServerConfig.model_fields
        server = RolloutServer(ServerConfig(db=tmp_path / db, **{k: v for k, v in kw.items() if k in known}))
        await server.start()
        started.append(server)
        return server

    yield make
    for s in started:
        await s.stop()


async def register(h: httpx.AsyncClient, node_id: str, credential: str | None) -> dict:
    r = await h.post("/v1/nodes/register", json={"node_id": node_id}, headers=bearer(credential))
    assert r.status_code == 200, r.text
    return r.json()


def node_enrollment(server: RolloutServer) -> str | None:
    """What a node is given to join: the node credential where there is one, else the token."""
    return getattr(server, "node_token", server.token)


# --- who may drive it -------------------------------------------------------------------------


async def test_without_the_token_no_mutating_endpoint_answers_2xx(make_server):
    server = await make_server()
    async with httpx.AsyncClient(base_url=server.url) as h:
        calls = [
            ("POST", "/v1/tasks", request()),
            ("DELETE", "/v1/tasks/t", None),
            ("POST", "/v1/nodes/register", {"node_id": "rogue"}),
            ("POST", "/v1/nodes/rogue/heartbeat", {}),
            ("POST", "/v1/nodes/rogue/lease", {"capacity": 1}),
            ("POST", "/v1/nodes/rogue/results", {"task_id": "t", "index": 0, "lease": "x", "status": "completed"}),
            ("DELETE", "/v1/nodes/rogue", None),
            ("POST", "/v1/admin/pause", {"timeout_seconds": 0}),
            ("POST", "/v1/admin/resume", {"weight_version": "forged"}),
        ]  # fmt: skip
        for creds in (None, "wrong-token"):
            for method, path, body in calls:
                r = await h.request(method, path, json=body, headers=bearer(creds))
                assert r.status_code == 401, (creds, method, path, r.status_code, r.text)
                assert "token" in r.json()["error"]["message"]
            for path in ("/v1/tasks", "/v1/nodes", "/metrics", "/v1/tasks/t/results"):
                assert (await h.get(path, headers=bearer(creds))).status_code == 401
        assert (await h.get("/health")).status_code == 200  # liveness needs no token
    assert server.store.tasks() == [] and server.store.nodes() == []
    assert server.store.get("weight_version") is None


async def test_a_node_credential_registers_leases_and_reports_but_drives_nothing(make_server):
    server = await make_server(token="operator-s3cret")
    async with httpx.AsyncClient(base_url=server.url) as h:
        op = bearer(server.token)
        assert (await h.post("/v1/tasks", json=request(), headers=op)).status_code == 202
        joined = await register(h, "n1", node_enrollment(server))
        held = [c for c in (node_enrollment(server), joined.get("node_key")) if c]
        key = joined.get("node_key") or node_enrollment(server)
        lease = await h.post("/v1/nodes/n1/lease", json={"capacity": 1}, headers=bearer(key))
        assert lease.status_code == 200 and len(lease.json()["assignments"]) == 1
        assert (await h.post("/v1/nodes/n1/heartbeat", json={}, headers=bearer(key))).status_code == 200
        for cred in held:
            for method, path, body in [
                ("POST", "/v1/tasks", request(task={**task("mine")})),
                ("POST", "/v1/admin/pause", {"timeout_seconds": 0}),
                ("POST", "/v1/admin/resume", {"weight_version": "forged"}),
                ("DELETE", "/v1/tasks/t", None),
                ("DELETE", "/v1/nodes/n1", None),
                ("GET", "/v1/tasks", None),
            ]:
                r = await h.request(method, path, json=body, headers=bearer(cred))
                assert r.status_code == 403, (method, path, r.status_code, r.text)
                assert "node" in r.json()["error"]["message"]
        # The enrollment credential alone cannot act as a registered node.
        if joined.get("node_key"):
            r = await h.post(
                "/v1/nodes/n1/lease", json={"capacity": 1}, headers=bearer(node_enrollment(server))
            )
            assert r.status_code in (401, 403)
    assert [t.id for t in server.store.tasks()] == ["t"] and server.store.get("paused") is None
    assert server.store.task("t").state == "running" and server.store.node("n1").state == "active"


async def test_a_result_under_another_nodes_lease_is_refused(make_server):
    server = await make_server()
    async with httpx.AsyncClient(base_url=server.url) as h:
        assert (await h.post("/v1/tasks", json=request(), headers=bearer(server.token))).status_code == 202
        a = (await register(h, "victim", node_enrollment(server))).get("node_key") or node_enrollment(server)
        b = (await register(h, "thief", node_enrollment(server))).get("node_key") or node_enrollment(server)
        [got] = (await h.post("/v1/nodes/victim/lease", json={"capacity": 1}, headers=bearer(a))).json()[
            "assignments"
        ]
        forged = {"task_id": "t", "index": 0, "lease": got["lease"], "status": "completed", "reward": 1.0}
        # The thief knows the victim's lease (seen on the wire, say): under its own name, and under
        # the victim's, it is refused.
        r = await h.post("/v1/nodes/thief/results", json=forged, headers=bearer(b))
        assert r.status_code in (403, 409), r.text
        r = await h.post("/v1/nodes/victim/results", json=forged, headers=bearer(b))
        assert r.status_code in (401, 403), r.text
        # Nor can it take the victim's name while the victim is alive.
        r = await h.post(
            "/v1/nodes/register", json={"node_id": "victim"}, headers=bearer(node_enrollment(server))
        )
        assert r.status_code == 409 and "victim" in r.json()["error"]["message"], r.text
        s = server.store.sample("t", 0)
        assert s.state == "dispatched" and s.node_id == "victim"
        # The victim itself reports fine.
        r = await h.post("/v1/nodes/victim/results", json={**forged, "reward": 0.0}, headers=bearer(a))
        assert r.status_code == 200
    assert server.store.sample("t", 0).reward == 0.0


# --- off unless the operator turns it on ----------------------------------------------------


async def test_local_runtime_task_paths_and_callbacks_are_off_unless_enabled(make_server, tmp_path):
    root = tmp_path / "tasks"
    (root / "inside").mkdir(parents=True)
    (root / "inside" / "task.json").write_text(json.dumps({"id": "in", "instruction": "x"}))
    outside = tmp_path / "secret"
    outside.mkdir()
    (outside / "task.json").write_text(json.dumps({"id": "out", "instruction": "hunter2-secret"}))
    server = await make_server()
    op = bearer(server.token)
    async with httpx.AsyncClient(base_url=server.url) as h:
        for body, flag in [
            (request(runtime="local", harness_cmd=["sh", "-c", "id > /tmp/pwned", "{instruction}"]), "--allow-local-runtime"),
            ({**request(), "task": None, "task_path": str(outside)}, "--task-root"),
            (request(callback_url="http://127.0.0.1:9/x"), "--callback-allow"),
        ]:  # fmt: skip
            r = await h.post("/v1/tasks", json=body, headers=op)
            assert r.status_code == 403, (flag, r.status_code, r.text)
            assert flag in r.json()["error"]["message"]
    server = await make_server(
        "s2.sqlite", task_root=root, callback_allow=["cb.example"], allow_local_runtime=True
    )
    op = bearer(server.token)
    async with httpx.AsyncClient(base_url=server.url) as h:
        r = await h.post("/v1/tasks", json={**request(), "task": None, "task_path": str(outside)}, headers=op)
        assert r.status_code == 403 and "--task-root" in r.json()["error"]["message"]
        assert "hunter2" not in r.text
        sneaky = root / "inside" / ".." / ".." / "secret"
        r = await h.post("/v1/tasks", json={**request(), "task": None, "task_path": str(sneaky)}, headers=op)
        assert r.status_code == 403 and "hunter2" not in r.text
        (root / "link").symlink_to(outside)
        r = await h.post(
            "/v1/tasks", json={**request(), "task": None, "task_path": str(root / "link")}, headers=op
        )
        assert r.status_code == 403 and "hunter2" not in r.text
        # An inline task's host paths are held to the same root.
        r = await h.post(
            "/v1/tasks", json=request(task=task(dockerfile=str(outside / "Dockerfile"))), headers=op
        )
        assert r.status_code == 403 and "--task-root" in r.json()["error"]["message"]
        # A broken file under the root: the error names the field, never the file's content.
        (root / "bad").mkdir()
        (root / "bad" / "task.json").write_text(json.dumps({"id": "b", "instruction": ["hunter2-secret"]}))
        r = await h.post(
            "/v1/tasks",
            json={**request(), "task": None, "task_path": str(root / "bad" / "task.json")},
            headers=op,
        )
        assert r.status_code == 422 and "instruction" in r.text and "hunter2" not in r.text
        r = await h.post("/v1/tasks", json=request(callback_url="http://127.0.0.1:9/x"), headers=op)
        assert r.status_code == 403 and "--callback-allow" in r.json()["error"]["message"]
        # What the operator allowed works.
        r = await h.post(
            "/v1/tasks",
            json={**request(), "task": None, "task_path": str(root / "inside" / "task.json")},
            headers=op,
        )
        assert r.status_code == 202, r.text
        r = await h.post(
            "/v1/tasks", json=request(task=task("cb"), callback_url="https://cb.example/g"), headers=op
        )
        assert r.status_code == 202, r.text
        r = await h.post("/v1/tasks", json=request(task=task("loc"), runtime="local"), headers=op)
        assert r.status_code == 202, r.text


# --- bounded inputs -------------------------------------------------------------------------


async def test_bodies_over_the_cap_deep_json_huge_numbers_and_bad_ids_are_refused(make_server):
    server = await make_server()
    op = bearer(server.token)
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as h:
        big = json.dumps(request(metadata={"pad": "x" * (5 * 1024 * 1024)})).encode()
        r = await h.post("/v1/tasks", content=big, headers={**op, "content-type": "application/json"})
        assert r.status_code == 413, r.status_code
        deep = b'{"metadata": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
        r = await h.post("/v1/tasks", content=deep, headers={**op, "content-type": "application/json"})
        assert r.status_code == 422 and "nested" in r.json()["error"]["message"], r.text[:300]
        cases = [
            (request(priority=1e30), "priority"),
            (request(timeout_seconds=1e308), "timeout_seconds"),
            (request(agent_timeout_seconds=1e308), "agent_timeout_seconds"),
            (request(num_samples=10**12), "num_samples"),
            (request(task=task(cpus=1e12)), "task.cpus"),
            (request(task=task(memory_mb=10**15)), "task.memory_mb"),
            (request(task=task(agent_timeout_sec=1e308)), "task.agent_timeout_sec"),
            (request(task_id="a/b"), "task_id"),
        ]
        for body, field in cases:
            r = await h.post("/v1/tasks", json=body, headers=op)
            assert r.status_code == 422, (field, r.status_code, r.text[:300])
            assert any(f["field"] == field for f in r.json()["error"]["fields"]), (field, r.text[:300])
        r = await h.post("/v1/nodes/register", json={"node_id": "a/b"}, headers=op)
        assert r.status_code == 422 and r.json()["error"]["fields"][0]["field"] == "node_id", r.text
        joined = await register(h, "n", node_enrollment(server))
        key = bearer(joined.get("node_key") or node_enrollment(server))
        r = await h.post("/v1/nodes/n/lease", json={"capacity": 10**12}, headers=key)
        assert r.status_code == 422 and r.json()["error"]["fields"][0]["field"] == "capacity", r.text
        r = await h.post("/v1/admin/pause", json={"timeout_seconds": 1e308}, headers=op)
        assert r.status_code == 422, r.text
        hb = {"generating": 10**30, "samples": [["t", 0, "run"]]}
        r = await h.post("/v1/nodes/n/heartbeat", json=hb, headers=key)
        assert r.status_code == 422 and r.json()["error"]["fields"][0]["field"] == "generating", r.text


def _streamed_post(port: int, path: str, total: int, headers: dict[str, str], chunked: bool) -> int:
    """POST `total` bytes as fast as loopback takes them; the status line, or 0 when the server
    closed the connection first."""
    with socket.create_connection(("127.0.0.1", port)) as s:
        head = f"POST {path} HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
        head += "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        head += "transfer-encoding: chunked\r\n\r\n" if chunked else f"content-length: {total}\r\n\r\n"
        # One valid JSON body: a TaskRequest whose metadata holds one long string.
        start = json.dumps(request())[:-1].encode() + b', "metadata": {"pad": "'
        end = b'"}}'
        block = b"x" * (1024 * 1024)
        parts = [start] + [block] * ((total - len(start) - len(end)) // len(block)) + [end]
        if not chunked:
            head = head.replace(f"content-length: {total}", f"content-length: {sum(map(len, parts))}")
        s.sendall(head.encode())
        try:
            for part in parts:
                s.sendall(b"%x\r\n%s\r\n" % (len(part), part) if chunked else part)
            if chunked:
                s.sendall(b"0\r\n\r\n")
        except OSError:
            pass
        s.settimeout(30)
        try:
            line = s.recv(4096).split(b"\r\n", 1)[0]
        except OSError:
            return 0
        return int(line.split()[1]) if line.startswith(b"HTTP/") else 0


@pytest.mark.slow
def test_health_keeps_answering_while_a_maximal_body_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    proc = spawn(["serve", "--listen", "127.0.0.1:0", "--nodes", "0", "--db", str(tmp_path / "s.sqlite")],
                 tmp_path / "log.txt")  # fmt: skip
    try:
        url = served_url(tmp_path / "log.txt", proc)
        port = port_of(url)
        token_file = tmp_path / "config" / "polar-mitm" / "service-token"
        headers = bearer(token_file.read_text().strip() if token_file.exists() else None)
        for chunked in (False, True):
            status: list[int] = []
            sender = threading.Thread(
                target=lambda c=chunked, out=status: out.append(
                    _streamed_post(port, "/v1/tasks", 480 << 20, headers, c)
                )
            )
            latencies = []
            with httpx.Client(base_url=url) as h:
                h.get("/health")
                sender.start()
                while sender.is_alive():
                    t0 = time.perf_counter()
                    assert h.get("/health", timeout=30).status_code == 200
                    latencies.append(time.perf_counter() - t0)
                    time.sleep(0.01)
                sender.join()
            # No stall: reading the 480 MB whole and parsing it on the loop stalls it for seconds.
            # The bound is 1 s, not a speed target (a loaded CI machine once took 0.15 s).
            assert len(latencies) >= 2 and max(latencies) < 1.0, (
                chunked,
                max(latencies),
                len(latencies),
                status,
            )
            assert status in ([413], [0]), status  # refused (or cut off) before being read whole
        assert httpx.get(url + "/health").status_code == 200
    finally:
        proc.terminate()
        proc.wait(20)


# --- the token: generated, kept 0600, found by the clients; never on the wire in clear ----------


@pytest.mark.slow
def test_serve_generates_a_0600_token_file_that_the_client_and_submit_find(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.delenv("POLAR_MITM_SERVICE_TOKEN", raising=False)
    log = tmp_path / "log.txt"
    proc = spawn(
        ["serve", "--listen", "127.0.0.1:0", "--nodes", "0", "--db", str(tmp_path / "s.sqlite")], log
    )
    try:
        url = served_url(log, proc)
        path = tmp_path / "config" / "polar-mitm" / "service-token"
        assert path.exists(), log.read_text()
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        token = path.read_text().strip()
        assert len(token) >= 32
        assert str(path) in log.read_text() and token not in log.read_text()
        assert httpx.get(url + "/v1/tasks").status_code == 401
        with RolloutClient(url) as client:  # reads the file by itself
            assert client.http.get("/v1/tasks").status_code == 200
        tasks = tmp_path / "t.json"
        tasks.write_text(
            json.dumps({"id": "s", "instruction": "x", "evaluator": {"kind": "command", "command": "true"}})
        )
        r = subprocess.run([*POLAR, "submit", str(tasks), "--harness", "claude-code", "--server", url],
                           capture_output=True, text=True, timeout=60)  # fmt: skip
        assert r.returncode == 0 and r.stdout.strip() == "s", r.stderr
        # The token given another way than the command line: a file of the operator's own.
        mine = tmp_path / "mine"
        mine.write_text(token + "\n")
        r = subprocess.run([*POLAR, "submit", str(tasks), "--harness", "claude-code", "--server", url,
                            "--token-file", str(mine), "--id-prefix", "f-"], capture_output=True, text=True,
                           timeout=60, env={**os.environ, "XDG_CONFIG_HOME": str(tmp_path / "none")})  # fmt: skip
        assert r.returncode == 0 and r.stdout.strip() == "f-s", r.stderr
    finally:
        proc.terminate()
        proc.wait(20)
    # A restarted serve reuses the file: clients keep working.
    proc = spawn(
        [
            "serve",
            "--listen",
            f"127.0.0.1:{port_of(url)}",
            "--nodes",
            "0",
            "--db",
            str(tmp_path / "s.sqlite"),
        ],
        log,
    )
    try:
        wait_http(url)
        assert path.read_text().strip() == token
        with RolloutClient(url) as client:
            assert client.status("s").task_id == "s"
    finally:
        proc.terminate()
        proc.wait(20)


@pytest.mark.slow
def test_serve_refuses_a_non_loopback_listen_without_insecure_listen(tmp_path, monkeypatch):
    """Only the refusal is exercised: nothing ever binds a non-loopback address here."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    r = subprocess.run([*POLAR, "serve", "--listen", "0.0.0.0:1", "--nodes", "0", "--db", str(tmp_path / "s.sqlite")],
                       capture_output=True, text=True, timeout=60)  # fmt: skip
    assert r.returncode != 0 and "--insecure-listen" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not (tmp_path / "s.sqlite").exists()


async def test_task_env_values_are_sealed_in_the_store_and_reach_the_node(make_server, tmp_path):
    server = await make_server()
    async with httpx.AsyncClient(base_url=server.url) as h:
        body = request(task=task(env={"HF_TOKEN": "hf_hunter2"}))
        body["task"]["evaluator"]["env"] = {"GRADER_KEY": "grader-hunter2"}
        assert (await h.post("/v1/tasks", json=body, headers=bearer(server.token))).status_code == 202
        joined = await register(h, "n", node_enrollment(server))
        key = bearer(joined.get("node_key") or node_enrollment(server))
        [a] = (await h.post("/v1/nodes/n/lease", json={"capacity": 1}, headers=key)).json()["assignments"]
    assert a["task"]["env"] == {"HF_TOKEN": "hf_hunter2"}
    assert a["task"]["evaluator"]["env"] == {"GRADER_KEY": "grader-hunter2"}
    for f in tmp_path.glob("s.sqlite*"):
        data = f.read_bytes()
        assert b"hunter2" not in data, f
        assert server.token is None or server.token.encode() not in data, f
