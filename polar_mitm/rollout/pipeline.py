"""The gateway-node pipeline: tasks × samples through INIT → READY → RUN → POSTRUN.

```
queue ──▶ INIT workers: start a sandbox, run the task's setup      (init_workers at once)
          READY: a bounded buffer of warm sandboxes                 (ready_size, default run_workers)
          RUN workers: the harness in its sandbox, through the proxy (run_workers at once)
          POSTRUN workers: halt it, score in a fresh one, record     (postrun_workers at once)
```

Sandboxes start ahead of time, so a RUN worker never waits for one while the buffer holds any.
The stages are sized for the pipeline, whatever runs in it: each sample carries what runs for it
(a `SampleSpec`: the harness, its command, the runtime, resolved where its task entered), so one
pipeline serves every harness a node is sent and `run_workers` bounds the harnesses running at
once across all of them. The pipeline keeps only sizes, retries and timeouts (`RolloutOptions`).
Every sample is a session of the shared proxy with a token of its own (the proxy lets in no
session it did not issue), so its turns are recorded token-exactly like any `run`; the session
carries its recipe, whose rules tag its side calls. The pipeline sees the proxy through a small
port (`rollout/port.py`) and the store. A container sample reaches the proxy only through its own
channel (`sandbox/channel.py`), which names the session itself: nothing the sandbox sends makes it
another sample.

Outcomes (each recorded in the store's `samples` table, never dropped):
- `completed`: the harness ended and the evaluator scored it.
- `agent_timeout`: the harness overran its time and was killed; its turns stay trainable, reward 0.
- `failed`: the sandbox or the evaluator failed (`retries` times over, for sandbox failures); its
  rows are masked in exports (loss_mask 0, reward 0) and flagged with the cause.
- `retried`: an attempt that failed and was run again as a new attempt (a new session).
- `cancelled`: early stop (`early_stop` usable samples of its group were in) or an interrupt.

The pipeline is a library: `run_rollout` (rollout/run.py) drives it for the command line and for
Python, and a node hosts one the same way."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

from polar_mitm.outcomes import TRAINABLE
from polar_mitm.proxy.embedded import PolarProxy
from polar_mitm.rollout import verify
from polar_mitm.rollout.evaluators import EvaluatorError, HarnessOutcome, Score
from polar_mitm.rollout.jobs import (  # noqa: F401 - named here too, where users found them
    ROLLOUT_LABEL,
    STAGES,
    GroupState,
    RolloutResult,
    SampleJob,
    SampleOutcome,
    Stage,
    harness_env,
    sandbox_spec,
    unenforced_limits,
)
from polar_mitm.rollout.options import RolloutOptions
from polar_mitm.rollout.port import ProxyPort, SessionPort, new_token  # noqa: F401
from polar_mitm.rollout.spec import SampleSpec, Specs
from polar_mitm.rollout.steps import KeptSandbox, StepRecord, below_min_reward, combine
from polar_mitm.rollout.verify import VerifierUnavailable
from polar_mitm.sandbox.base import LimitsUnenforced, Runtime, RuntimeUnavailable, SandboxError, SandboxSpec
from polar_mitm.sandbox.channel import Channel, open_channel
from polar_mitm.store.rollouts import RolloutLog
from polar_mitm.tasks.model import Task, TaskStep

log = logging.getLogger("polar_mitm.rollout")

FORWARDER_START_SEC = 30.0  # a sandbox's forwarder says it listens within this


class SandboxDied(SandboxError):
    """The sandbox stopped existing under a running sample."""


class _Cancelled(Exception):
    """The job was cancelled (early stop); not an error."""


class Pipeline:
    """Stage workers sized by `options` (its sizes, retries, timeouts and limits); each sample is
    added with the `SampleSpec` it runs. `proxy` is the embedded proxy (seen through `ProxyPort`)
    or any `SessionPort`. `runtime` serves only `run(tasks)` without a spec, which resolves one
    from the options' harness (a convenience for callers that built `RolloutOptions` with one)."""

    def __init__(
        self,
        options: RolloutOptions,
        proxy: PolarProxy | SessionPort,
        runtime: Runtime | None = None,
        *,
        work_dir: Path,
        on_change: Callable[[Pipeline], None] | None = None,
        rollout_id: str | None = None,
    ):
        self.opts = options
        self._proxy = proxy
        self.port: SessionPort | None = None  # made when the pipeline starts
        self.runtime = runtime
        self.work_dir = work_dir
        self.on_change = on_change
        self.rollout_id = rollout_id or f"ro_{uuid.uuid4().hex[:12]}"
        self.counts: Counter[str] = Counter()  # stage -> jobs in it; plus passed / failed tallies
        self.outcomes: Counter[str] = Counter()
        self.jobs: list[SampleJob] = []
        self.groups: list[GroupState] = []
        self._log: RolloutLog | None = None
        self._ready: asyncio.Queue[SampleJob] | None = None
        self._init_q: asyncio.Queue[SampleJob | None] = asyncio.Queue()
        self._post_q: asyncio.Queue[SampleJob | None] = asyncio.Queue()
        self._remaining = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._groups: dict[str, GroupState] = {}
        self._workers: list[asyncio.Task] = []
        self._runtimes: list[Runtime] = []  # the samples' runtimes, cleaned up at the end
        # Called with each sample once its outcome is recorded (a node reports it to its server).
        self.on_done: Callable[[SampleJob], Awaitable[None]] | None = None

    # -- public ---------------------------------------------------------------------------------

    async def run(self, tasks: Sequence[Task], spec: SampleSpec | None = None) -> RolloutResult:
        """Run every task `samples` times with `spec`; returns when every sample has an outcome.
        Cancelling this coroutine (Ctrl-C) stops every sandbox; the unfinished samples: cancelled."""
        t0 = time.monotonic()
        if spec is None:
            assert self.opts.harness is not None and self.runtime is not None, "no harness or runtime given"
            spec = await Specs().get(self.opts.harness, self.opts.harness_cmd, self.runtime)
        for t in tasks:  # every task checked and its image ready before anything is recorded
            spec.check(t)
        for t in tasks:
            await spec.runtime.prepare(t)
        refused = unenforced_limits(self.opts, spec.runtime, tasks)
        if refused is not None:
            raise RuntimeUnavailable(refused)
        await self.start(tasks=[t.id for t in tasks])
        interrupted = False
        try:
            for t in tasks:
                await self.add(t, spec=spec)
            await self.drain()
        except asyncio.CancelledError:
            interrupted = True
            raise
        finally:
            await asyncio.shield(self.close(interrupted))
        assert self.port is not None
        samples = [SampleOutcome.of(j) for j in self.jobs]
        return RolloutResult(
            self.rollout_id, self.port.store.path, samples, interrupted, seconds=time.monotonic() - t0
        )

    async def start(self, **config: Any) -> None:
        """Start the stage workers; samples come with `add` (a long-lived pipeline, e.g. a node's)."""
        proxy = self._proxy
        self.port = ProxyPort(proxy) if isinstance(proxy, PolarProxy) else proxy
        self._log = RolloutLog(self.port.store)
        self._ready = asyncio.Queue(maxsize=self.opts.ready_size or self.opts.run_workers)
        await self._log.begin_rollout(self.rollout_id, {**self.opts.model_dump(), **config})
        self._workers = (
            [asyncio.create_task(self._init_worker(), name=f"init{i}") for i in range(self.opts.init_workers)]
            + [asyncio.create_task(self._run_worker(), name=f"run{i}") for i in range(self.opts.run_workers)]
            + [
                asyncio.create_task(self._post_worker(), name=f"post{i}")
                for i in range(self.opts.postrun_workers)
            ]
        )

    async def add(
        self,
        task: Task,
        *,
        spec: SampleSpec,
        indices: Sequence[int] | None = None,
        group_id: str | None = None,
        size: int | None = None,
    ) -> list[SampleJob]:
        """Queue samples of `task` running `spec` (indices 0…samples-1 by default) in its group
        (made on first use)."""
        assert self._log is not None, "start the pipeline first"
        spec.check(task)
        if all(r is not spec.runtime for r in self._runtimes):
            self._runtimes.append(spec.runtime)
        if self.opts.reward_key is not None and task.evaluator.reward_key is None:
            # Decided here, where the task enters, and carried with it (the task's own wins).
            task = task.model_copy(
                update={"evaluator": task.evaluator.model_copy(update={"reward_key": self.opts.reward_key})}
            )
        await spec.runtime.prepare(task)
        gid = group_id or f"{self.rollout_id}/{task.id}"
        g = self._groups.get(gid)
        if g is None:
            g = GroupState(id=gid, task=task, size=size or self.opts.samples)
            self._groups[gid] = g
            self.groups.append(g)
            await self._log.add_group(g.id, self.rollout_id, task.id, g.size, task.model_dump_json())
        jobs = []
        for i in indices if indices is not None else range(g.size):
            job = SampleJob(task=task, group=g, index=i, spec=spec)
            g.jobs.append(job)
            self.jobs.append(job)
            jobs.append(job)
            await self._new_attempt(job)
            self._remaining += 1
            self._idle.clear()
            self._init_q.put_nowait(job)
        return jobs

    async def drain(self) -> None:
        """Wait until every sample added so far has an outcome."""
        await self._idle.wait()

    def cancel(self, job: SampleJob, reason: str) -> None:
        """Cancel one sample wherever it is (queued, starting, running, scoring)."""
        if job.final is not None:
            return
        job.cancel_reason = reason
        if job.current is not None and not job.current.done():
            job.current.cancel()

    async def close(self, interrupted: bool = False) -> None:
        """Stop the workers; nothing unrecorded, nothing left running."""
        for w in self._workers:
            w.cancel()
        await asyncio.gather(*self._workers, return_exceptions=True)
        self._workers = []
        await self._finish(interrupted)

    # -- set-up ---------------------------------------------------------------------------------

    def _check_task(self, task: Task, spec: SampleSpec | None = None) -> None:
        """`spec.check(task)`; without a spec, the options' harness and runtime (nothing resolved)."""
        if spec is None:
            from polar_mitm import recipes

            assert self.opts.harness is not None and self.runtime is not None
            spec = SampleSpec(recipes.get(self.opts.harness), self.opts.harness_cmd, self.runtime, None)
        spec.check(task)

    async def _new_attempt(self, job: SampleJob) -> None:
        assert self._log is not None and self.port is not None
        job.session_id = f"s_{uuid.uuid4().hex[:16]}"
        job.stage, job.sandbox, job.outcome, job.timings = "queued", None, None, {}
        job.steps, job.stopped_early = [], False
        self.counts["queued"] += 1
        spec = job.spec
        await self.port.store.ensure_session(
            job.session_id,
            task_id=job.task.id,
            harness=spec.recipe.name,
            command=spec.command(job.task.instruction),
            secret_flags=spec.recipe.secret_flags,
            metadata={
                "rollout": self.rollout_id,
                "group": job.group.id,
                "sample_index": job.index,
                "attempt": job.attempt,
                "runtime": spec.runtime.name,
                "backend": self.port.backend_url,
            },
        )
        await self._log.add_sample(job.session_id, job.group.id, job.index, job.attempt, "queued")
        self.port.issue(job.session_id, spec.recipe.name)  # its side calls tagged by its recipe
        self.port.contain(job.session_id, job.task.allowed_hosts, isolated=spec.runtime.isolated)
        self.port.deny(job.session_id, internet=not job.task.allow_internet)

    def _move(self, job: SampleJob, stage: Stage) -> None:
        now = time.monotonic()
        if job.mark:
            job.timings[job.stage] = job.timings.get(job.stage, 0.0) + (now - job.mark)
        self.counts[job.stage] -= 1
        self.counts[stage] += 1
        job.stage, job.mark = stage, now
        if self.on_change is not None:
            self.on_change(self)

    def _budget(self, job: SampleJob, stage_limit: float | None = None) -> float | None:
        """Seconds this stage may take: its own limit, within what the total budget has left."""
        total = self.opts.total_timeout or job.task.total_timeout_sec
        if total is None:
            return stage_limit
        left = max(0.0, total - (time.monotonic() - job.started))
        return left if stage_limit is None else min(stage_limit, left)

    # -- stages ---------------------------------------------------------------------------------

    async def _stage(self, job: SampleJob, coro: Any) -> Any:
        """Run one stage's work so that early stop can cancel it without cancelling the worker."""
        job.current = asyncio.ensure_future(coro)
        try:
            return await job.current
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if job.cancel_reason and task is not None and not task.cancelling():
                raise _Cancelled(job.cancel_reason) from None
            raise
        finally:
            job.current = None

    async def _init_worker(self) -> None:
        while True:
            job = await self._init_q.get()
            if job is None:
                return
            if job.cancel_reason or job.group.stopped:
                await self._cancel(job, job.cancel_reason or job.group.stopped or "cancelled")
                continue
            job.started = time.monotonic()
            self._move(job, "starting")
            try:
                await self._stage(job, self._start_sandbox(job))
            except _Cancelled as e:
                await self._cancel(job, str(e))
                continue
            except (SandboxError, EvaluatorError, OSError, TimeoutError, RuntimeError) as e:
                await self._infra_failure(job, f"sandbox start: {_describe(e)}", e)
                continue
            except Exception as e:
                await self._internal_error(job, "sandbox start", e)
                continue
            self._move(job, "ready")
            assert self._ready is not None
            await self._ready.put(job)  # blocks while the READY buffer is full

    async def _start_sandbox(self, job: SampleJob) -> None:
        assert self.port is not None
        job.session_dir = self.work_dir / job.session_id
        job.session_dir.mkdir(parents=True, exist_ok=True)
        (job.session_dir / "home").mkdir(exist_ok=True)
        job.spec.recipe.write_home_files(job.session_dir / "home")  # before the sandbox can touch it
        if job.spec.runtime.isolated:
            token = self.port.issue(job.session_id)
            job.channel = await open_channel(job.session_id, token, serve=self.port.adopt)
        spec = self._sandbox_spec(job)
        job.sandbox = await asyncio.wait_for(job.spec.runtime.start(job.task, spec), self._budget(job))
        for up in job.task.uploads:
            await asyncio.wait_for(job.sandbox.put(up.source, up.target), self._budget(job))
        for n, line in enumerate(job.task.setup, 1):
            r = await job.sandbox.exec(["sh", "-c", line], env=job.task.env, timeout=self._budget(job))
            if r.exit_code != 0:
                raise SandboxError(f"setup step {n} ({line[:60]!r}) exited {r.exit_code}: {r.output[-300:]}")

    def _sandbox_spec(self, job: SampleJob) -> SandboxSpec:
        assert self.port is not None
        return sandbox_spec(job, self.port.ca, self.rollout_id, self.opts)

    async def _run_worker(self) -> None:
        assert self._ready is not None
        while True:
            job = await self._ready.get()
            if job.cancel_reason or job.group.stopped:
                await self._cancel(job, job.cancel_reason or job.group.stopped or "cancelled")
                continue
            self._move(job, "running")
            try:
                await self._stage(job, self._run_harness(job))
            except _Cancelled as e:
                await self._cancel(job, str(e))
                continue
            except SandboxDied as e:
                await self._infra_failure(job, f"sandbox died: {_describe(e)}")
                continue
            except EvaluatorError as e:  # scoring a multi-step task's step
                await self._finish_job(job, "failed", reward=0.0, cause=f"evaluator: {_describe(e)}")
                continue
            except (SandboxError, OSError, RuntimeError) as e:
                await self._infra_failure(job, f"harness run: {_describe(e)}")
                continue
            except Exception as e:
                await self._internal_error(job, "harness run", e)
                continue
            self._move(job, "scoring")
            self._post_q.put_nowait(job)

    @contextlib.asynccontextmanager
    async def _verifier_channel(self, job: SampleJob) -> AsyncIterator[Channel]:
        """A channel for the sample's verifier, in a session of its own: contained like the agent's
        (never this machine), and with the model refused; gone once the sample is scored."""
        assert self.port is not None
        port, session = self.port, f"{job.session_id}-verifier"
        token = port.issue(session)
        port.contain(session, job.task.allowed_hosts, isolated=True)
        port.deny(session, model=True)
        channel = await open_channel(session, token, serve=port.adopt)
        try:
            yield channel
        finally:
            await asyncio.shield(channel.close())
            port.release(session)
            port.revoke(session)

    async def _run_harness(self, job: SampleJob) -> None:
        if job.task.steps:
            await self._run_steps(job)
            return
        job.outcome = await self._harness(job, job.task, "harness.log")

    async def _harness(self, job: SampleJob, task: Task, log_name: str) -> HarnessOutcome:
        """One run of the harness on `task`'s instruction in the sample's sandbox."""
        assert job.sandbox is not None and self.port is not None
        cmd = job.spec.command(task.instruction)
        if job.channel is not None and job.sandbox.proxy_address is not None:
            # Set long before, as a rule (the forwarder starts with the sandbox); the harness never
            # starts before its way to the proxy is open.
            try:
                await job.channel.wait_ready(FORWARDER_START_SEC)
            except TimeoutError:
                raise SandboxError(
                    f"the proxy forwarder in the sandbox did not start within {FORWARDER_START_SEC:.0f} s"
                ) from None
        limit = self.opts.agent_timeout or task.agent_timeout_sec
        r = await job.sandbox.exec_harness(
            cmd, env=harness_env(job, self.port, self.opts.env), timeout=self._budget(job, limit)
        )
        if job.session_dir is not None:
            write_new(job.session_dir / log_name, r.output)
        if not await job.sandbox.alive():
            raise SandboxDied(f"while the harness ran (exit {r.exit_code}): {r.output[-300:]}")
        return HarnessOutcome(exit_code=r.exit_code, timed_out=r.timed_out)

    async def _run_steps(self, job: SampleJob) -> None:
        """A multi-step task: each step's files put in the workdir, the harness run on the step's
        instruction, in one sandbox. Every step but the last is scored here, in a fresh verifier
        from a copy of the workdir while the agent's sandbox is kept (`steps.KeptSandbox`); a
        reward below the step's min_reward ends the sample there. The last step run is scored in
        POSTRUN, like a single-step task's."""
        assert job.sandbox is not None and self._log is not None
        steps = job.task.steps
        for i, step in enumerate(steps):
            task = job.task.step_task(step)
            await self._prepare_step(job, step)
            seen = set(await self._log.turn_ids(job.session_id))
            job.outcome = await self._harness(job, task, f"harness-{i + 1}-{step.name}.log")
            turns = [t for t in await self._log.turn_ids(job.session_id) if t not in seen]
            job.steps.append(StepRecord(step.name, turns, job.outcome))
            if i == len(steps) - 1 or job.outcome.timed_out:
                return  # POSTRUN scores it (an agent timeout ends the sample, as it ends one step)
            score = await self._score_step(job, task, job.outcome)
            job.steps[-1].score = score
            if below_min_reward(step.min_reward, score):
                job.stopped_early = True
                return

    async def _prepare_step(self, job: SampleJob, step: TaskStep) -> None:
        """A step's `workdir/` files copied into the workdir, then its `setup.sh` run there."""
        assert job.sandbox is not None
        if step.workdir_dir is None:
            return
        workdir = job.sandbox.workdir
        await job.sandbox.put(step.workdir_dir, workdir)
        if (step.workdir_dir / "setup.sh").is_file():
            r = await job.sandbox.exec(
                ["bash", f"{workdir.rstrip('/')}/setup.sh"],
                env=job.task.env,
                timeout=self._budget(job),
                workdir=workdir,
            )
            if r.exit_code != 0:
                raise SandboxError(f"step {step.name}: setup.sh exited {r.exit_code}: {r.output[-300:]}")

    async def _score_step(self, job: SampleJob, task: Task, outcome: HarnessOutcome) -> Score:
        """An intermediate step's score, by the same entry as a sample's (`verify.score`), given
        the agent's sandbox as a `KeptSandbox`: its processes killed, its workdir copied to a
        fresh verifier, the sandbox itself kept for the next step."""
        assert job.sandbox is not None
        runtime = job.spec.runtime
        work = verify.score(
            runtime,
            task,
            KeptSandbox(job.sandbox),
            self._sandbox_spec(job),
            outcome,
            open_channel=(lambda: self._verifier_channel(job)) if runtime.isolated else None,
        )
        score = await asyncio.wait_for(work, self._budget(job, task.evaluator.timeout_sec + 60))
        verifier = score.detail.get("verifier")
        if isinstance(verifier, dict) and verifier.get("sandbox") == "fresh":
            verifier["agent_kept"] = "its processes killed before the copy, its files kept for the next step"
        if not await job.sandbox.alive():
            raise SandboxDied(
                f"sandbox died: while scoring step {len(job.steps)}: {job.sandbox.name} is gone"
            )
        return score

    async def _post_worker(self) -> None:
        while True:
            job = await self._post_q.get()
            if job is None:
                return
            try:
                score = await self._stage(job, self._score(job))
            except _Cancelled as e:
                await self._cancel(job, str(e))
                continue
            except (SandboxDied, VerifierUnavailable) as e:
                # The harness's result cannot be scored: run the sample again like any sandbox failure.
                await self._infra_failure(job, _describe(e))
                continue
            except (SandboxError, EvaluatorError, OSError, TimeoutError, RuntimeError) as e:
                if self._scores_in_place(job) and job.sandbox is not None and not await job.sandbox.alive():
                    # Killed under us while scoring in the agent's sandbox.
                    await self._infra_failure(job, f"sandbox died: while scoring: {_describe(e)}")
                else:
                    await self._finish_job(job, "failed", reward=0.0, cause=f"evaluator: {_describe(e)}")
                continue
            except Exception as e:
                await self._internal_error(job, "scoring", e)
                continue
            assert job.outcome is not None
            refused = self._egress_refused(job, score)
            if refused and self.opts.mask_egress_refused and not job.outcome.timed_out:
                # The verifier could not fetch what it needed: its 0 says nothing of the agent.
                hosts = ", ".join(sorted(refused))
                await self._finish_job(
                    job,
                    "failed",
                    reward=0.0,
                    cause=f"the verifier's network requests were refused ({hosts}); see --egress-allow",
                    detail=score.detail,
                )
                continue
            if job.outcome.timed_out:
                # Trainable: the harness did work until it was stopped; it gets no credit for it.
                await self._finish_job(
                    job, "agent_timeout", reward=0.0, cause="agent timeout", detail=score.detail
                )
            else:
                await self._finish_job(job, "completed", reward=score.reward, detail=score.detail)

    def _egress_refused(self, job: SampleJob, score: Score) -> dict[str, int]:
        """The hosts the proxy refused to the sample's agent and verifier, recorded in its
        reward_detail (`egress_refused`); returns the verifier's."""
        assert self.port is not None
        agent = self.port.refused(job.session_id)
        verifier = self.port.refused(f"{job.session_id}-verifier")
        if agent or verifier:
            score.detail["egress_refused"] = {"agent": agent, "verifier": verifier}
        return verifier

    def _scores_in_place(self, job: SampleJob) -> bool:
        return not job.spec.runtime.fresh_verifier or job.task.evaluator.kind == "session_completed"

    async def _score(self, job: SampleJob) -> Score:
        """The evaluator's score; on runtimes with fresh sandboxes, in a new one holding the agent's
        artefacts, started once the agent's sandbox was halted (rollout/verify.py). A multi-step
        task's: its last step run scored so, then the steps' rewards combined (`steps.combine`)."""
        assert job.sandbox is not None and job.outcome is not None
        if not await job.sandbox.alive():
            raise SandboxDied(f"sandbox died: while scoring: {job.sandbox.name} is gone")
        task = job.task
        if task.steps:
            if job.stopped_early:
                return combine(task, job.steps, stopped_early=True)
            task = task.step_task(task.steps[len(job.steps) - 1])
        limit = task.evaluator.timeout_sec + 60
        runtime = job.spec.runtime
        work = verify.score(
            runtime,
            task,
            job.sandbox,
            self._sandbox_spec(job),
            job.outcome,
            open_channel=(lambda: self._verifier_channel(job)) if runtime.isolated else None,
        )
        score = await asyncio.wait_for(work, self._budget(job, limit))
        if not job.task.steps:
            return score
        job.steps[-1].score = score
        return combine(job.task, job.steps, stopped_early=False)

    # -- outcomes -------------------------------------------------------------------------------

    async def _infra_failure(self, job: SampleJob, cause: str, error: Exception | None = None) -> None:
        log.warning("task %s sample %d attempt %d: %s", job.task.id, job.index, job.attempt, cause)
        retry = not isinstance(error, LimitsUnenforced)  # (the same on every attempt)
        if retry and job.attempt < self.opts.retries and not (job.group.stopped or job.cancel_reason):
            await self._finish_job(job, "retried", reward=None, cause=cause, final=False)
            job.attempt += 1
            await self._new_attempt(job)
            self._init_q.put_nowait(job)
            return
        await self._finish_job(job, "failed", reward=0.0, cause=cause)

    async def _internal_error(self, job: SampleJob, stage: str, e: Exception) -> None:
        """An exception no stage expects (a bug): the sample fails with it, logged with its
        traceback, and the worker goes on. Not retried, since a bug comes back; and a worker that
        ended here would leave the rollout waiting for a sample no worker holds."""
        log.error("task %s sample %d: %s: internal error", job.task.id, job.index, stage, exc_info=e)
        await self._finish_job(job, "failed", reward=0.0, cause=f"{stage}: internal error: {_describe(e)}")

    async def _cancel(self, job: SampleJob, reason: str) -> None:
        await self._finish_job(job, "cancelled", reward=None, cause=reason)

    async def _finish_job(
        self,
        job: SampleJob,
        status: str,
        *,
        reward: float | None,
        cause: str | None = None,
        detail: dict[str, Any] | None = None,
        final: bool = True,
    ) -> None:
        """Record the attempt's outcome once nothing of it runs (`_teardown`); a final one counted
        in its group (`GroupState.record`), which may stop the rest of the group."""
        assert self._log is not None
        await self._teardown(job)
        self._move(job, "done" if final else "queued")
        if not final:
            self.counts["queued"] -= 1  # _new_attempt counts it again
        exit_code = job.outcome.exit_code if job.outcome else None
        timings = {k: round(v, 3) for k, v in job.timings.items()}
        await asyncio.shield(
            self._log.finish_sample(
                job.session_id,
                status=status,
                reward=reward,
                cause=cause,
                detail=detail,
                exit_code=exit_code,
                timings=timings,
            )
        )
        await self._remove_workdir(job)
        if not final:
            return
        g = job.group
        g.record(job, status, reward, cause)
        self.outcomes[status] += 1
        if status in TRAINABLE:
            self.outcomes["passed" if (reward or 0.0) >= 1.0 else "not_passed"] += 1
        if reason := g.early_stop(self.opts.early_stop):
            g.stop(reason)
        if g.finished == g.size:
            await self._log.end_group(g.id, "early_stopped" if g.stopped else "done")
        if self.on_change is not None:
            self.on_change(self)
        if self.on_done is not None:
            try:
                await self.on_done(job)
            except Exception:
                log.exception("reporting sample %s", job.session_id)
        self._remaining -= 1
        if self._remaining == 0:
            self._idle.set()

    async def _teardown(self, job: SampleJob) -> None:
        """Nothing of the attempt runs any more: its sandbox stopped, its channel closed, its
        session revoked and its egress rules released."""
        assert self.port is not None
        if job.sandbox is not None:
            try:
                await asyncio.shield(job.sandbox.stop())
            except Exception as e:  # never lose the outcome over a failed removal
                log.warning("stopping the sandbox of %s: %s", job.session_id, e)
            job.sandbox = None
        if job.channel is not None:
            await asyncio.shield(job.channel.close())
            job.channel = None
        self.port.revoke(job.session_id)
        self.port.release(job.session_id)

    async def _remove_workdir(self, job: SampleJob) -> None:
        if job.session_dir is not None and not self.opts.keep_workdirs:
            # A harness's HOME holds hundreds of files: removed off the event loop.
            await asyncio.to_thread(shutil.rmtree, job.session_dir, ignore_errors=True)

    async def _finish(self, interrupted: bool) -> None:
        """After the workers stopped: nothing unrecorded, nothing left running."""
        assert self._log is not None
        for job in self.jobs:
            if job.final is None:
                await self._finish_job(job, "cancelled", reward=None, cause="interrupted")
        # Any sandbox a crash left behind (a worker cancelled mid-start): found by label.
        for runtime in self._runtimes:
            await runtime.cleanup({ROLLOUT_LABEL: self.rollout_id})
        await self._log.end_rollout(self.rollout_id, "interrupted" if interrupted else "done")


def _describe(e: BaseException) -> str:
    text = str(e) or e.__class__.__name__
    return text if len(text) < 600 else text[:600] + "…"


def write_new(path: Path, text: str) -> None:
    """Write a file that must not exist yet, never through a link: a sandbox (or a harness on the
    host) that planted one there gets an error logged, not a host file overwritten."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except OSError as e:
        log.warning("not writing %s: %s", path, e)
        return
    with os.fdopen(fd, "w") as f:
        f.write(text)
