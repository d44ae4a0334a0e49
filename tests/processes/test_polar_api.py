"""Polar's trainers against `serve --polar-api`: a client written from Polar's published schemas
(`tests/support/polar_schema.py`), unchanged but for its base URL, submits, polls, gets its
callback once, cancels with a tombstone, pauses and resumes through the gateway endpoints `GET
/nodes` names, and lists tasks and sessions; every reply is validated with Polar's models. The
service is the in-process one of tests/processes/conftest.py (nodes over the fake backend, shell
harnesses on the local runtime); the secret prefix and the door's auth with a real `serve`.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from aiohttp import web

from polar_mitm import auth
from polar_mitm.procs import kill_group
from tests.support import polar_schema as polar
from tests.support.helpers import MODEL_CALL, wait_until_async
from tests.support.service import TOKEN, spawn, wait_http

# A Polar `shell` harness: one model call through the proxy, then the instruction written out.
SHELL = {"harness": "shell", "custom_shell": {"command": MODEL_CALL + 'echo "$1" > out.txt'}}
# Polar's runtime, run on the node's host (the fixture's server allows the local runtime).
LOCAL = {"image": "unused", "kwargs": {"polar_mitm_runtime": "local"}}


def polar_task(task_id: str, **kw) -> dict:
    req = polar.TaskRequest.model_validate(
        {
            "task_id": task_id,
            "instruction": "pass",
            "agent": SHELL,
            "runtime": LOCAL,
            "evaluator": {"strategy": "session_completed"},
            **kw,
        }
    )
    return req.payload()


async def poll(h: httpx.AsyncClient, task_id: str, until: set[str], timeout: float = 90) -> polar.TaskStatus:
    """ClawBench's loop: GET /rollout/task/{id} until the status is one of `until`."""
    deadline = time.monotonic() + timeout
    while True:
        r = await h.get(f"/rollout/task/{task_id}")
        assert r.status_code == 200, r.text
        status = polar.TaskStatus.model_validate(r.json())
        if status.status in until or time.monotonic() > deadline:
            return status
        await asyncio.sleep(0.2)


@pytest.mark.slow
async def test_a_polar_client_runs_a_group_gets_its_callback_once_and_reads_the_listings(service):
    svc = await service(nodes=1, polar_api=True)
    posts: list[dict] = []

    async def listener(request: web.Request) -> web.Response:
        posts.append(await request.json())
        return web.Response(status=400)  # a 4xx: Polar's callback is never posted again

    app = web.Application()
    app.router.add_post("/cb", listener)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    cb = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}/cb"  # type: ignore[union-attr]
    try:
        async with httpx.AsyncClient(base_url=svc.server.polar_url, timeout=30) as h:
            meta = {"group_id": 3, "policy_version": 1, "rollout_step": 9}
            r = await h.post(
                "/rollout/task/submit",
                json=polar_task(
                    "g1",
                    num_samples=2,
                    callback_url=cb,
                    builder={"strategy": "prefix_merging"},
                    metadata=meta,
                ),
            )
            assert r.status_code == 200 and r.json() == {"task_id": "g1", "status": "running"}
            status = await poll(h, "g1", {"completed"})
            await wait_until_async(lambda: posts, timeout=20, message="the callback")
            await asyncio.sleep(1.0)  # room for a second post that must not come
            assert len(posts) == 1
            result = polar.TaskResult.model_validate(posts[0])
            assert (result.task_id, result.status, len(result.results)) == ("g1", "completed", 2)

            assert (status.total_sessions, status.completed_sessions) == (2, 2)
            assert len(status.results) == 2
            for s in status.results:
                assert s.status == "COMPLETED" and s.trajectory.status == "COMPLETED" and s.node_id == "n0"
                traces = s.trajectory.traces
                assert traces and traces[-1].reward == 1.0
                for t in traces:  # trainable: ids, mask and logprobs of equal length, tokens trained
                    assert t.response_logprobs is not None
                    assert len(t.response_ids) == len(t.loss_mask) == len(t.response_logprobs) > 0
                    assert sum(t.loss_mask) > 0 and t.prompt_ids
                assert {k: s.metadata[k] for k in meta} == meta  # the task's metadata echoed
                assert s.timing.e2e_ms > 0 and s.timing.run_ms > 0
            # ClawBench reads the same results under `sessions`.
            assert (await h.get("/rollout/task/g1")).json()["sessions"][0]["trajectory"]["traces"]

            tasks = (await h.get("/tasks", params={"status": "completed"})).json()["tasks"]
            assert [(t["task_id"], t["completed_sessions"], t["mean_reward"]) for t in tasks] == [
                ("g1", 2, 1.0)
            ]
            sessions = (await h.get("/tasks/g1/sessions")).json()
            assert sessions["task_id"] == "g1" and len(sessions["sessions"]) == 2
            for s in sessions["sessions"]:
                assert s["status"] == "COMPLETED" and s["reward"] == 1.0
                polar.SessionTiming.model_validate(s["timing"])
            rollout = (await h.get("/rollout/status")).json()
            assert rollout["tasks"] == {"g1": "completed"}
            assert (await h.get("/health")).json() == {"status": "ok", "nodes": 1}
            assert (await h.get("/rollout/task/nope")).status_code == 404
    finally:
        await runner.cleanup()


@pytest.mark.slow
async def test_cancel_leaves_a_tombstone_and_pause_resume_go_through_the_gateways(service, tmp_path):
    svc = await service(nodes=2, polar_api=True)
    async with httpx.AsyncClient(base_url=svc.server.polar_url, timeout=60) as h:
        # The slime bridge's weight sync: discover the gateways, pause each (drained: inflight 0), resume.
        nodes = [polar.GatewayNodeInfo.model_validate(n) for n in (await h.get("/nodes")).json()]
        urls = [n.gateway_url for n in nodes]
        assert sorted(n.node_id for n in nodes) == ["n0", "n1"] and len(set(urls)) == 2
        assert all(
            u.startswith(svc.server.polar_url + "/gateway/") and n.healthy
            for u, n in zip(urls, nodes, strict=True)
        )
        async with httpx.AsyncClient(timeout=60) as g:
            paused = await asyncio.gather(
                *(g.post(f"{u}/admin/inference/pause", params={"timeout_seconds": 30}) for u in urls)
            )
            for r in paused:
                assert r.status_code == 200 and r.json()["paused"] is True and r.json()["inflight"] == 0
            await wait_until_async(
                lambda: all(not n.proxy.policy.gate.is_set() for n in svc.nodes),
                timeout=10,
                message="gates closed",
            )
            assert (await g.get(f"{urls[0]}/admin/inference/status")).json()["paused"] is True
            # A task submitted while paused waits at the gate, and runs once resumed. It is
            # ClawBench's shape: its files uploaded from under --task-root, then a setup step.
            (tmp_path / "staged").mkdir()
            (tmp_path / "staged" / "a.txt").write_text("a")
            (tmp_path / "run.sh").write_text("true")
            prepare = [
                {"type": "upload_dir", "source": str(tmp_path / "staged"), "target": "data"},
                {"type": "upload_file", "source": str(tmp_path / "run.sh"), "target": "data/run.sh"},
                {"type": "exec", "command": "touch made", "cwd": "data"},
            ]
            check = "test -f data/a.txt && test -f data/run.sh && test -f data/made && "
            agent = {
                "harness": "shell",
                "custom_shell": {"command": MODEL_CALL + check + 'echo "$1" > out.txt'},
            }
            runtime = {**LOCAL, "prepare": prepare}
            r = await h.post(
                "/rollout/task/submit", json=polar_task("during-pause", agent=agent, runtime=runtime)
            )
            assert r.status_code == 200, r.text
            resumed = await asyncio.gather(*(g.post(f"{u}/admin/inference/resume") for u in urls))
            assert all(r.json()["paused"] is False for r in resumed)
        assert (await poll(h, "during-pause", {"completed"})).results[0].trajectory.traces[-1].reward == 1.0

        # A waiter cancelled before its submit was acknowledged: the late submit is refused.
        r = await h.delete("/rollout/task/late", params={"register_if_missing": "true"})
        assert polar.TaskStatus.model_validate(r.json()).status == "cancelled"
        assert (await h.post("/rollout/task/submit", json=polar_task("late"))).status_code == 409
        assert (await h.delete("/rollout/task/never")).status_code == 404  # without register_if_missing

        # A running task cancelled: its samples stop, its status says so.
        slow = {"harness": "shell", "custom_shell": {"command": "sleep 60"}}
        await h.post("/rollout/task/submit", json=polar_task("slow", num_samples=2, agent=slow))

        async def running() -> bool:  # on either node (one of them is a process of its own)
            sessions = (await h.get("/tasks/slow/sessions")).json()["sessions"]
            return any(x["status"] == "RUNNING" for x in sessions)

        deadline = time.monotonic() + 60
        while not await running():
            assert time.monotonic() < deadline, "no sample of 'slow' running"
            await asyncio.sleep(0.2)
        cancelled = polar.TaskStatus.model_validate((await h.delete("/rollout/task/slow")).json())
        assert cancelled.status == "cancelled"
        assert (await poll(h, "slow", {"cancelled"})).status == "cancelled"


async def test_refusals_name_polars_field(service):
    svc = await service(nodes=0, polar_api=True, callback_allow=[])
    async with httpx.AsyncClient(base_url=svc.server.polar_url) as h:
        r = await h.post("/rollout/task/submit", json=polar_task("x", agent={"import_path": "a.B"}))
        assert r.status_code == 422 and r.json()["error"]["fields"][0]["field"] == "agent.import_path"
        r = await h.post("/rollout/task/submit", json=polar_task("x", callback_url="http://127.0.0.1:9/cb"))
        assert r.status_code == 403 and "--callback-allow" in r.text
        r = await h.post("/rollout/task/submit", json={**polar_task("x"), "unknown": 1})
        assert r.status_code == 422 and r.json()["error"]["fields"][0]["field"] == "unknown"
        assert (
            await h.post("/rollout/task/submit", json=polar_task("x", runtime={"image": "i"}))
        ).status_code == 200
        # Polar's ids are unique while a task lives; ours for good.
        assert (
            await h.post("/rollout/task/submit", json=polar_task("x", runtime={"image": "i"}))
        ).status_code == 409


def test_serve_prints_the_capability_and_the_routes_need_it_or_the_token(tmp_path, monkeypatch):
    """A real `serve --polar-api`: the base URL it prints answers Polar's routes; without the
    secret segment they need the control token (bearer, or Polar's header), a wrong segment
    answers nothing, and /v1 still takes only the bearer."""
    monkeypatch.setenv("POLAR_MITM_SERVICE_TOKEN", TOKEN)
    log = tmp_path / "serve.log"
    proc = spawn(
        [
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--nodes",
            "0",
            "--polar-api",
            "--db",
            str(tmp_path / "s.sqlite"),
        ],
        log,
    )
    try:
        deadline = time.monotonic() + 60
        while "polar API on " not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.1)
        base = log.read_text().split("polar API on ", 1)[1].split()[0]
        root = base.rsplit("/", 1)[0]
        wait_http(root)
        assert base == root + "/" + auth.polar_prefix(TOKEN)
        assert httpx.get(base + "/health").json() == {"status": "ok", "nodes": 0}
        assert httpx.get(base + "/nodes").json() == []
        for path in ("/nodes", "/tasks", "/rollout/status", "/rollout/task/x"):
            assert httpx.get(root + path).status_code == 401
            assert httpx.get(root + "/polar-" + "0" * 40 + path).status_code in (401, 404)
            assert httpx.get(root + path, headers={"x-polar-control-token": "wrong"}).status_code == 401
        assert httpx.post(root + "/admin/inference/pause").status_code == 401
        assert httpx.get(root + "/tasks", headers={"x-polar-control-token": TOKEN}).json() == {"tasks": []}
        assert httpx.get(root + "/nodes", headers={"authorization": f"Bearer {TOKEN}"}).status_code == 200
        # Polar's header opens Polar's door only: /v1 is as it was.
        assert httpx.get(root + "/v1/tasks", headers={"x-polar-control-token": TOKEN}).status_code == 401
    finally:
        kill_group(proc.pid)


async def test_uploads_need_a_task_root_on_v1_too(service, tmp_path):
    svc = await service(nodes=0, task_root=None)
    body = {
        "task": {"id": "u", "instruction": "x", "uploads": [{"source": str(tmp_path), "target": "/app"}]},
        "harness": "claude-code",
    }
    async with httpx.AsyncClient(base_url=svc.url, headers={"authorization": f"Bearer {TOKEN}"}) as h:
        r = await h.post("/v1/tasks", json=body)
    assert r.status_code == 403 and r.json()["error"]["fields"][0]["field"] == "task.uploads"
