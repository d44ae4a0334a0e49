"""Gateway nodes as Ray actors: `polar-mitm serve --ray ADDRESS|auto --nodes N`.

Ray is the scale-out engine (an optional extra: `pip install 'polar-mitm[ray]'`): each actor runs
the same `GatewayNode` code as a local node, against the same server URL, so nothing about the
HTTP contract changes. Actors are spread over the cluster's nodes (one per Ray node while there
are free ones). Each keeps its turns in its own database file on the machine it runs on.
"""

from __future__ import annotations

from typing import Any


def _ray():
    try:
        import ray
    except ImportError:
        raise RuntimeError("Ray is not installed: pip install 'polar-mitm[ray]'") from None
    return ray


def _actor_class():
    ray = _ray()

    @ray.remote
    class NodeActor:
        """One gateway node; `run` serves until the actor is killed."""

        def __init__(self, config: dict[str, Any]):
            from polar_mitm.service.node import NodeConfig

            self.config = NodeConfig.model_validate(config)
            self.node = None

        async def run(self) -> str:
            from polar_mitm.service.node import GatewayNode

            self.node = GatewayNode(self.config)
            await self.node.run()
            return self.config.node_id

        def node_id(self) -> str:
            return self.config.node_id

    return NodeActor


def start_ray_nodes(
    address: str | None, n: int, config: dict[str, Any], *, num_cpus: float = 1.0
) -> list[Any]:
    """Start `n` node actors (connecting to `address` unless Ray is already initialized); returns
    their handles. Each node gets its own id and database (`<db stem>-ray<i>.sqlite`)."""
    ray = _ray()
    if not ray.is_initialized():
        ray.init(address=None if address in (None, "local") else address, ignore_reinit_error=True)
    cls = _actor_class()
    actors = []
    from polar_mitm.service.node import node_db

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
