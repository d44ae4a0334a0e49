"""The rollout service with real harnesses in real containers: `polar-mitm serve` with two local
nodes, three Harbor tasks × 4 samples (Claude Code and Codex) submitted through the Python
client, groups back with the expected rewards, token-exact; one group also POSTed to a callback."""

from __future__ import annotations

import json
import os
import signal
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest

from polar_mitm.client import RolloutClient
from tests.support.docker_rollout import ANSWER_TEST, LABEL, harbor_task, leftovers
from tests.support.harness import assert_turns_match_backend, require_binary
from tests.support.helpers import wait_until
from tests.support.service import served_url, spawn

pytestmark = [pytest.mark.e2e, pytest.mark.docker]


class Receiver:
    """A local HTTP endpoint that keeps what is POSTed to it."""

    def __init__(self) -> None:
        self.bodies: list[dict] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                n = int(self.headers.get("content-length", 0))
                outer.bodies.append(json.loads(self.rfile.read(n)))
                self.send_response(204)
                self.end_headers()

            def log_message(self, *a) -> None:
                pass

        self.http = HTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.http.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.http.server_port}/groups"


def test_service_runs_claude_code_and_codex_groups_in_docker(
    tmp_path, backend, qwen_tokenizer_dir, docker_client, monkeypatch
):
    # `serve` writes its token to a config dir of the test's own; the client reads it there.
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.delenv("POLAR_MITM_SERVICE_TOKEN", raising=False)
    require_binary("claude")
    require_binary("codex")
    tasks = tmp_path / "tasks"
    right = harbor_task(tasks, "cc-right", "run: echo 42 > answer.txt", ANSWER_TEST)
    wrong = harbor_task(tasks, "cc-wrong", "run: echo 41 > answer.txt", ANSWER_TEST)
    codex = harbor_task(tasks, "codex-right", "run: echo 42 > answer.txt", ANSWER_TEST)
    db = tmp_path / "service.sqlite"
    proc = spawn(
        ["serve", "--listen", "127.0.0.1:0", "--nodes", "2", "--db", str(db), "--backend", backend.url,
         "--tokenizer", str(qwen_tokenizer_dir), "--tool-parser", "qwen25", "--run-workers", "2",
         "--task-root", str(tasks), "--callback-allow", "127.0.0.1"],
        tmp_path / "serve.log",
    )  # fmt: skip
    receiver = Receiver()
    try:
        url = served_url(tmp_path / "serve.log", proc)
        with RolloutClient(url) as client:
            wait_until(
                lambda: len([n for n in client.http.get("/v1/nodes").json() if n["healthy"]]) >= 2,
                timeout=60,
                interval=0.2,
                message="two nodes registered",
            )
            ids = [
                client.submit(str(right), samples=4, harness="claude-code", runtime="docker"),
                client.submit(
                    str(wrong), samples=4, harness="claude-code", runtime="docker", callback_url=receiver.url
                ),
                client.submit(str(codex), samples=4, harness="codex", runtime="docker"),
            ]
            groups = {g.task_id: g for g in client.wait(ids, poll=0.5, timeout=360)}
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(60)
        receiver.http.shutdown()
    log = (tmp_path / "serve.log").read_text()
    assert set(groups) == {"cc-right", "cc-wrong", "codex-right"}, log[-3000:]
    for task_id, g in groups.items():
        expected = 0.0 if task_id == "cc-wrong" else 1.0
        assert [o.status for o in g.outcomes] == ["completed"] * 4, (task_id, [o.cause for o in g.outcomes])
        assert [o.reward for o in g.outcomes] == [expected] * 4
        assert sorted(s.index for s in g.samples) == [0, 1, 2, 3]  # one row per sample
        assert all(sum(s.loss_mask) > 0 and len(s.rollout_logprobs) == s.response_length for s in g.samples)
    assert {o.node_id for g in groups.values() for o in g.outcomes} == {"local-0", "local-1"}
    # Token fidelity on both nodes' stores: every turn is what the backend sampled for its prompt.
    for i in range(2):
        assert_turns_match_backend(backend, Path(str(db).replace(".sqlite", f".node{i}.sqlite")))
    wait_until(lambda: receiver.bodies, timeout=30, interval=0.2, message="the callback's body")
    [body] = receiver.bodies
    assert body["task"]["task_id"] == "cc-wrong" and {r["reward"] for r in body["rows"]} == {0.0}
    assert leftovers(docker_client) == []
    assert docker_client.containers.list(all=True, filters={"label": LABEL}) == []
