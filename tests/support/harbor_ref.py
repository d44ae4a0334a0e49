"""Harbor itself as the reference for Harbor tasks: `harbor run -a oracle|nop -e docker` on a
directory of task directories, and the verdict Harbor gave each one.

Harbor (`harbor` on PyPI, pinned in scripts/install.sh) lives in a virtualenv of its own under
the polar-mitm cache (`$POLAR_MITM_CACHE/venvs/harbor`, or `POLAR_MITM_HARBOR` naming the
binary) and drives Docker through Docker Compose v2 (`docker compose`). What it needs here, read
from Harbor 0.25.0's source and seen in runs:
- A task whose `[environment] docker_image` names a local image is built from it without a pull
  (its prebuilt compose file only names the image); images are never pulled here.
- The `oracle` agent uploads `solution/` to `/solution` and runs `solve.sh` as the environment's
  user (root in our images) with `DEBIAN_FRONTEND=noninteractive`; `nop` does nothing. Neither
  installs anything into the container at setup, so neither needs a network.
- The verifier (`shared` mode by default: the agent's own container) uploads `tests/` to
  `/tests`, empties the reward files, runs `tests/test.sh` and reads
  `/logs/verifier/reward.json` first, else `reward.txt`; the test script's exit status is not
  read. A trial's `result.json` holds `verifier_result.rewards` (every key of reward.json, or
  `{"reward": x}` from reward.txt), `step_results` for a multi-step task (each with its own
  `verifier_result`) and `exception_info` when the trial raised (no reward file, say).
- `network_mode = "no-network"` (or an allowlist) needs Harbor's egress-control sidecar, an image
  it builds on a base it pulls: its docker environment refuses such a task here, so the tasks
  compared keep Harbor's default (public) network and need none.
- LiteLLM, which Harbor imports, tries to fetch a model price list at start and falls back to
  its packaged copy after a few retries: `LITELLM_LOCAL_MODEL_COST_MAP=True` skips the fetch.
- One job runs a directory's tasks concurrently (`-n`); a job per agent, run at once, shares the
  machine with polar-mitm's own rollout in the comparison test.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HARBOR_VERSION = "0.25.0"  # as scripts/install.sh installs it


def harbor_binary() -> Path:
    given = os.environ.get("POLAR_MITM_HARBOR")
    if given:
        return Path(given)
    cache = Path(os.environ.get("POLAR_MITM_CACHE") or Path.home() / ".cache" / "polar-mitm")
    return cache / "venvs" / "harbor" / "bin" / "harbor"


def harbor_missing() -> str | None:
    """Why Harbor cannot run here (a reason to skip on), or None."""
    binary = harbor_binary()
    if not binary.is_file():
        return f"Harbor is not installed at {binary} (scripts/install.sh installs it; POLAR_MITM_NO_HARBOR=1 skips it)"
    if shutil.which("docker") is None:
        return "no docker CLI"
    r = subprocess.run(["docker", "compose", "version"], capture_output=True, text=True)
    if r.returncode != 0:
        return "Docker Compose v2 (`docker compose`) is missing: scripts/install.sh installs Debian's"
    return None


@dataclass
class HarborVerdict:
    """What Harbor made of one trial: `rewards` as its verifier read them (None when the trial
    raised instead), the reward a trainer gets (`reward`: the `reward` key, else the only key),
    each step's rewards for a multi-step task, and the exception's type when there was one."""

    rewards: dict[str, float] | None
    steps: list[dict[str, Any]] = field(default_factory=list)
    exception: str | None = None

    @property
    def reward(self) -> float | None:
        if not self.rewards:
            return None
        if "reward" in self.rewards:
            return float(self.rewards["reward"])
        if len(self.rewards) == 1:
            return float(next(iter(self.rewards.values())))
        return None


def start_harbor(dataset: Path, agent: str, jobs_dir: Path, *, concurrent: int = 8) -> subprocess.Popen:
    """`harbor run -a AGENT -e docker -p DATASET` in the background, its job in JOBS_DIR/AGENT;
    `finish_harbor` waits for it and reads the verdicts."""
    jobs_dir.mkdir(parents=True, exist_ok=True)
    cmd = [
        str(harbor_binary()),
        "run",
        "--agent", agent,
        "--env", "docker",
        "--path", str(dataset),
        "--jobs-dir", str(jobs_dir),
        "--job-name", agent,
        "--n-concurrent", str(concurrent),
        "--yes",
        "--quiet",
    ]  # fmt: skip
    env = {**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True", "NO_COLOR": "1"}
    log = open(jobs_dir / f"{agent}.log", "w")
    try:
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=jobs_dir)
    finally:
        log.close()


def finish_harbor(
    proc: subprocess.Popen, jobs_dir: Path, agent: str, timeout: float
) -> dict[str, HarborVerdict]:
    """Wait for a `start_harbor` job; every trial's verdict by task name."""
    try:
        rc = proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise
    log = (jobs_dir / f"{agent}.log").read_text(errors="replace")
    if rc != 0:
        raise RuntimeError(f"harbor run -a {agent} exited {rc}: {log[-3000:]}")
    return read_verdicts(jobs_dir / agent)


def run_harbor(
    dataset: Path, agent: str, jobs_dir: Path, *, timeout: float = 600
) -> dict[str, HarborVerdict]:
    """Harbor's verdict on every task in `dataset` (a directory of task directories, or one task)
    with its `oracle` or `nop` agent, by task name."""
    return finish_harbor(start_harbor(dataset, agent, jobs_dir), jobs_dir, agent, timeout)


def read_verdicts(job_dir: Path) -> dict[str, HarborVerdict]:
    """The verdicts of a finished Harbor job: each trial's result.json, by task name."""
    out: dict[str, HarborVerdict] = {}
    for result in sorted(job_dir.glob("*/result.json")):
        data = json.loads(result.read_text())
        out[data["task_name"]] = verdict_of(data)
    return out


def verdict_of(result: dict[str, Any]) -> HarborVerdict:
    """One trial's verdict from its result.json."""
    exception = (result.get("exception_info") or {}).get("exception_type")
    steps = [
        {"name": s.get("step_name"), "rewards": (s.get("verifier_result") or {}).get("rewards")}
        for s in result.get("step_results") or []
    ]
    rewards = (result.get("verifier_result") or {}).get("rewards")
    return HarborVerdict(rewards=rewards, steps=steps, exception=exception)
