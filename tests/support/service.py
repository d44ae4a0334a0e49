"""The rollout service as the tests start it: in-process (the `service` fixture: a server and its
nodes over a fake backend) or as `polar-mitm` processes (`spawn`, `served_url`), and the shell
"harness" that makes one real model call through its node's proxy."""

from __future__ import annotations

import asyncio
import subprocess
from pathlib import Path

import httpx

from polar_mitm.policy import PolicyConfig
from polar_mitm.service.node import GatewayNode
from polar_mitm.service.node_config import NodeConfig, spawn_node
from polar_mitm.service.server import RolloutServer
from tests.support.harness import POLAR, printed_url
from tests.support.helpers import MODEL_CALL, wait_until

# Every server here requires a token: the operator's, given the way users give it (the env), so
# `serve` processes, their nodes, `submit` and the client all find it. A config dir of the test's
# own keeps any token file out of the real one.
TOKEN = "test-control-token"


def harness(extra: str = "") -> list[str]:
    """A shell 'harness': one model call through the proxy, then writes its instruction."""
    return ["sh", "-c", MODEL_CALL + extra + 'echo "$1" > out.txt', "harness", "{instruction}"]


class Service:
    def __init__(self, server: RolloutServer, backend_url: str):
        self.server = server
        self.backend_url = backend_url
        self.nodes: list[GatewayNode] = []
        self.loops: list[asyncio.Task] = []
        self.procs: list = []

    @property
    def url(self) -> str:
        return self.server.url

    async def add_node(
        self, tmp_path: Path, tokenizer: Path, certs: Path, i: int, process: bool = False, **sizes: int
    ) -> None:
        """Node `n{i}`; `sizes` are NodeConfig's pipeline sizes (run_workers=1, capacity=6, …)."""
        config = NodeConfig(
            server=self.url,
            token=self.server.token,
            node_id=f"n{i}",
            db=str(tmp_path / f"node{i}.sqlite"),
            certs_dir=certs,
            policy=PolicyConfig(backend_url=self.backend_url, tokenizer=str(tokenizer), ping_interval=0.2),
            work_dir=tmp_path / f"work{i}",
            poll_interval=0.1,
            heartbeat_interval=0.3,
            **sizes,
        )
        if process:  # mitmproxy keeps per-process state: one proxy (node) per process beyond the first
            self.procs.append(spawn_node(config, log=tmp_path / f"node{i}.log"))
            return
        node = GatewayNode(config)
        await node.start()
        self.nodes.append(node)
        self.loops.append(asyncio.create_task(node.serve()))


def spawn(args: list[str], log: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [*POLAR, *args], stdout=log.open("ab"), stderr=subprocess.STDOUT, start_new_session=True
    )


def wait_http(url: str, timeout: float = 30) -> None:
    def up() -> bool:
        try:
            return httpx.get(url + "/health", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    wait_until(up, timeout=timeout, interval=0.1, message=f"{url} to come up")


def served_url(log: Path, proc: subprocess.Popen, timeout: float = 30) -> str:
    """The address a `serve` started with `--listen 127.0.0.1:0` printed to `log` once it
    listened, after it answers `/health`."""

    def printed() -> str | None:
        assert proc.poll() is None, log.read_text()[-2000:]
        return next((ln for ln in log.read_text().splitlines() if "rollout server on" in ln), None)

    url = printed_url(wait_until(printed, timeout=timeout, message="serve to print its address"))
    wait_http(url, timeout)
    return url


def node_args(server: str, backend, tokenizer, db: Path, node_id: str) -> list[str]:
    return [
        "node",
        "--server",
        server,
        "--node-id",
        node_id,
        "--backend",
        backend.url,
        "--tokenizer",
        str(tokenizer),
        "--db",
        str(db),
    ]
