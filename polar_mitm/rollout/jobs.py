"""A rollout's samples as the pipeline holds them (`SampleJob`, in a `GroupState`), what each is
given (its sandbox's `SandboxSpec`, its harness's environment), and what a rollout returns
(`RolloutResult`, a `SampleOutcome` per sample). A group records each outcome
(`GroupState.record`) and says when early stop ends the rest of it."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from polar_mitm.harness.local import child_env
from polar_mitm.outcomes import TRAINABLE
from polar_mitm.proxy.certs import CA
from polar_mitm.proxy.embedded import proxy_url
from polar_mitm.rollout.evaluators import HarnessOutcome
from polar_mitm.rollout.options import RolloutOptions
from polar_mitm.rollout.port import SessionPort
from polar_mitm.rollout.spec import SampleSpec
from polar_mitm.rollout.steps import StepRecord
from polar_mitm.sandbox.base import (
    HOME_DIR,
    Limits,
    Runtime,
    Sandbox,
    SandboxSpec,
    host_env,
    unenforced_refusal,
)
from polar_mitm.sandbox.channel import Channel
from polar_mitm.tasks.model import Task

if TYPE_CHECKING:
    from polar_mitm.reconstruct.stats import ReconstructStats

ROLLOUT_LABEL = "polar-mitm.rollout"

Stage = Literal["queued", "starting", "ready", "running", "scoring", "done"]
STAGES: tuple[Stage, ...] = ("queued", "starting", "ready", "running", "scoring", "done")


@dataclass(eq=False)
class SampleJob:
    task: Task
    group: GroupState
    index: int
    spec: SampleSpec
    attempt: int = 0
    session_id: str = ""
    stage: Stage = "queued"
    sandbox: Sandbox | None = None
    channel: Channel | None = None
    session_dir: Path | None = None
    outcome: HarnessOutcome | None = None
    started: float = 0.0  # monotonic time INIT began (the total budget's start)
    mark: float = 0.0  # when the current stage began
    timings: dict[str, float] = field(default_factory=dict)
    current: asyncio.Future | None = None  # the stage's work, cancelled on early stop
    cancel_reason: str | None = None
    final: str | None = None  # the recorded outcome, once there is one
    reward: float | None = None
    cause: str | None = None
    # A multi-step task's steps scored so far (`steps.StepRecord`s), and whether a step's reward
    # below its min_reward ended the sample before its last step.
    steps: list[StepRecord] = field(default_factory=list)
    stopped_early: bool = False


@dataclass(eq=False)
class GroupState:
    id: str
    task: Task
    size: int
    jobs: list[SampleJob] = field(default_factory=list)
    usable: int = 0
    finished: int = 0
    stopped: str | None = None  # why the rest of the group was cancelled

    def record(self, job: SampleJob, status: str, reward: float | None, cause: str | None) -> None:
        """`job`'s final outcome, counted in the group."""
        job.final, job.reward, job.cause = status, reward, cause
        self.finished += 1
        self.usable += status in TRAINABLE

    def early_stop(self, usable: int | None) -> str | None:
        """Why the rest of the group stops now (`usable` samples in), else None."""
        if usable and self.usable >= usable and not self.stopped and self.finished < self.size:
            return f"early stop: {self.usable} usable samples in"
        return None

    def stop(self, reason: str) -> None:
        """Cancel every sample of the group still at work."""
        self.stopped = reason
        for j in self.jobs:
            if j.final is None and j.current is not None and not j.current.done():
                j.cancel_reason = reason
                j.current.cancel()


def sandbox_spec(job: SampleJob, ca: CA, rollout_id: str, opts: RolloutOptions) -> SandboxSpec:
    """The agent's sandbox of this attempt (the verifier's is made from it, rollout/verify.py)."""
    assert job.session_dir is not None
    mount = job.spec.mount
    return SandboxSpec(
        name=f"polar-{job.session_id}",
        session_dir=job.session_dir,
        ca=ca,
        harness=mount,
        labels={ROLLOUT_LABEL: rollout_id, "polar-mitm.session": job.session_id},
        channel=job.channel.socket_path if job.channel is not None else None,
        user=opts.harness_user,
        forwarder_node=mount.node if mount is not None else None,
        limits=sandbox_limits(opts),
    )


def harness_env(job: SampleJob, port: SessionPort, extra: dict[str, str]) -> dict[str, str]:
    """The harness's environment inside its sandbox: the proxy with this sample's
    credentials (through its channel when it has one), our CA as the sandbox sees it, the
    recipe's settings, a fresh HOME; on the host (local runtime) the few host variables a
    process needs (`host_env`), never the host's secrets; `extra` last (the rollout's --env)."""
    assert job.sandbox is not None and job.session_dir is not None
    isolated, mount = job.spec.runtime.isolated, job.spec.mount
    home = str(job.session_dir / "home") if not isolated else HOME_DIR
    base = {"HOME": home, "CI": "1", "TERM": "dumb", "LANG": "C.UTF-8"}
    if not isolated:  # a host process: keep the host's PATH and the like
        base = {**host_env(), **base}
    elif mount is not None:  # what the mounted installation needs (PyPI: no .pyc writes)
        base.update(mount.env)
    address = job.sandbox.proxy_address
    if address is not None:
        url = proxy_url(*address, job.session_id, port.token(job.session_id))
    else:
        url = port.url(job.session_id)
    env = child_env(
        base,
        job.spec.recipe,
        url,
        job.sandbox.ca,
        job.session_id,
        node_preload=not isolated,  # the host's preload path means nothing inside a container
    )
    env["PWD"] = job.sandbox.workdir
    env.update(job.task.env)
    env.update(extra)
    return env


@dataclass
class SampleOutcome:
    """How one sample of a `rollout` ended, in process (what `RolloutResult` lists and the rollout
    command prints). Its rows are in the store; the service's wire models of a sample are
    `api.SampleView` (its status, to a trainer) and `api.SampleResult` (a node's report)."""

    task_id: str
    group_id: str
    index: int
    attempt: int
    session_id: str
    status: str
    reward: float | None
    cause: str | None
    timings: dict[str, float]

    @classmethod
    def of(cls, j: SampleJob) -> SampleOutcome:
        return cls(
            task_id=j.task.id,
            group_id=j.group.id,
            index=j.index,
            attempt=j.attempt,
            session_id=j.session_id,
            status=j.final or "cancelled",
            reward=j.reward,
            cause=j.cause,
            timings=dict(j.timings),
        )


@dataclass
class RolloutResult:
    rollout_id: str
    db: str
    samples: list[SampleOutcome]
    interrupted: bool = False
    seconds: float = 0.0

    def unusable(self) -> str | None:
        """None when some sample can be trained on; else one line saying why none can (the most
        common cause, and how many samples it ended)."""
        if any(s.status in TRAINABLE for s in self.samples):
            return None
        if not self.samples:
            return "no sample ran"
        causes: dict[str, int] = {}
        for s in self.samples:
            key = f"{s.status}: {s.cause}" if s.cause else s.status
            causes[key] = causes.get(key, 0) + 1
        cause, n = max(causes.items(), key=lambda kv: kv[1])
        return f"none of the {len(self.samples)} samples can be trained on; {n} ended {cause[:300]}"

    def export(
        self, out: str | Path, *, strategy: str = "prefix-merge", normalize: str = "std", fmt: str = "parquet"
    ) -> ReconstructStats:
        """This rollout's groups written to `out` (one row per trajectory with group_id,
        sample_index, status, reward, advantage), as `polar-mitm rollout --out` writes them."""
        from polar_mitm.reconstruct.export import export
        from polar_mitm.reconstruct.source import Selection
        from polar_mitm.strategies import Normalize

        selection = Selection(rollout=self.rollout_id)
        return export(
            self.db,
            out,
            strategy=strategy,
            fmt=fmt,
            selection=selection,
            normalize=Normalize(normalize),
            quiet=True,
        )

    def by_task(self) -> dict[str, list[SampleOutcome]]:
        out: dict[str, list[SampleOutcome]] = {}
        for s in self.samples:
            out.setdefault(s.task_id, []).append(s)
        return out


def sandbox_limits(opts: RolloutOptions) -> Limits:
    """Each sample's sandbox limits by the options (a task's own memory and CPUs win: `for_task`)."""
    return Limits(
        memory_mb=opts.memory or None,
        cpus=opts.cpus or None,
        pids=opts.pids,
        tmp_mb=opts.tmp_size or None,
        home_mb=opts.home_size or None,
        allow_unenforced=opts.allow_unenforced_limits,
    )


def unenforced_limits(opts: RolloutOptions, runtime: Runtime, tasks: Sequence[Task]) -> str | None:
    """Why these tasks' samples must not start on `runtime` (prepared for them): it cannot enforce
    their limits here (Apptainer without cgroups, or without `mke2fs` for /tmp and HOME) and the
    options do not allow that (`--allow-unenforced-limits`); else None. Said before anything runs;
    each sandbox's start refuses the same (`sandbox.base.refuse_unenforced`)."""
    limits = sandbox_limits(opts)
    return next(filter(None, (unenforced_refusal(runtime, limits.for_task(t)) for t in tasks)), None)
