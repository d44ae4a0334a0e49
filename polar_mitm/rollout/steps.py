"""Multi-step tasks (Harbor's `[[steps]]`): what the pipeline keeps of each step, when a step
ends the sample early, and how the steps' rewards make the sample's.

The pipeline (`pipeline.Pipeline._run_steps`) runs the harness once per step in one agent
sandbox. Every step but the last is scored by the same entry as a sample (`verify.score`), given
the agent's sandbox as a `KeptSandbox`: where a sample's verifier halts the agent's sandbox and
removes it, a step's kills its processes and keeps it, so a fresh verifier scores a copy of the
workdir and the next step finds the sandbox as the agent left it. The last step run is scored in
POSTRUN like any sample, and `combine` makes the sample's score, as Harbor does:
- `mean`: the mean of the scored steps' rewards (Harbor: per key, a key a step lacks counting 0,
  steps without a verifier result left out), `final`: the last scored step's;
- a step whose reward is below its `min_reward` (a number: its reward; a table: each named key of
  its rewards, a missing key counting as -inf) ends the sample: no later step runs, and `mean`
  counts the steps that ran.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from polar_mitm.proxy.certs import CA
from polar_mitm.rollout.evaluators import HarnessOutcome, Score
from polar_mitm.sandbox.base import READ_LIMIT, ExecResult, Leftover, Sandbox, SandboxError
from polar_mitm.tasks.model import Task


@dataclass
class StepRecord:
    """One step run: its name, the turns its harness made, how the harness ended, its score."""

    name: str
    turn_ids: list[str]
    outcome: HarnessOutcome
    score: Score | None = None

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "reward": self.score.reward if self.score is not None else None,
            "exit_code": self.outcome.exit_code,
            "timed_out": self.outcome.timed_out,
            "turn_ids": self.turn_ids,
            "detail": self.score.detail if self.score is not None else None,
        }


def rewards_of(score: Score) -> dict[str, float]:
    """A step's rewards by key: every key of its reward file where the evaluator kept them
    (`detail["rewards"]`), else its reward as Harbor's `reward` key."""
    kept = score.detail.get("rewards")
    if isinstance(kept, dict) and kept:
        return {str(k): float(v) for k, v in kept.items()}
    return {"reward": score.reward}


def below_min_reward(min_reward: float | dict[str, float] | None, score: Score) -> bool:
    """Whether a step's score ends the sample (Harbor's `_min_reward_failure`)."""
    if min_reward is None:
        return False
    thresholds = {"reward": min_reward} if isinstance(min_reward, int | float) else min_reward
    rewards = rewards_of(score)
    return any(rewards.get(key, float("-inf")) < threshold for key, threshold in thresholds.items())


def combine(task: Task, steps: list[StepRecord], *, stopped_early: bool) -> Score:
    """The sample's score from its scored steps, by the task's `multi_step_reward_strategy`.
    The detail lists every step (reward, exit, turns, its own detail) and keeps the last step's
    `verifier` and the steps' `suspect` reasons at its top, where a single step's would be."""
    scored = [s for s in steps if s.score is not None]
    if not scored:
        raise ValueError(f"task {task.id}: no step was scored")
    strategy = task.multi_step_reward_strategy
    if strategy == "final":
        last = scored[-1].score
        assert last is not None
        reward, rewards = last.reward, rewards_of(last)
    else:
        per_step = [rewards_of(s.score) for s in scored if s.score is not None]
        keys = sorted({k for r in per_step for k in r})
        rewards = {k: sum(r.get(k, 0.0) for r in per_step) / len(per_step) for k in keys}
        reward = sum(s.score.reward for s in scored if s.score is not None) / len(scored)
    detail: dict[str, Any] = {
        "multi_step_reward_strategy": strategy,
        "steps": [s.describe() for s in steps],
        "steps_run": len(steps),
        "steps_total": len(task.steps),
        "stopped_early": stopped_early,
    }
    if set(rewards) != {"reward"}:
        detail["rewards"] = rewards
    last_detail = scored[-1].score.detail if scored[-1].score is not None else {}
    if "verifier" in last_detail:
        detail["verifier"] = last_detail["verifier"]
    suspect = [
        f"step {s.name}: {why}"
        for s in scored
        if s.score is not None
        for why in s.score.detail.get("suspect", [])
    ]
    if suspect:
        detail["suspect"] = suspect
    return Score(reward=reward, detail=detail)


class KeptSandbox:
    """The agent's sandbox as a step's verifier sees it (`verify.score`): halting it kills every
    process in it (`kill_all`: its files stay and the next step runs there), stopping it is left
    to the pipeline. Everything else is the sandbox's own."""

    def __init__(self, sandbox: Sandbox):
        self.sandbox = sandbox
        self.name = sandbox.name
        self.workdir = sandbox.workdir
        self.ca: CA = sandbox.ca
        self.path_prefix = sandbox.path_prefix
        self.proxy_address = sandbox.proxy_address
        self.supervises = sandbox.supervises

    async def exec(
        self,
        cmd: list[str],
        *,
        env: dict[str, str] | None = None,
        timeout: float | None = None,
        workdir: str | None = None,
    ) -> ExecResult:
        return await self.sandbox.exec(cmd, env=env, timeout=timeout, workdir=workdir)

    async def exec_harness(
        self, cmd: list[str], *, env: dict[str, str] | None = None, timeout: float | None = None
    ) -> ExecResult:
        return await self.sandbox.exec_harness(cmd, env=env, timeout=timeout)

    async def kill_all(self) -> None:
        await self.sandbox.kill_all()

    async def put(self, src: Path, dest: str) -> None:
        await self.sandbox.put(src, dest)

    async def read(self, path: str, limit: int = READ_LIMIT) -> bytes | None:
        return await self.sandbox.read(path, limit)

    async def alive(self) -> bool:
        return await self.sandbox.alive()

    async def halt(self) -> None:
        """Every process ended, the sandbox kept: the agent's last chance to touch the copy."""
        await self.sandbox.kill_all()

    async def export(self, path: str, limit: int, into: BinaryIO) -> int:
        return await self.sandbox.export(path, limit, into)

    async def put_tar(self, dest: str, data: BinaryIO) -> None:
        await self.sandbox.put_tar(dest, data)

    async def processes(self) -> list[Leftover]:
        return await self.sandbox.processes()

    async def seal(self) -> list[Leftover]:
        raise SandboxError(
            f"{self.name}: a sandbox kept for the next step is never sealed (a fresh verifier scores it)"
        )

    async def exec_sealed(
        self,
        cmd: list[str],
        *,
        env: dict[str, str] | None = None,
        timeout: float | None = None,
        workdir: str | None = None,
    ) -> tuple[ExecResult, list[Leftover]]:
        raise SandboxError(
            f"{self.name}: a sandbox kept for the next step is never sealed (a fresh verifier scores it)"
        )

    def describe(self) -> dict[str, Any]:
        return {**self.sandbox.describe(), "kept_for_the_next_step": True}

    async def stop(self) -> None:
        """Left to the pipeline: the next step runs here."""
