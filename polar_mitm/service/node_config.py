"""A gateway node's configuration and the helpers that start and stop one in a process of its
own: what `serve` needs to start its nodes without loading the node itself (its proxy, its
pipeline and their engine clients stay out of the server's process).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

from pydantic import BaseModel, Field, field_validator

from polar_mitm import procs
from polar_mitm.policy import PolicyConfig
from polar_mitm.rollout.options import LIMIT_FIELDS, VERDICT_FIELDS, WORKER_FIELDS, RolloutOptions


class NodeConfig(BaseModel):
    server: str
    # The node credential (it registers, nothing more), or the service token to derive it from.
    node_token: str | None = None
    token: str | None = None
    node_id: str = Field(default_factory=lambda: f"node-{socket.gethostname()}-{uuid.uuid4().hex[:6]}")
    db: str = "polar-mitm-node.sqlite"
    certs_dir: Path | None = None
    policy: PolicyConfig = Field(default_factory=PolicyConfig)
    # The pipeline's sizes (rollout.options.WORKER_FIELDS): None keeps RolloutOptions' default.
    init_workers: int | None = None
    run_workers: int | None = None
    postrun_workers: int | None = None
    ready_size: int | None = None
    retries: int = 2
    # The sandboxes' limits (rollout.options.LIMIT_FIELDS) given to the node: RolloutOptions'
    # defaults for the rest, where its fields are checked.
    limits: dict[str, float | int | bool] = Field(default_factory=dict)

    # How a verdict becomes the trainer's number where a task says nothing
    # (rollout.options.VERDICT_FIELDS), as `rollout --reward-key / --mask-egress-refused`.
    verdict: dict[str, str | bool | None] = Field(default_factory=dict)
    # Hosts every sandbox of the node may reach though they resolve to a private address (an
    # operator's package mirror), as `rollout --egress-allow`.
    egress_allow: list[str] = Field(default_factory=list)

    @field_validator("limits")
    @classmethod
    def _limit_fields(cls, v: dict[str, float | int | bool]) -> dict[str, float | int | bool]:
        unknown = set(v) - set(LIMIT_FIELDS)
        if unknown:
            raise ValueError(f"{sorted(unknown)} is not a sandbox limit (one of {', '.join(LIMIT_FIELDS)})")
        return v

    @field_validator("verdict")
    @classmethod
    def _verdict_fields(cls, v: dict[str, str | bool | None]) -> dict[str, str | bool | None]:
        unknown = set(v) - set(VERDICT_FIELDS)
        if unknown:
            raise ValueError(
                f"{sorted(unknown)} is not a verdict option (one of {', '.join(VERDICT_FIELDS)})"
            )
        return v

    def pipeline_options(self) -> RolloutOptions:
        """The node's pipeline: its sizes, its sandboxes' limits and its verdict options (the
        rest RolloutOptions' defaults; what runs comes with each lease)."""
        sizes = {f: v for f in WORKER_FIELDS if (v := getattr(self, f)) is not None}
        return RolloutOptions(keep_workdirs=self.keep_workdirs, **sizes, **self.limits, **self.verdict)

    capacity: int | None = None  # samples in flight at most [default: init + run workers]
    poll_interval: float = 0.5
    heartbeat_interval: float = 2.0
    work_dir: Path | None = None
    keep_workdirs: bool = False  # keep each sample's host directory (harness.log; HOME with --home-size 0)
    # Set for nodes `serve` starts: the node stops when that process is gone (even SIGKILLed).
    parent_pid: int | None = None
    # The node is what its process is for (`polar-mitm node`, a Ray actor): see ProxyConfig.
    own_process: bool = False


def spawn_node(config: NodeConfig, *, log: Path | None = None) -> subprocess.Popen:
    """`polar-mitm node --config FILE` in a process of its own (mitmproxy keeps per-process global
    state, so one proxy per process; a node per process also gets a core of its own)."""
    fd, path = tempfile.mkstemp(prefix=f"polar-{config.node_id}-", suffix=".json")
    with os.fdopen(fd, "w") as f:
        f.write(config.model_copy(update={"parent_pid": os.getpid()}).model_dump_json())
    out = open(log, "ab") if log is not None else subprocess.DEVNULL  # noqa: SIM115
    return subprocess.Popen(
        [sys.executable, "-m", "polar_mitm", "node", "--config", path],
        stdout=out,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def stop_node(proc: subprocess.Popen, timeout: float = 15.0) -> None:
    """SIGTERM (the node cancels what runs and reports it), then SIGKILL."""
    procs.stop(proc, timeout, group=True)


def node_db(db: str | Path, name: str) -> str:
    """`rollouts.sqlite` → `rollouts.node0.sqlite`: a node's own store beside the server's."""
    p = Path(db)
    return str(p.with_name(f"{p.stem}.{name}{p.suffix or '.sqlite'}"))
