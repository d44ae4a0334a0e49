"""How a rollout runs (`RolloutOptions`): a model of its own, light (pydantic only), so the
command line generates its options from the fields without loading the pipeline (and mitmproxy).
"""

from __future__ import annotations

import os

from pydantic import BaseModel, Field


def default_workers() -> tuple[int, int, int]:
    """INIT / RUN / POSTRUN worker counts for this machine: Polar's 4 / 2 / 4, fewer harnesses at
    once on a small machine (a harness is a busy node process)."""
    cpus = os.cpu_count() or 2
    run = max(1, min(8, cpus // 2)) if cpus >= 4 else max(1, min(2, cpus))
    return 4, run, 4


# The pipeline's sizes: options of `rollout` and of every node (`serve`, `node`; NodeConfig's).
WORKER_FIELDS = ("retries", "init_workers", "run_workers", "postrun_workers", "ready_size")
# What each sample's sandbox may take when its task names no limit: options of `rollout`.
LIMIT_FIELDS = ("memory", "cpus", "pids", "tmp_size", "home_size", "allow_unenforced_limits")
# How a verdict becomes the trainer's number where the task says nothing: options of `rollout`
# and of every node.
VERDICT_FIELDS = ("reward_key", "mask_egress_refused")


class RolloutOptions(BaseModel):
    """How a rollout runs. Task fields (timeouts) apply unless overridden here. `harness`,
    `harness_cmd` and `runtime` say what runs by default (a `rollout`'s every sample); a node's
    pipeline has none, each of its samples says what it runs (`pipeline.SampleSpec`)."""

    harness: str | None = Field(None, description="a recipe name (`polar-mitm recipes` lists them)")
    harness_cmd: list[str] | None = None  # overrides the recipe's headless command
    runtime: str = "docker"
    samples: int = Field(1, ge=1)
    init_workers: int = Field(default_factory=lambda: default_workers()[0], ge=1)
    run_workers: int = Field(default_factory=lambda: default_workers()[1], ge=1)
    postrun_workers: int = Field(default_factory=lambda: default_workers()[2], ge=1)
    ready_size: int | None = Field(None, ge=1)  # default: run_workers
    early_stop: int | None = Field(None, ge=1)
    retries: int = Field(2, ge=0)  # per sample, for sandbox and infrastructure failures
    agent_timeout: float | None = None
    total_timeout: float | None = None
    env: dict[str, str] = Field(default_factory=dict)  # extra environment for every harness
    keep_workdirs: bool = False
    # The one number a trainer gets from a multi-key reward file, where the task names none
    # (`EvaluatorSpec.reward_key`): a key, or `mean` / `min` / `max` of them all.
    reward_key: str | None = Field(
        None,
        description="the key of a multi-key reward.json the trainer gets, or mean/min/max of its keys, "
        "where the task names none (default: 'reward', else its only key, else the mean)",
    )
    # A sample whose verifier had network requests refused (a tool it could not fetch) ends
    # `failed` (masked) instead of trained on as the 0 its tests wrote; the refusals are in
    # reward_detail.egress_refused either way.
    mask_egress_refused: bool = Field(
        False,
        description="mask (fail) a sample whose verifier's network requests were refused, rather than "
        "train on its 0",
    )
    # Who the harness runs as in a container ("UID:GID"); None: the image's user (root).
    harness_user: str | None = "1000:1000"
    # Each sample's sandbox (the agent's and its verifier's) when its task names none: memory in
    # MiB, CPUs, processes, its /tmp and HOME in MiB (`sandbox.base.Limits`); 0: no limit of that kind.
    memory: int = Field(4096, ge=0)
    cpus: float = Field(2.0, ge=0)
    pids: int = Field(4096, ge=1)
    tmp_size: int = Field(1024, ge=0)
    home_size: int = Field(1024, ge=0)
    # A rollout whose runtime cannot enforce the memory, CPU and pids limits (Apptainer without
    # cgroups) refuses to start unless this is set: one sample could take the memory that every
    # sample, the proxy and the store share (docs/rollout.md).
    allow_unenforced_limits: bool = False
