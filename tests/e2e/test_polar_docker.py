"""A Polar client, unchanged but for its base URL, against `polar-mitm serve --polar-api` with
Claude Code in Docker: a Harbor task × 2 samples submitted as Polar's TaskRequest (the `harbor`
evaluator, the `prefix_merging` builder, a callback), polled to `completed` with trainable
traces and the reward on the last one, the callback once; a cancelled task `cancelled`; a
weight-sync pause and resume through the gateways `/nodes` names. Every reply is validated with
Polar's models (`tests/support/polar_schema.py`)."""

from __future__ import annotations

import os
import signal
import time

import httpx
import pytest

from tests.e2e.test_service_docker import Receiver
from tests.support import polar_schema as polar
from tests.support.docker_rollout import ANSWER_TEST, LABEL, TEST_IMAGE, harbor_task
from tests.support.harness import require_binary
from tests.support.helpers import wait_until
from tests.support.service import spawn

pytestmark = [pytest.mark.e2e, pytest.mark.docker]


def test_a_polar_client_runs_claude_code_groups_in_docker(
    tmp_path, backend, qwen_tokenizer_dir, docker_client, monkeypatch
):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.delenv("POLAR_MITM_SERVICE_TOKEN", raising=False)
    require_binary("claude")
    tasks = tmp_path / "tasks"
    right = harbor_task(tasks, "cc-right", "run: echo 42 > answer.txt", ANSWER_TEST)
    log = tmp_path / "serve.log"
    sessions: set[str] = set()

    def mine() -> list[str]:
        """Containers of this test's samples still there (dockerd may be shared with other runs;
        the low-level list inspects no container, so a removal cannot race it)."""
        listed = docker_client.api.containers(all=True, filters={"label": LABEL})
        return [c["Id"] for c in listed if c["Labels"].get("polar-mitm.session") in sessions]

    proc = spawn(
        ["serve", "--listen", "127.0.0.1:0", "--nodes", "1", "--polar-api", "--db", str(tmp_path / "s.sqlite"),
         "--backend", backend.url, "--tokenizer", str(qwen_tokenizer_dir), "--tool-parser", "qwen25",
         "--run-workers", "2", "--task-root", str(tasks), "--callback-allow", "127.0.0.1"],
        log,
    )  # fmt: skip
    receiver = Receiver()

    def request(task_id: str, **kw) -> dict:
        return polar.TaskRequest.model_validate(
            {
                "task_id": task_id,
                "instruction": (right / "instruction.md").read_text(),
                "num_samples": 2,
                "timeout_seconds": 600,
                "runtime": {"image": TEST_IMAGE, "workdir": "/app"},
                "agent": {"harness": "claude_code"},
                "builder": {"strategy": "prefix_merging"},
                "evaluator": {
                    "strategy": "harbor",
                    "config": {"tests_dir": str(right / "tests"), "verifier_timeout": 60},
                },
                "metadata": {"group_id": 0, "policy_version": 0, "agent_timeout": 180},
                **kw,
            }
        ).payload()

    try:
        wait_until(
            lambda: "polar API on " in log.read_text(), timeout=60, interval=0.2, message="serve's Polar URL"
        )
        base = log.read_text().split("polar API on ", 1)[1].split()[0]
        with httpx.Client(base_url=base, timeout=60) as h:
            wait_until(
                lambda: h.get("/health").json()["nodes"] == 1, timeout=60, interval=0.2, message="a node"
            )
            # Weight sync before the rollout, as the slime bridge does it: every gateway, paused and resumed.
            nodes = [polar.GatewayNodeInfo.model_validate(n) for n in h.get("/nodes").json()]
            assert len(nodes) == 1
            paused = httpx.post(
                f"{nodes[0].gateway_url}/admin/inference/pause", params={"timeout_seconds": 30}, timeout=60
            )
            assert paused.json()["paused"] is True and paused.json()["inflight"] == 0
            assert httpx.post(f"{nodes[0].gateway_url}/admin/inference/resume").json()["paused"] is False

            assert (
                h.post(
                    "/rollout/task/submit", json=request("cc-right", callback_url=receiver.url)
                ).status_code
                == 200
            )
            assert h.post("/rollout/task/submit", json=request("cancelled")).status_code == 200
            cancelled = polar.TaskStatus.model_validate(h.delete("/rollout/task/cancelled").json())
            assert cancelled.status == "cancelled"
            deadline = time.monotonic() + 420
            while (
                status := polar.TaskStatus.model_validate(h.get("/rollout/task/cc-right").json())
            ).status == "running":
                assert time.monotonic() < deadline, log.read_text()[-3000:]
                time.sleep(1.0)
            wait_until(lambda: receiver.bodies, timeout=30, interval=0.2, message="the callback")
            time.sleep(2.0)  # room for a second post that must not come
            for task_id in ("cc-right", "cancelled"):
                sessions |= {s["session_id"] for s in h.get(f"/tasks/{task_id}/sessions").json()["sessions"]}
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(60)
        receiver.http.shutdown()
    assert status.status == "completed" and len(status.results) == 2, log.read_text()[-3000:]
    for s in status.results:
        assert s.status == "COMPLETED", s.error
        traces = s.trajectory.traces
        assert traces[-1].reward == 1.0
        for t in traces:
            assert t.response_logprobs is not None and len(t.response_ids) == len(t.loss_mask) == len(
                t.response_logprobs
            )
            assert sum(t.loss_mask) > 0
        assert s.metadata["group_id"] == 0 and s.timing.run_ms > 0 and s.timing.postrun_ms > 0
    [body] = receiver.bodies
    assert polar.TaskResult.model_validate(body).task_id == "cc-right"
    wait_until(lambda: not mine(), timeout=30, interval=0.5, message="every container removed")
