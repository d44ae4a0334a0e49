"""`serve`'s assembly as a library: a rollout server listening on HOST:PORT and the gateway nodes
it starts beside it (a process each on this machine, or Ray actors), started together and stopped
together. The command parses its options, prints and waits; a Python user calls the same:

    from polar_mitm.policy import PolicyConfig
    from polar_mitm.service.config import ServerConfig
    from polar_mitm.service.node_config import NodeConfig
    from polar_mitm.service.run import serve_rollouts

    node = NodeConfig(server="", policy=PolicyConfig(backend_url="http://127.0.0.1:30000"))
    async with serve_rollouts(ServerConfig(db="rollouts.sqlite"), nodes=2, node=node) as service:
        ...  # polar_mitm.client.AsyncRolloutClient(service.url, token=service.server.token)
"""

from __future__ import annotations

import subprocess
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from polar_mitm.service.config import ServerConfig
from polar_mitm.service.node_config import NodeConfig, node_db, spawn_node, stop_node
from polar_mitm.service.server import RolloutServer


class CannotListen(RuntimeError):
    """The server's address is taken (or not this machine's)."""


@dataclass
class Service:
    """A started server and the nodes started beside it."""

    server: RolloutServer
    url: str
    processes: list[subprocess.Popen] = field(default_factory=list)
    actors: list[Any] = field(default_factory=list)  # Ray actor handles


@asynccontextmanager
async def serve_rollouts(
    config: ServerConfig,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    nodes: int = 0,
    ray_address: str | None = None,
    node: NodeConfig | None = None,
) -> AsyncIterator[Service]:
    """The server on `host`:`port` (0: a free port) and `nodes` gateway nodes: processes on this
    machine, or Ray actors on the cluster at `ray_address` (`ray_nodes.connect`; RayUnavailable
    when there is none). Each node is `node` (its policy, sizes, CA) with the server's URL, its
    node credential, an id (`local-<i>`, `ray-<i>`) and a store of its own beside `config.db`.
    Leaving stops the nodes (what they ran is reported first) and then the server."""
    server = RolloutServer(config)
    try:
        await server.start(host, port)
    except OSError as e:
        server.store.close()
        raise CannotListen(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    service = Service(server, f"http://{host}:{server.port}")
    template = (node or NodeConfig(server="")).model_copy(
        update={"server": service.url, "node_token": server.node_token, "token": None}
    )
    try:
        if ray_address:
            from polar_mitm.service.ray_nodes import start_ray_nodes

            fields = {**template.model_dump(mode="json"), "db": str(config.db)}
            service.actors = start_ray_nodes(ray_address, nodes, fields)
        else:
            for i in range(nodes):
                # A process per node: each proxy has a core to itself, and each node writes its
                # turns to a file of its own beside the server's store (one writer per file).
                db = node_db(config.db, f"node{i}")
                own = template.model_copy(update={"node_id": f"local-{i}", "db": db})
                service.processes.append(spawn_node(own, log=Path(db).with_suffix(".log")))
        yield service
    finally:
        await _stop(service)


async def _stop(service: Service) -> None:
    server = service.server
    for i, proc in enumerate(service.processes):
        stop_node(proc)
        # It reported what it ran and is gone: its id is free for the next server on this store.
        held = server.store.node(f"local-{i}")
        if held is not None and held.state != "lost":
            server.lose_node(held.id)
    if service.actors:
        from polar_mitm.service.ray_nodes import stop_ray_nodes

        stop_ray_nodes(service.actors)
    await server.stop()
