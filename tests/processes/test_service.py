"""The rollout service on one machine: the server and its nodes in-process (or as real
processes where a test kills them), the local runtime, and shell "harnesses" that make real model
calls through each node's proxy to the fake SGLang backend. Real harness binaries in Docker are in
tests/e2e/test_service_docker.py.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from polar_mitm.client import AsyncRolloutClient, RolloutClient, RolloutError
from polar_mitm.policy import PolicyConfig
from polar_mitm.procs import kill_group
from polar_mitm.service.config import ServerConfig
from polar_mitm.service.server import RolloutServer
from polar_mitm.store.reader import read_turns
from polar_mitm.tasks.model import EvaluatorSpec, Task
from tests.support.harness import POLAR, FakeBackend, port_of
from tests.support.helpers import MODEL_CALL, process_gone, wait_until, wait_until_async
from tests.support.service import TOKEN, harness, node_args, served_url, spawn, wait_http

ANSWER = "grep -q pass out.txt"
AUTH = {"authorization": f"Bearer {TOKEN}"}


@pytest.fixture(autouse=True)
def control_token(monkeypatch, tmp_path):
    monkeypatch.setenv("POLAR_MITM_SERVICE_TOKEN", TOKEN)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    return TOKEN


def task(task_id: str, word: str, **kw) -> Task:
    return Task(id=task_id, instruction=word, evaluator=EvaluatorSpec(kind="command", command=ANSWER), **kw)


@pytest.mark.slow
async def test_groups_come_back_scored_through_the_client_with_exact_tokens(service, tmp_path):
    svc = await service(nodes=2)
    async with AsyncRolloutClient(svc.url) as client:
        tasks = [task("right", "pass"), task("wrong", "fail"), task("also-right", "pass")]
        groups = [
            g
            async for g in client.rollout(
                tasks, samples=4, harness="claude-code", runtime="local", harness_cmd=harness(), poll=0.2
            )
        ]
    assert sorted(g.task_id for g in groups) == ["also-right", "right", "wrong"]
    for g in groups:
        assert g.state == "done" and [s.index for s in g.samples] == [0, 1, 2, 3]
        expected = 0.0 if g.task_id == "wrong" else 1.0
        assert {s.reward for s in g.samples} == {expected}
        assert {s.status for s in g.samples} == {"completed"} and not any(s.remove_sample for s in g.samples)
        assert {s.advantage for s in g.samples} == {0.0}
        assert [o.status for o in g.outcomes] == ["completed"] * 4
    # The samples were spread over both nodes, and every row is token-exact: its tokens and
    # logprobs are the turns its node's proxy recorded from the backend.
    nodes_used = {o.node_id for g in groups for o in g.outcomes}
    assert nodes_used == {"n0", "n1"}
    turns = {t.session_id: t for i in range(2) for t in read_turns(tmp_path / f"node{i}.sqlite")}
    for g in groups:
        for s in g.samples:
            t = turns[s.session_id]
            assert s.tokens == t.prompt_ids + t.output_ids
            assert s.response_length == len(t.output_ids) and s.loss_mask == [1] * len(t.output_ids)
            assert s.rollout_logprobs == pytest.approx(t.output_logprobs, abs=0)  # float32 both: bit-exact
            assert s.weight_versions == ["0"]


@pytest.mark.slow
async def test_results_as_parquet_and_the_api_documents_itself(service):
    svc = await service(nodes=1)

    def sync_client() -> tuple:  # the synchronous client, in a thread (the server shares our loop)
        with RolloutClient(svc.url) as client:
            tid = client.submit(
                task("t", "pass"), samples=2, harness="claude-code", runtime="local", harness_cmd=harness()
            )
            [g] = list(client.wait([tid], poll=0.2))
            return g, pq.read_table(pa.BufferReader(client.parquet(tid)))

    g, table = await asyncio.to_thread(sync_client)
    assert [s.reward for s in g.samples] == [1.0, 1.0]
    async with httpx.AsyncClient(base_url=svc.url, headers=AUTH) as h:
        spec = (await h.get("/openapi.json")).json()
        metrics = (await h.get("/metrics")).text
        health = (await h.get("/health")).json()
    assert {
        "/v1/tasks",
        "/v1/tasks/{task_id}/results",
        "/v1/admin/pause",
        "/v1/nodes/{node_id}/lease",
    } <= set(spec["paths"])
    assert "TaskRequest" in spec["components"]["schemas"]
    assert 'polar_samples{state="finished",status="completed"} 2.0' in metrics
    assert "polar_node_stage_in_flight" in metrics and "polar_sample_stage_seconds_bucket" in metrics
    assert health == {"ok": True, "nodes": 1}


async def test_bad_requests_get_the_field_named_and_tokens_are_checked(service):
    svc = await service(nodes=0, token="s3cret")
    good = {
        "task": task("t", "x").model_dump(mode="json"),
        "num_samples": 2,
        "harness": "claude-code",
        "runtime": "local",
    }
    async with httpx.AsyncClient(base_url=svc.url) as h:
        r = await h.post("/v1/tasks", json=good)
        assert r.status_code == 401 and "Bearer" in r.json()["error"]["message"]
        r = await h.post("/v1/tasks", json=good, headers={"authorization": "Bearer wrong"})
        assert r.status_code == 401
        assert (await h.get("/health")).status_code == 200  # liveness needs no token
        auth = {"authorization": "Bearer s3cret"}
        cases = [
            ({**good, "harness": "vim"}, "harness", "unknown harness 'vim'"),
            ({**good, "harness": ""}, "harness", "at least 1 character"),
            ({**good, "runtime": "kubernetes"}, "runtime", "unknown runtime 'kubernetes'"),
            ({**good, "num_samples": 0}, "num_samples", "greater than or equal to 1"),
            ({**good, "evaluator": {"kind": "vibes"}}, "evaluator.kind", "Input should be"),
            ({**good, "task": {"id": "t"}}, "task.instruction", "Field required"),
            ({**good, "surprise": 1}, "surprise", "Extra inputs"),
            ({**good, "task_id": "a/b"}, "task_id", "appear in URLs"),
        ]
        for body, field, words in cases:
            r = await h.post("/v1/tasks", json=body, headers=auth)
            assert r.status_code == 422, body
            err = r.json()["error"]
            assert any(f["field"] == field and words in f["message"] for f in err["fields"]), err
        r = await h.post(
            "/v1/tasks", content=b"{not json", headers={**auth, "content-type": "application/json"}
        )
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_json"
        assert (await h.post("/v1/tasks", json=good, headers=auth)).status_code == 202
        r = await h.post("/v1/tasks", json=good, headers=auth)
        assert r.status_code == 409 and "exists" in r.json()["error"]["message"]
        assert (await h.get("/v1/tasks/nope", headers=auth)).status_code == 404
    with pytest.raises(RolloutError, match="401"):
        await AsyncRolloutClient(svc.url).status("t")
    assert (await AsyncRolloutClient(svc.url, token="s3cret").status("t")).num_samples == 2


# A trainer's client with no recipes at all: `polar_mitm.recipes` cannot even be imported there.
CLIENT_WITHOUT_RECIPES = """
import sys
sys.modules["polar_mitm.recipes"] = None
from polar_mitm.client import RolloutClient, RolloutError
from polar_mitm.tasks.model import EvaluatorSpec, Task

client = RolloutClient(sys.argv[1])
for tid, harness in (("known", "claude-code"), ("unknown", "a-harness-of-the-future")):
    task = Task(id=tid, instruction="x", evaluator=EvaluatorSpec(kind="command", command="true"))
    try:
        print("submitted", client.submit(task, harness=harness, runtime="local"))
    except RolloutError as e:
        print("refused", e.status, e)
"""


@pytest.mark.slow
async def test_the_server_decides_which_harnesses_it_knows_not_the_trainers_client(service):
    """The client sends any harness name; the server takes one its recipes know and refuses
    another with a 422 that names the known ones (a client of another version, or with no
    recipes, never refuses a harness the server runs)."""
    svc = await service(nodes=0)
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        CLIENT_WITHOUT_RECIPES,
        svc.url,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err.decode()
    known, unknown = out.decode().splitlines()
    assert known == "submitted known"
    assert unknown.startswith("refused 422 ") and "unknown harness 'a-harness-of-the-future'" in unknown
    assert "known: " in unknown and "claude-code" in unknown.split("known: ", 1)[1]
    async with httpx.AsyncClient(base_url=svc.url, headers=AUTH) as h:
        assert (await h.get("/v1/tasks/known")).status_code == 200
        assert (await h.get("/v1/tasks/unknown")).status_code == 404


@pytest.mark.slow
async def test_cancelling_a_task_stops_its_samples_everywhere(service):
    svc = await service(nodes=1)
    async with AsyncRolloutClient(svc.url) as client:
        tid = await client.submit(
            task("slow", "x"),
            samples=3,
            harness="claude-code",
            runtime="local",
            harness_cmd=["sh", "-c", "sleep 60", "h", "{instruction}"],
        )

        async def running() -> bool:
            return any(s.stage == "running" for s in (await client.status(tid)).samples)

        await wait_until_async(running, timeout=20, message="a sample running")
        view = await client.cancel(tid)
        assert view.state == "cancelled"

        async def all_finished() -> bool:
            return all(s.state == "finished" for s in (await client.status(tid)).samples)

        await wait_until_async(all_finished, timeout=20, message="every sample finished")
        view = await client.status(tid)
    assert [s.status for s in view.samples] == ["cancelled"] * 3
    assert svc.nodes[0].jobs == {}  # the node let go of every one
    pipeline = svc.nodes[0].pipeline
    assert pipeline.counts["running"] == 0 and pipeline.counts["done"] == 3


@pytest.mark.slow
async def test_early_stop_cancels_the_rest_of_a_group(service):
    svc = await service(nodes=1)
    async with AsyncRolloutClient(svc.url) as client:
        cmd = [
            "sh",
            "-c",
            'mkdir "$HOME/../../../first" 2>/dev/null || sleep 60; echo pass > out.txt',
            "h",
            "{instruction}",
        ]
        tid = await client.submit(
            task("t", "x"),
            samples=4,
            harness="claude-code",
            runtime="local",
            harness_cmd=cmd,
            early_stop_min_usable=1,
        )
        [g] = [x async for x in client.wait([tid], poll=0.2)]
    statuses = sorted(o.status for o in g.outcomes)
    assert statuses == ["cancelled", "cancelled", "cancelled", "completed"]
    assert {o.cause for o in g.outcomes if o.status == "cancelled"} == {"early stop: 1 usable samples in"}


@pytest.mark.slow
async def test_a_node_serving_two_harnesses_runs_no_more_at_once_than_its_run_workers(
    service, tmp_path, qwen_tokenizer_dir, certs_dir
):
    """--run-workers bounds the node, not each harness: two harnesses' samples, all leased at
    once, still run one at a time on a node with one run worker."""
    svc = await service(nodes=0)
    await svc.add_node(tmp_path, qwen_tokenizer_dir, certs_dir, 0, run_workers=1, init_workers=3, capacity=6)
    runs = tmp_path / "runs.txt"  # each run appends "NAME start" and "NAME end"

    def timed(name: str) -> list[str]:
        line = f'echo "{name} start" >> {runs}; sleep 0.5; echo "{name} end" >> {runs}; echo "$1" > out.txt'
        return ["sh", "-c", line, "harness", "{instruction}"]

    async with AsyncRolloutClient(svc.url) as client:
        ids = [
            await client.submit(
                task(f"t-{h}", "pass"), samples=3, harness=h, runtime="local", harness_cmd=timed(h)
            )
            for h in ("claude-code", "codex")
        ]
        groups = [g async for g in client.wait(ids, poll=0.2, timeout=60)]
    assert sorted(o.status for g in groups for o in g.outcomes) == ["completed"] * 6
    lines = runs.read_text().split()
    events = list(zip(lines[::2], lines[1::2], strict=True))
    assert sorted(name for name, what in events if what == "start") == ["claude-code"] * 3 + ["codex"] * 3
    at_once, most = 0, 0
    for _, what in events:
        at_once += 1 if what == "start" else -1
        most = max(most, at_once)
    assert most == 1, events


@pytest.mark.slow
async def test_callback_delivers_each_group_with_retries(service):
    from aiohttp import web

    got: list[dict] = []
    fails = {"left": 2}

    async def receive(request):
        if fails["left"]:
            fails["left"] -= 1
            return web.Response(status=503)
        got.append(await request.json())
        return web.Response(status=204)

    app = web.Application()
    app.router.add_post("/groups", receive)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        svc = await service(nodes=1, callback_backoff=0.1)
        async with AsyncRolloutClient(svc.url) as client:
            tid = await client.submit(
                task("cb", "pass"), samples=2, harness="claude-code", runtime="local", harness_cmd=harness(),
                callback_url=f"http://127.0.0.1:{port}/groups",
            )  # fmt: skip
            await wait_until_async(lambda: got, timeout=30, message="the delivered group")
            view = await client.status(tid)
    finally:
        await runner.cleanup()
    assert len(got) == 1 and got[0]["task"]["task_id"] == "cb" and len(got[0]["rows"]) == 2
    assert {r["reward"] for r in got[0]["rows"]} == {1.0}
    assert view.callback == "delivered"


@pytest.mark.slow
async def test_pause_drains_generations_and_resume_brings_the_new_weight_version(service, tmp_path):
    """Each sample makes two model calls. Pause while the first is generating (slowly): the pause
    returns once it finished; the second call waits at the gate (its stream kept alive) until
    resume; the engine's new version shows on the second turn."""
    svc = await service(nodes=1, backend={"token_delay": 0.05})
    two_calls = [
        "sh",
        "-c",
        MODEL_CALL + MODEL_CALL.replace("say hi", "say bye") + 'echo "$1" > out.txt',
        "h",
        "{instruction}",
    ]
    async with AsyncRolloutClient(svc.url) as client, httpx.AsyncClient(headers=AUTH) as h:
        tid = await client.submit(
            task("p", "pass"), samples=1, harness="claude-code", runtime="local", harness_cmd=two_calls
        )
        node = svc.nodes[0]
        await wait_until_async(lambda: node.proxy.policy.generating, timeout=20, message="the first call")
        assert node.proxy.policy.generating == 1
        reply = await h.post(f"{svc.url}/v1/admin/pause", json={"timeout_seconds": 30})
        assert reply.json()["drained"] is True and node.proxy.policy.generating == 0
        await wait_until_async(
            lambda: node.proxy.policy.at_gate == 1, timeout=20, message="the second call waiting at the gate"
        )
        assert node.proxy.policy.generating == 0 and (await client.status(tid)).state == "running"
        await h.post(f"{svc.backend_url}/update_weight_version", json={"new_version": "7"})
        await h.post(f"{svc.url}/v1/admin/resume", json={"weight_version": "7"})
        [g] = [x async for x in client.wait([tid], poll=0.2)]
    assert g.outcomes[0].status == "completed" and g.outcomes[0].reward == 1.0
    versions = [t.weight_version for t in read_turns(tmp_path / "node0.sqlite")]
    assert versions == ["0", "7"]
    # Two calls with different prompts: two rows, each with the version that sampled it.
    assert sorted(s.weight_versions for s in g.samples) == [["0"], ["7"]]


@pytest.mark.slow
async def test_max_staleness_masks_samples_that_span_too_many_versions(service):
    svc = await service(nodes=1, backend={"token_delay": 0.02})
    two_calls = [
        "sh",
        "-c",
        MODEL_CALL + MODEL_CALL.replace("say hi", "say bye") + 'echo "$1" > out.txt',
        "h",
        "{instruction}",
    ]
    async with AsyncRolloutClient(svc.url) as client, httpx.AsyncClient(headers=AUTH) as h:
        tid = await client.submit(
            task("s", "pass"), samples=1, harness="claude-code", runtime="local", harness_cmd=two_calls,
            max_staleness=0, stale_action="mask",
        )  # fmt: skip
        node = svc.nodes[0]
        await wait_until_async(lambda: node.proxy.policy.generating, timeout=20, message="the first call")
        await h.post(f"{svc.url}/v1/admin/pause", json={"timeout_seconds": 30})
        await h.post(f"{svc.backend_url}/update_weight_version", json={"new_version": "8"})
        await h.post(f"{svc.url}/v1/admin/resume", json={"weight_version": "8"})
        [g] = [x async for x in client.wait([tid], poll=0.2)]
    assert g.samples and all(s.remove_sample and sum(s.loss_mask) == 0 for s in g.samples)
    assert all(s.metadata["stale"] == ["0", "8"] for s in g.samples)


# --- real processes: a node and a server that die -------------------------------------------------


@pytest.fixture
def backend_proc(qwen_tokenizer_dir):
    b = FakeBackend(qwen_tokenizer_dir)
    yield b
    b.stop()


@pytest.mark.slow
def test_a_node_killed_mid_sample_has_its_samples_run_again_once(tmp_path, backend_proc, qwen_tokenizer_dir):
    log = tmp_path / "log.txt"
    server = spawn(
        [
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--nodes",
            "0",
            "--node-timeout",
            "6",  # a loaded 2-core machine can hold a live node's heartbeat past 2 s
            "--allow-local-runtime",
            "--db",
            str(tmp_path / "s.sqlite"),
        ],
        log,
    )
    procs = [server]
    try:
        url = served_url(log, server)
        doomed = spawn(node_args(url, backend_proc, qwen_tokenizer_dir, tmp_path / "a.sqlite", "doomed"), log)
        procs.append(doomed)
        client = RolloutClient(url)
        # Sample 0's first attempt sleeps (so it is mid-run when its node dies); every run calls the model.
        cmd = [
            "sh",
            "-c",
            MODEL_CALL + '[ -e "$0" ] || { touch "$0"; sleep 60; }; echo pass > out.txt',
            str(tmp_path / "once"),
            "{instruction}",
        ]
        tid = client.submit(
            task("k", "x"), samples=2, harness="claude-code", runtime="local", harness_cmd=cmd
        )
        wait_until((tmp_path / "once").exists, timeout=30, message="sample 0's first attempt")
        assert (tmp_path / "once").exists()
        os.killpg(doomed.pid, signal.SIGKILL)
        procs.append(
            spawn(node_args(url, backend_proc, qwen_tokenizer_dir, tmp_path / "b.sqlite", "rescuer"), log)
        )
        [g] = list(client.wait([tid], poll=0.2, timeout=90))
    finally:
        for p in procs:
            kill_group(p.pid)
    assert [o.status for o in g.outcomes] == ["completed", "completed"]
    assert {o.node_id for o in g.outcomes} <= {"doomed", "rescuer"}
    assert max(o.dispatches for o in g.outcomes) == 2  # re-dispatched once
    assert sorted(s.index for s in g.samples) == [0, 1]  # one row per sample, no duplicate


@pytest.mark.slow
def test_a_killed_server_restarts_where_it_was(tmp_path, backend_proc, qwen_tokenizer_dir):
    """Down longer than the node timeout and than a report's old retry window (8 s): the node
    keeps its finished samples' reports until the server is back, and the restarted server gives
    its nodes the node timeout from its own start; no sample runs twice."""
    log = tmp_path / "log.txt"
    serve = ["serve", "--listen", "127.0.0.1:0", "--nodes", "0", "--allow-local-runtime",
             "--node-timeout", "6", "--db", str(tmp_path / "s.sqlite")]  # fmt: skip
    server = spawn(serve, log)
    procs = [server]
    try:
        url = served_url(log, server)
        serve[2] = f"127.0.0.1:{port_of(url)}"  # the restart takes the address the nodes know
        procs.append(
            spawn(node_args(url, backend_proc, qwen_tokenizer_dir, tmp_path / "n.sqlite", "steady"), log)
        )
        client = RolloutClient(url)
        cmd = ["sh", "-c", MODEL_CALL + "sleep 2; echo pass > out.txt", "h", "{instruction}"]
        ids = [
            client.submit(
                task(f"t{i}", "x"), samples=3, harness="claude-code", runtime="local", harness_cmd=cmd
            )
            for i in range(2)
        ]
        wait_until(
            lambda: any(s.state == "finished" for s in client.status(ids[0]).samples),
            timeout=30,
            message="a finished sample",
        )
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()
        time.sleep(10)  # the node's reports and heartbeats fail meanwhile, and are retried
        procs.append(spawn(serve, log))
        wait_http(url)
        groups = list(client.wait(ids, poll=0.3, timeout=120))
    finally:
        for p in procs:
            kill_group(p.pid)
    assert sorted(g.task_id for g in groups) == ["t0", "t1"]
    for g in groups:
        assert [o.status for o in g.outcomes] == ["completed"] * 3, log.read_text()[-3000:]
        assert sorted(s.index for s in g.samples) == [0, 1, 2]  # nothing lost, nothing twice
    con = sqlite3.connect(tmp_path / "s.sqlite")
    assert con.execute("SELECT COUNT(*), SUM(dispatches) FROM service_samples").fetchone() == (6, 6)


@pytest.mark.slow
def test_ray_places_nodes_as_actors_and_completes_a_task(
    tmp_path, backend_proc, qwen_tokenizer_dir, certs_dir
):
    ray = pytest.importorskip("ray")
    from polar_mitm.service.ray_nodes import start_ray_nodes, stop_ray_nodes

    async def main():
        server = RolloutServer(ServerConfig(db=tmp_path / "s.sqlite", allow_local_runtime=True))
        await server.start()
        ray.init(num_cpus=2, include_dashboard=False, ignore_reinit_error=True, log_to_driver=False)
        actors = []
        try:
            cfg = dict(
                server=server.url, node_token=server.node_token, db=str(tmp_path / "ray.sqlite"), certs_dir=str(certs_dir),
                policy=PolicyConfig(backend_url=backend_proc.url, tokenizer=str(qwen_tokenizer_dir)).model_dump(),
                poll_interval=0.2, heartbeat_interval=0.5, work_dir=None,
            )  # fmt: skip
            actors = start_ray_nodes(None, 2, cfg)
            await wait_until_async(
                lambda: len(server.healthy_nodes()) >= 2, timeout=90, interval=0.2, message="two Ray nodes"
            )
            assert sorted(server.healthy_nodes()) == ["ray-0", "ray-1"]
            async with AsyncRolloutClient(server.url, token=server.token) as client:
                tid = await client.submit(
                    task("r", "pass"),
                    samples=4,
                    harness="claude-code",
                    runtime="local",
                    harness_cmd=harness(),
                )
                [g] = [x async for x in client.wait([tid], poll=0.2)]
            return g
        finally:
            stop_ray_nodes(actors)
            ray.shutdown()
            await server.stop()

    g = asyncio.run(main())
    assert [o.status for o in g.outcomes] == ["completed"] * 4 and {s.reward for s in g.samples} == {1.0}
    assert {o.node_id for o in g.outcomes} <= {"ray-0", "ray-1"}


def children(pid: int) -> list[int]:
    return [int(c) for t in Path(f"/proc/{pid}/task").iterdir() for c in (t / "children").read_text().split()]


@pytest.mark.slow
def test_submit_command_waits_and_writes_parquet(tmp_path, backend_proc, qwen_tokenizer_dir):
    log = tmp_path / "log.txt"
    db = tmp_path / "s.sqlite"
    proc = spawn(
        [
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--db",
            str(db),
            "--allow-local-runtime",
            "--backend",
            backend_proc.url,
            "--tokenizer",
            str(qwen_tokenizer_dir),
        ],
        log,
    )
    try:
        url = served_url(log, proc)
        tasks = tmp_path / "t.toml"
        tasks.write_text(
            '[[tasks]]\nid = "a"\ninstruction = "pass"\nevaluator = {kind = "command", command = "grep -q pass out.txt"}\n'
        )
        out = tmp_path / "g.parquet"
        cmd = "sh -c '" + MODEL_CALL.replace("'", "'\"'\"'") + 'echo "$1" > out.txt\' h {instruction}'
        r = subprocess.run(
            [*POLAR, "submit", str(tasks), "--harness", "claude-code", "--runtime", "local", "--harness-cmd", cmd,
             "--samples", "2", "--server", url, "--wait", "--out", str(out)],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        nodes = children(proc.pid)
        assert len(nodes) == 1  # the local node's process
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
    # A node whose `serve` was killed stops by itself: nothing is left running.
    wait_until(
        lambda: process_gone(nodes[0]), timeout=20, message="the node to stop once its server is killed"
    )
    assert process_gone(nodes[0]), "the node outlived its server"
    assert r.returncode == 0, r.stderr + log.read_text()[-2000:]
    assert r.stdout.strip() == "a"
    assert "[1/1] a: done · 2/2 usable · mean reward 1.00" in r.stderr
    assert pq.read_table(out).column("reward").to_pylist() == [1.0, 1.0]
    assert Path(str(db).replace(".sqlite", ".node0.sqlite")).exists()  # the node's own store


def test_json_rows_survive_the_trip_bit_for_bit():
    import numpy as np

    from polar_mitm.reconstruct.trajectory import Trajectory

    lp = np.array([-0.1, -1e-8, -3.4028235e38, -7.0], dtype=np.float32)
    t = Trajectory(
        "t1", "s", None, np.array([1, 2]), np.array([3, 4, 5, 6]), np.array([1, 1, 0, 1]), lp, ["t1"], "stop"
    )
    back = Trajectory.from_row(json.loads(json.dumps(t.to_row())))
    assert back.response_logprobs.tobytes() == lp.tobytes()
    assert back.to_row() == t.to_row()


@pytest.mark.slow
async def test_events_stream_and_a_drained_node_takes_no_new_samples(service):
    svc = await service(nodes=1)
    seen: list[dict] = []

    async def listen():
        async with (
            httpx.AsyncClient(base_url=svc.url, timeout=None, headers=AUTH) as h,
            h.stream("GET", "/v1/events") as r,
        ):
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    seen.append(json.loads(line[6:]))

    listener = asyncio.create_task(listen())
    await wait_until_async(lambda: svc.server.events.queues, timeout=10, message="the listener subscribed")
    async with AsyncRolloutClient(svc.url) as client, httpx.AsyncClient(base_url=svc.url, headers=AUTH) as h:
        tid = await client.submit(
            task("e", "pass"), samples=1, harness="claude-code", runtime="local", harness_cmd=harness()
        )
        [g] = [x async for x in client.wait([tid], poll=0.1)]
        assert g.outcomes[0].status == "completed"
        drained = (await h.delete("/v1/nodes/n0")).json()
        assert drained["state"] == "draining"
        tid2 = await client.submit(
            task("later", "pass"), samples=1, harness="claude-code", runtime="local", harness_cmd=harness()
        )
        await asyncio.sleep(1.5)
        assert [s.state for s in (await client.status(tid2)).samples] == ["queued"]  # nobody takes it
        assert (await h.get("/v1/nodes")).json()[0]["state"] == "draining"
    listener.cancel()
    kinds = [(e["kind"], e.get("task_id"), e.get("state")) for e in seen]
    assert ("task", "e", "queued") in kinds and ("sample", "e", "dispatched") in kinds
    assert ("sample", "e", "finished") in kinds and ("task", "e", "done") in kinds
    assert ("node", None, "draining") in kinds


async def test_priorities_order_the_queue_and_leases_are_checked(service):
    svc = await service(nodes=0)
    body = {"num_samples": 2, "harness": "claude-code", "runtime": "local"}
    async with httpx.AsyncClient(base_url=svc.url, headers=AUTH) as h:
        for tid, prio in (("low", 0), ("high", 5), ("mid", 1)):
            t = task(tid, "x").model_dump(mode="json")
            assert (await h.post("/v1/tasks", json={**body, "task": t, "priority": prio})).status_code == 202
        await h.post("/v1/nodes/register", json={"node_id": "manual"})
        got = (await h.post("/v1/nodes/manual/lease", json={"capacity": 5})).json()["assignments"]
        assert [(a["task_id"], a["index"]) for a in got] == [
            ("high", 0),
            ("high", 1),
            ("mid", 0),
            ("mid", 1),
            ("low", 0),
        ]
        first = got[0]
        report = {
            "task_id": "high",
            "index": 0,
            "lease": "not-the-lease",
            "status": "completed",
            "reward": 1.0,
        }
        r = await h.post("/v1/nodes/manual/results", json=report)
        assert r.status_code == 409 and r.json()["error"]["type"] == "stale_lease"
        r = await h.post("/v1/nodes/manual/results", json={**report, "lease": first["lease"]})
        assert r.status_code == 200
        r = await h.post("/v1/nodes/manual/results", json={**report, "lease": first["lease"]})
        assert r.status_code == 409  # recorded once


async def test_serve_rollouts_starts_and_stops_the_server_a_python_user_configures(tmp_path):
    """`serve`'s assembly as a library: the server answers under its ServerConfig, a taken address
    is CannotListen (its store closed), and leaving stops it."""
    from polar_mitm.service.run import CannotListen, serve_rollouts

    config = ServerConfig(db=tmp_path / "s.sqlite", token="t0k", callback_allow=["A.example,b.example"])
    async with serve_rollouts(config) as service:
        async with httpx.AsyncClient(base_url=service.url) as h:
            assert (await h.get("/v1/tasks")).status_code == 401
            assert (await h.get("/v1/tasks", headers={"authorization": "Bearer t0k"})).json() == []
        assert service.server.config.callback_allow == ("a.example", "b.example")
        with pytest.raises(CannotListen, match=f"cannot listen on 127.0.0.1:{service.server.port}"):
            async with serve_rollouts(ServerConfig(db=tmp_path / "o.sqlite"), port=service.server.port):
                pass
    with pytest.raises(httpx.ConnectError):
        httpx.get(service.url + "/health")
