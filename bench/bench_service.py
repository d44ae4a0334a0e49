"""The rollout service's own cost.

1. Scheduling rate: samples per second the server hands out and takes back, with an instant
   sandbox and a harness that exits at once (local runtime, `true`), through one node.
2. End-to-end overhead per sample: the same samples through the service (server + one node in
   another process, HTTP leases and reports, rows built from the node's store) against the
   one-machine pipeline (`polar-mitm rollout`'s code path), with a shell "harness" that makes one
   real model call through the proxy to the fake SGLang backend; same run, same machine.

    .venv/bin/python bench/bench_service.py [--samples 64] [--tasks 8]
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

from polar_mitm.backends.tokenizer_build import ensure_tokenizer
from polar_mitm.client import AsyncRolloutClient
from polar_mitm.fake import FakeBackendConfig, start_fake_backend
from polar_mitm.policy import PolicyConfig
from polar_mitm.proxy.embedded import PolarProxy, ProxyConfig
from polar_mitm.rollout.pipeline import Pipeline, RolloutOptions
from polar_mitm.sandbox.tempdir import TempdirRuntime
from polar_mitm.service.config import ServerConfig
from polar_mitm.service.node_config import NodeConfig, spawn_node, stop_node
from polar_mitm.service.server import RolloutServer
from polar_mitm.tasks.model import EvaluatorSpec, Task

MODEL_CALL = (
    "python3 - <<'EOF'\n"
    "import json, urllib.request\n"
    "req = urllib.request.Request('https://api.anthropic.com/v1/messages', data=json.dumps({"
    "'model': 'm', 'max_tokens': 8, 'messages': [{'role': 'user', 'content': 'say hi'}]}).encode(),"
    " headers={'content-type': 'application/json', 'x-api-key': 'k', 'anthropic-version': '2023-06-01'})\n"
    "urllib.request.urlopen(req).read()\n"
    "EOF\n"
)


def tasks(n: int) -> list[Task]:
    return [
        Task(id=f"t{i}", instruction="x", evaluator=EvaluatorSpec(kind="command", command="true"))
        for i in range(n)
    ]


async def through_service(
    url: str, token: str, n_tasks: int, samples: int, cmd: list[str], prefix: str
) -> float:
    async with AsyncRolloutClient(url, token=token) as client:
        t0 = time.perf_counter()
        ids = [
            await client.submit(
                t,
                samples=samples,
                harness="claude-code",
                runtime="local",
                harness_cmd=cmd,
                task_id=f"{prefix}{t.id}",
            )
            for t in tasks(n_tasks)
        ]
        async for _ in client.wait(ids, poll=0.05):
            pass
        return time.perf_counter() - t0


async def through_pipeline(
    work: Path, url: str, tok: Path, n_tasks: int, samples: int, cmd: list[str], workers: dict
) -> float:
    proxy = PolarProxy(ProxyConfig(db=str(work / "pipe.sqlite"), certs_dir=work / "certs", token="b",
                                   policy=PolicyConfig(backend_url=url, tokenizer=str(tok))))  # fmt: skip
    await proxy.start()
    try:
        opts = RolloutOptions(
            harness="claude-code", runtime="local", harness_cmd=cmd, samples=samples, **workers
        )
        p = Pipeline(opts, proxy, TempdirRuntime(), work_dir=work / "pipe")
        t0 = time.perf_counter()
        await p.run(tasks(n_tasks))
        return time.perf_counter() - t0
    finally:
        await proxy.stop()


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=64, help="samples in all, per measurement")
    ap.add_argument("--tasks", type=int, default=8)
    a = ap.parse_args()
    per_task = max(1, a.samples // a.tasks)
    n = per_task * a.tasks
    tok = ensure_tokenizer("qwen")
    runner, backend = await start_fake_backend(FakeBackendConfig(tokenizer_path=str(tok)))
    workers = {"init_workers": 4, "run_workers": 2, "postrun_workers": 4}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        server = RolloutServer(ServerConfig(db=work / "service.sqlite", allow_local_runtime=True))
        await server.start()
        node = spawn_node(
            NodeConfig(server=server.url, node_token=server.node_token, node_id="bench", db=str(work / "node.sqlite"), certs_dir=work / "certs",
                       policy=PolicyConfig(backend_url=backend, tokenizer=str(tok)), poll_interval=0.02,
                       heartbeat_interval=0.5, **workers),
            log=work / "node.log",
        )  # fmt: skip
        try:
            while not server.healthy_nodes():
                await asyncio.sleep(0.05)
            trivial = ["true", "{instruction}"]
            await through_service(server.url, server.token, 1, 2, trivial, "warm-")
            svc_trivial = await through_service(
                server.url, server.token, a.tasks, per_task, trivial, "trivial-"
            )
            call = ["sh", "-c", MODEL_CALL + "true", "h", "{instruction}"]
            svc_call = await through_service(server.url, server.token, a.tasks, per_task, call, "call-")
            pipe_trivial = await through_pipeline(
                work / "p1", backend, tok, a.tasks, per_task, trivial, workers
            )
            pipe_call = await through_pipeline(work / "p2", backend, tok, a.tasks, per_task, call, workers)
        finally:
            stop_node(node)
            await server.stop()
            await runner.cleanup()
    print(f"{n} samples ({a.tasks} tasks × {per_task}), local runtime, one node, 2 harnesses at a time")
    print(
        "| harness | one-machine pipeline s | through the service s | ratio | service samples/s | overhead ms/sample |"
    )
    print("|---|---|---|---|---|---|")
    for name, pipe, svc in (
        ("`true` (instant)", pipe_trivial, svc_trivial),
        ("one model call", pipe_call, svc_call),
    ):
        print(
            f"| {name} | {pipe:.2f} | {svc:.2f} | {svc / pipe:.2f}× | {n / svc:.1f} | {1000 * (svc - pipe) / n:.1f} |"
        )


if __name__ == "__main__":
    asyncio.run(main())
