"""Gateway nodes as Ray actors: `polar-mitm serve --ray ADDRESS|auto|local --nodes N`.

Ray is the scale-out engine (an optional extra: `pip install 'polar-mitm[ray]'`): each actor runs
the same `GatewayNode` code as a local node, against the same server URL, so nothing about the
HTTP contract changes. Actors are spread over the cluster's nodes (one per Ray node while there
are free ones). Each keeps its turns in its own database file on the machine it runs on.
`--ray local` starts a Ray of the server's own, listening on 127.0.0.1 only.
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, Any

from polar_mitm.netaddr import is_loopback

if TYPE_CHECKING:
    from polar_mitm.service.node import GatewayNode

# Ray's single-node switch (the mode it runs in on macOS and Windows), read when ray is imported.
SINGLE_NODE_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


class RayUnavailable(RuntimeError):
    """No Ray to place nodes on: the message says, in one line, what to do."""


def pin_to_loopback() -> None:
    """A Ray instance this process starts binds 127.0.0.1 only.

    Ray's GCS, raylet and workers listen on every interface unless the node's address is exactly
    127.0.0.1, and Ray turns a 127.0.0.1 it is given (`_node_ip_address`) into the machine's own
    address unless it runs single-node. That mode is switched by an environment variable read
    when ray is imported: set it for an import to come, and the flag it sets where ray is in
    already. Only for a Ray of our own: a driver that joins a cluster needs its real address."""
    os.environ[SINGLE_NODE_ENV] = "0"
    constants = sys.modules.get("ray._private.ray_constants")
    if constants is not None:
        constants.ENABLE_RAY_CLUSTER = False  # type: ignore[attr-defined]


def _ray():
    try:
        import ray
    except ImportError:
        raise RayUnavailable("Ray is not installed: pip install 'polar-mitm[ray]'") from None
    return ray


def _actor_class():
    ray = _ray()

    @ray.remote
    class NodeActor:
        """One gateway node; `run` serves until the actor is killed."""

        def __init__(self, config: dict[str, Any]):
            from polar_mitm.service.node_config import NodeConfig

            # The actor's process is the node's alone: see ProxyConfig.own_process.
            self.config = NodeConfig.model_validate({**config, "own_process": True})
            self.node: GatewayNode | None = None

        async def run(self) -> str:
            from polar_mitm.service.node import GatewayNode

            self.node = GatewayNode(self.config)
            await self.node.run()
            return self.config.node_id

        def node_id(self) -> str:
            return self.config.node_id

    return NodeActor


def connect(address: str | None, *, num_cpus: int | None = None) -> Any:
    """Ray, initialized: with None or 'local' a Ray of this process's own on 127.0.0.1 only
    (`num_cpus` of this machine's, all when None); else the cluster at `address` ('auto': the
    one running on this machine). Already initialized: as it is. Returns the ray module."""
    local = address in (None, "local")
    if local:
        pin_to_loopback()
    ray = _ray()
    if ray.is_initialized():
        return ray
    if local:
        ctx = ray.init(
            _node_ip_address="127.0.0.1",
            include_dashboard=False,
            num_cpus=num_cpus,
            ignore_reinit_error=True,
        )
        ip = ctx.address_info["node_ip_address"]
        if not is_loopback(ip):  # never a Ray reachable from the network by accident
            ray.shutdown()
            raise RayUnavailable(f"--ray local: Ray started on {ip}, not on 127.0.0.1; stopped it")
        return ray
    try:
        ray.init(address=address, ignore_reinit_error=True)
    except ConnectionError as e:
        # Ray's own message names its flags and variables, not ours: said for an address only.
        said = (str(e).strip().splitlines() or [e.__class__.__name__])[0]
        where = "on this machine" if address == "auto" else f"at {address} ({said})"
        raise RayUnavailable(
            f"--ray {address}: no Ray cluster is running {where}; start one with"
            " `ray start --head`, or use --ray local for a Ray of this server's own"
        ) from None
    return ray


def start_ray_nodes(
    address: str | None, n: int, config: dict[str, Any], *, num_cpus: float = 1.0
) -> list[Any]:
    """Start `n` node actors (connecting to `address` unless Ray is already initialized, see
    `connect`); returns their handles. Each node gets its own id and database
    (`<db stem>-ray<i>.sqlite`)."""
    connect(address)
    cls = _actor_class()
    actors = []
    from polar_mitm.service.node_config import node_db

    db = str(config.get("db") or "polar-mitm-node.sqlite")
    for i in range(n):
        cfg = {**config, "node_id": f"ray-{i}", "db": node_db(db, f"ray{i}")}
        cfg["policy"] = (
            cfg["policy"].model_dump() if hasattr(cfg.get("policy"), "model_dump") else cfg.get("policy")
        )
        cfg["certs_dir"] = str(cfg["certs_dir"]) if cfg.get("certs_dir") else None
        actor = cls.options(num_cpus=num_cpus, scheduling_strategy="SPREAD").remote(cfg)
        actor.run.remote()
        actors.append(actor)
    return actors


def stop_ray_nodes(actors: list[Any]) -> None:
    ray = _ray()
    for a in actors:
        ray.kill(a)
