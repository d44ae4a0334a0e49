"""The service never stalls a training step. A busy node is slow, not lost: its heartbeats come
from a thread its work cannot block. A sample runs under one lease at a time, and nothing waits
forever: a node keeps each lease apart (a re-dispatch to the node that held the sample is a new job, and the old copy's refusal
touches nothing of it), the server repairs a sample its node no longer holds or holds past its
deadline (queued again, or failed with a cause at the dispatch limit), and a node the server
declared lost is told to drop what it held when it comes back."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time

import httpx
import pytest

from polar_mitm.client import AsyncRolloutClient
from polar_mitm.policy import PolicyConfig
from polar_mitm.service.node import GatewayNode, NodeConfig
from polar_mitm.tasks.model import EvaluatorSpec, Task
from tests.support.harness import free_port
from tests.support.helpers import wait_until_async
from tests.support.service import TOKEN, spawn, wait_http

AUTH = {"authorization": f"Bearer {TOKEN}"}


def task(task_id: str, **kw) -> Task:
    return Task(
        id=task_id,
        instruction="x",
        evaluator=EvaluatorSpec(kind="command", command="grep -q pass out.txt"),
        **kw,
    )


@pytest.mark.slow
async def test_a_sample_re_dispatched_to_the_node_that_held_it_completes_and_is_reported_once(
    service, tmp_path
):
    """The bug: the node kept its jobs by (task, index), so the second copy's entry replaced the
    first's, the first copy's outcome went out under the second copy's lease (and was taken), and
    the second copy, the one the server waits for, was never reported."""
    svc = await service(nodes=1)
    marks = tmp_path / "marks"
    marks.mkdir()
    # The first copy waits for the second to start, then fails its check and ends first; the
    # second (the current lease) passes once the first has ended (or after 5 s, if it was dropped).
    script = (
        f"if mkdir {marks}/first 2>/dev/null; then\n"
        f"  i=0; while [ ! -d {marks}/second ] && [ $i -lt 300 ]; do sleep 0.1; i=$((i+1)); done\n"
        f"  echo fail > out.txt; touch {marks}/first-ended\n"
        "else\n"
        f"  mkdir {marks}/second\n"
        f"  i=0; while [ ! -e {marks}/first-ended ] && [ $i -lt 50 ]; do sleep 0.1; i=$((i+1)); done\n"
        "  sleep 1; echo pass > out.txt\n"
        "fi\n"
    )
    async with AsyncRolloutClient(svc.url) as client, httpx.AsyncClient(base_url=svc.url, headers=AUTH) as h:
        tid = await client.submit(
            task("again"),
            samples=1,
            harness="claude-code",
            runtime="local",
            harness_cmd=["sh", "-c", script, "h", "{instruction}"],
        )
        await wait_until_async(
            lambda: (marks / "first").exists(), timeout=30, message="the first copy running"
        )
        # The server gives the sample up while the node still runs it (as when it declares a
        # starved node lost); the node is back at its next heartbeat and leases the sample again.
        svc.server.lose_node("n0")
        [g] = [x async for x in client.wait([tid], poll=0.1)]
        assert [(o.status, o.reward) for o in g.outcomes] == [("completed", 1.0)]
        [s] = svc.server.store.samples(tid, rows=False)
        assert s.dispatches == 2 and s.node_id == "n0"
        metrics = (await h.get("/metrics")).text
    finished = [ln for ln in metrics.splitlines() if ln.startswith("polar_samples_finished_total{")]
    assert finished == ['polar_samples_finished_total{status="completed"} 1.0']  # reported once
    await wait_until_async(
        lambda: svc.nodes[0].jobs == {}, timeout=10, message="the node to let go of both copies"
    )


async def _beats(h: httpx.AsyncClient, node: str, held: list | None) -> None:
    """Heartbeats of a node that lists `held` (leases; None: no sample, as a node keyed by task
    and index says it) and nothing else, every 0.2 s."""
    while True:
        body = {"samples": []} if held is None else {"leases": list(held)}
        await h.post(f"/v1/nodes/{node}/heartbeat", json=body)
        await asyncio.sleep(0.2)


async def test_a_sample_its_node_silently_dropped_is_run_again_then_failed_and_its_task_completes(service):
    """The bug: a sample its node's heartbeats no longer listed was queued again only while it had
    dispatches left; at the limit it stayed `dispatched` forever, and its task never completed."""
    svc = await service(nodes=0, node_timeout=1.0)
    async with httpx.AsyncClient(base_url=svc.url, headers=AUTH) as h:
        body = {
            "task": task("dropped").model_dump(mode="json"),
            "num_samples": 1,
            "harness": "claude-code",
            "runtime": "local",
        }
        assert (await h.post("/v1/tasks", json=body)).status_code == 202
        await h.post("/v1/nodes/register", json={"node_id": "careless"})
        beats = asyncio.create_task(_beats(h, "careless", None))  # alive, holding nothing
        try:
            for _ in range(2):  # the dispatch limit

                async def leased() -> bool:
                    got = (await h.post("/v1/nodes/careless/lease", json={"capacity": 1})).json()[
                        "assignments"
                    ]
                    return bool(got)

                await wait_until_async(leased, timeout=10, interval=0.2, message="the sample leased")

            async def done() -> bool:
                return (await h.get("/v1/tasks/dropped")).json()["state"] == "done"

            await wait_until_async(done, timeout=10, interval=0.2, message="the task to complete")
        finally:
            beats.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await beats
        [s] = (await h.get("/v1/tasks/dropped")).json()["samples"]
        metrics = (await h.get("/metrics")).text
    assert (
        s["status"] == "failed" and "no longer holds it" in s["cause"] and "dispatched 2 times" in s["cause"]
    )
    assert 'polar_service_repairs_total{action="requeued",reason="unheld"} 1.0' in metrics
    assert 'polar_service_repairs_total{action="failed",reason="unheld"} 1.0' in metrics


async def test_a_sample_held_past_its_deadline_is_repaired_and_a_lost_node_is_told_to_drop_it(service):
    svc = await service(nodes=0, node_timeout=1.0, deadline_grace=0.5)
    async with httpx.AsyncClient(base_url=svc.url, headers=AUTH) as h:
        body = {
            "task": task("stuck").model_dump(mode="json"),
            "num_samples": 1,
            "harness": "claude-code",
            "runtime": "local",
            "timeout_seconds": 1,
        }
        assert (await h.post("/v1/tasks", json=body)).status_code == 202
        await h.post("/v1/nodes/register", json={"node_id": "stuck"})
        held: list[str] = []
        beats = asyncio.create_task(_beats(h, "stuck", held))  # lists its lease for ever
        try:
            for _ in range(2):
                got = (await h.post("/v1/nodes/stuck/lease", json={"capacity": 1})).json()["assignments"]
                assert len(got) == 1
                held[:] = [got[0]["lease"]]

                async def repaired(lease: str = got[0]["lease"]) -> bool:
                    [s] = (await h.get("/v1/tasks/stuck")).json()["samples"]
                    return s["state"] != "dispatched"

                await wait_until_async(repaired, timeout=10, interval=0.2, message="the sample repaired")
                # The node still lists the lease: the server tells it to drop it.
                control = (await h.post("/v1/nodes/stuck/heartbeat", json={"leases": held})).json()
                assert control["drop"] == held
        finally:
            beats.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await beats
        view = (await h.get("/v1/tasks/stuck")).json()
        metrics = (await h.get("/metrics")).text
        assert view["state"] == "done"
        [s] = view["samples"]
        assert s["status"] == "failed" and "deadline" in s["cause"]
        assert 'polar_service_repairs_total{action="requeued",reason="deadline"} 1.0' in metrics
        assert 'polar_service_repairs_total{action="failed",reason="deadline"} 1.0' in metrics

        # A node declared lost is fenced: when it comes back, every lease it held is dropped.
        body = {**body, "task": task("fenced").model_dump(mode="json"), "timeout_seconds": 600}
        assert (await h.post("/v1/tasks", json=body)).status_code == 202
        [a] = (await h.post("/v1/nodes/stuck/lease", json={"capacity": 1})).json()["assignments"]
        svc.server.lose_node("stuck")
        control = (await h.post("/v1/nodes/stuck/heartbeat", json={"leases": [a["lease"]]})).json()
        assert control["drop"] == [a["lease"]]
        [s] = (await h.get("/v1/tasks/fenced")).json()["samples"]
        assert s["state"] == "queued"


@pytest.mark.slow
async def test_a_node_whose_event_loop_is_blocked_past_the_node_timeout_is_not_declared_lost(
    tmp_path, monkeypatch, backend_process, tiny_tokenizer_dir, certs_dir
):
    """The bug: the heartbeats were a task on the loop that does the node's work, so a first
    tokenizer load (or any stretch of work that holds the loop) silenced them, and a node that was
    running samples was declared lost and its samples run twice."""
    monkeypatch.setenv("POLAR_MITM_SERVICE_TOKEN", TOKEN)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    url = f"http://127.0.0.1:{free_port()}"
    log = tmp_path / "serve.log"
    serve = spawn(["serve", "--listen", url[7:], "--nodes", "0", "--node-timeout", "1.5",
                   "--db", str(tmp_path / "s.sqlite")], log)  # fmt: skip
    node = None
    try:
        await asyncio.to_thread(wait_http, url)
        node = GatewayNode(
            NodeConfig(
                server=url,
                token=TOKEN,
                node_id="busy",
                db=str(tmp_path / "node.sqlite"),
                certs_dir=certs_dir,
                policy=PolicyConfig(backend_url=backend_process.url, tokenizer=str(tiny_tokenizer_dir)),
                work_dir=tmp_path / "work",
                heartbeat_interval=0.3,
            )
        )
        await node.start()
        serving = asyncio.create_task(node.serve())
        await asyncio.sleep(0.5)
        time.sleep(4.5)  # the node's loop held: three node timeouts
        await asyncio.sleep(0)

        def nodes() -> list[dict]:
            return httpx.get(f"{url}/v1/nodes", headers=AUTH).json()

        [n] = await asyncio.to_thread(nodes)
        assert n["state"] == "active" and n["healthy"], log.read_text()[-2000:]
        assert "lost" not in log.read_text()
        await node.stop()
        await asyncio.gather(serving, return_exceptions=True)
        node = None
    finally:
        if node is not None:
            await node.stop()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(serve.pid, signal.SIGKILL)


NODES = 16  # the count; see the test's docstring for what it costs


@pytest.mark.slow
def test_a_busy_service_loses_no_node_runs_no_harness_twice_and_completes_every_task(
    tmp_path, monkeypatch, qwen_tokenizer_dir, certs_dir
):
    """`serve --nodes 0` and 16 `polar-mitm node` processes on the test machine (2 cores on CI),
    64 samples in groups of 8 that each make a model call, the first calls included (no warm-up:
    the nodes start, load the 151k-token tokenizer and register while the tasks are already
    queued): no node is declared lost, no harness runs twice, every task completes. Prints the
    longest heartbeat silence the server saw (the margin below the 15 s node timeout)."""
    from polar_mitm.client import RolloutClient
    from polar_mitm.service.node_config import stop_node
    from tests.support.harness import FakeBackend
    from tests.support.helpers import MODEL_CALL
    from tests.support.service import node_args, served_url

    monkeypatch.setenv("POLAR_MITM_SERVICE_TOKEN", TOKEN)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    t0 = time.monotonic()
    backend = FakeBackend(qwen_tokenizer_dir)
    runs = tmp_path / "runs.txt"  # a line per harness run
    log = tmp_path / "serve.log"
    serve = spawn(["serve", "--listen", "127.0.0.1:0", "--nodes", "0", "--allow-local-runtime",
                   "--db", str(tmp_path / "s.sqlite")], log)  # fmt: skip
    nodes: list = []
    try:
        url = served_url(log, serve, timeout=60)
        cmd = ["sh", "-c", MODEL_CALL + f'echo "$1" >> {runs}; echo pass > out.txt', "h", "{instruction}"]
        with RolloutClient(url) as client:
            ids = [
                client.submit(
                    Task(
                        id=f"t{i}",
                        instruction=f"t{i}",
                        evaluator=EvaluatorSpec(kind="command", command="grep -q pass out.txt"),
                    ),
                    samples=8,
                    harness="claude-code",
                    runtime="local",
                    harness_cmd=cmd,
                )
                for i in range(8)
            ]
            for i in range(NODES):  # after the tasks: each node's first samples wait on its start
                argv = node_args(url, backend, qwen_tokenizer_dir, tmp_path / f"n{i}.sqlite", f"n{i}")
                nodes.append(spawn([*argv, "--certs", str(certs_dir)], tmp_path / f"n{i}.log"))
            groups = list(client.wait(ids, poll=0.5, timeout=240))
        metrics = httpx.get(f"{url}/metrics", headers=AUTH).text
        listed = httpx.get(f"{url}/v1/nodes", headers=AUTH).json()
        said = log.read_text()  # before the nodes stop (and are lost, as they should be then)
    finally:
        for p in nodes:  # all told at once, then each waited for
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(signal.SIGTERM)
        for p in nodes:
            stop_node(p)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(serve.pid, signal.SIGTERM)
        with contextlib.suppress(Exception):
            serve.wait(20)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(serve.pid, signal.SIGKILL)
        backend.stop()
    silences = {
        ln.split('node="')[1].split('"')[0]: float(ln.rsplit(" ", 1)[1])
        for ln in metrics.splitlines()
        if ln.startswith("polar_node_heartbeat_silence_max_seconds{")
    }
    print(
        f"{NODES} nodes, {len(groups) * 8} samples in {time.monotonic() - t0:.0f} s (load average"
        f" {os.getloadavg()[0]:.1f}); longest heartbeat silence: {max(silences.values()):.2f} s"
        f" ({', '.join(f'{n} {s:.1f}' for n, s in sorted(silences.items()))})"
    )
    assert len(listed) == NODES and {n["state"] for n in listed} == {"active"}, listed
    assert " lost" not in said and "silent" not in said, said[-3000:]
    assert "polar_service_repairs_total{" not in metrics  # nothing repaired
    for g in groups:
        assert [o.status for o in g.outcomes] == ["completed"] * 8, said[-3000:]
        assert {o.dispatches for o in g.outcomes} == {1}
    lines = runs.read_text().splitlines()
    assert sorted(lines) == sorted(f"t{i}" for i in range(8) for _ in range(8))  # each harness once
    assert len(silences) == NODES and max(silences.values()) < 15
