"""Harbor (Terminal-Bench) task directories, and task sets: directories of them.

A task directory holds `instruction.md`, an optional `task.toml`, `environment/Dockerfile` (unless
task.toml names a `docker_image`), `tests/test.sh` (the verifier) and optionally `solution/solve.sh`.
task.toml is read by `HarborTaskConfig` with Harbor's section and field names; fields we do not use
are ignored, since Harbor adds some over time, but a known field of the wrong type is an error.

A multi-step task lists `[[steps]]` in task.toml instead of one instruction.md: each step's files
are under `steps/NAME/` (`instruction.md`; optionally `tests/`, laid over the task's `tests/` as
Harbor uploads them, whose `test.sh` wins; `solution/`; `workdir/`, copied into the workdir
before the step, then its setup script, if any, run there). docs/tasks.md compares every field with Harbor's.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from polar_mitm.tasks.model import EvaluatorSpec, Task, TaskFileError, TaskStep
from polar_mitm.tasks.plain import read_document, read_text

HARBOR_WORKDIR = "/app"  # where Terminal-Bench images put the task's files
NetworkMode = Literal["public", "no-network", "allowlist"]


class _Section(BaseModel):
    model_config = ConfigDict(extra="ignore")


class AgentSection(_Section):
    timeout_sec: float = 600.0
    network_mode: NetworkMode | None = None  # overrides [environment]'s while the agent runs
    allowed_hosts: list[str] = Field(default_factory=list)


class VerifierSection(_Section):
    timeout_sec: float = 600.0
    env: dict[str, str] = Field(default_factory=dict)
    # Ours, beside Harbor's: whether the verifier may reach the internet (None: as the task's
    # [environment] says; Harbor's [agent] network_mode applies while the agent runs only).
    allow_internet: bool | None = None
    # Harbor's: "shared" (the agent's environment, its default) or "separate"; a
    # [verifier.environment] of its own means separate.
    environment_mode: Literal["shared", "separate"] | None = None
    environment: dict[str, Any] | None = None
    # Ours: which key of a multi-key reward.json the trainer gets (or mean/min/max).
    reward_key: str | None = None


class EnvironmentSection(_Section):
    docker_image: str | None = None
    cpus: float | None = None
    memory_mb: int | None = None
    memory: str | None = None  # legacy: "2G", "512M"
    workdir: str = HARBOR_WORKDIR
    env: dict[str, str] = Field(default_factory=dict)
    allow_internet: bool | None = None  # legacy; network_mode wins
    network_mode: NetworkMode | None = None
    allowed_hosts: list[str] = Field(default_factory=list)
    build_timeout_sec: float | None = None

    @field_validator("memory")
    @classmethod
    def _size(cls, value: str | None) -> str | None:
        if value is not None:
            memory_mb_of(value)
        return value


class StepAgentSection(_Section):
    timeout_sec: float | None = None  # None: the task's [agent]


class StepVerifierSection(_Section):
    timeout_sec: float | None = None  # None: the task's [verifier]
    env: dict[str, str] = Field(default_factory=dict)  # over the task's [verifier] env


class StepSection(_Section):
    """One `[[steps]]` table."""

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")  # a directory under steps/
    agent: StepAgentSection = Field(default_factory=StepAgentSection)
    verifier: StepVerifierSection = Field(default_factory=StepVerifierSection)
    min_reward: float | dict[str, float] | None = None


class HarborTaskConfig(_Section):
    """task.toml: every section and field optional."""

    metadata: dict[str, Any] = Field(default_factory=dict)
    agent: AgentSection = Field(default_factory=AgentSection)
    verifier: VerifierSection = Field(default_factory=VerifierSection)
    environment: EnvironmentSection = Field(default_factory=EnvironmentSection)
    steps: list[StepSection] | None = None
    multi_step_reward_strategy: Literal["mean", "final"] | None = None


_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([kmgt])i?b?\s*", re.IGNORECASE)
_MB_PER_UNIT = {"k": 1 / 1024, "m": 1, "g": 1024, "t": 1024 * 1024}


def memory_mb_of(size: str) -> int:
    """Megabytes in a size string of Harbor's legacy `memory` field: "2G" -> 2048, "512M" -> 512."""
    match = _SIZE.fullmatch(size)
    if match is None:
        raise ValueError("expected a size like '2G' or '512M'")
    return max(1, round(float(match[1]) * _MB_PER_UNIT[match[2].lower()]))


def is_harbor_task(directory: Path) -> bool:
    """A task directory: its instruction.md, or a task.toml listing `[[steps]]` (a multi-step task)."""
    if (directory / "instruction.md").is_file():
        return True
    config = directory / "task.toml"
    return config.is_file() and (directory / "steps").is_dir() and "[[steps]]" in read_text(config)


def load_harbor(directory: Path) -> list[Task]:
    """One Harbor task directory, or a task set: the subdirectories holding `instruction.md`, by name.

    A subdirectory without instruction.md is skipped, unless it has a task.toml (a broken task).
    """
    if is_harbor_task(directory):
        return [load_harbor_task(directory)]
    tasks = []
    for child in sorted(p for p in directory.iterdir() if p.is_dir()):
        if is_harbor_task(child):
            tasks.append(load_harbor_task(child))
        elif (child / "task.toml").is_file():
            raise TaskFileError(
                child,
                "has task.toml but no instruction.md (the task's instruction) nor [[steps]] with steps/",
            )
    if not tasks:
        raise TaskFileError(
            directory,
            "not a Harbor task (no instruction.md) nor a task set (no subdirectory holds one); "
            "give plain task files (.toml, .yaml, .json) or SWE-bench rows (.jsonl) by their own path",
        )
    return tasks


def load_harbor_task(directory: Path) -> Task:
    """The task in one Harbor task directory; its id is the directory's name."""
    directory = directory.absolute()
    config = _read_config(directory / "task.toml")
    tests_dir = directory / "tests"
    steps = _steps(directory, config) if config.steps else []
    if steps:
        instruction = steps[0].instruction
    else:
        instruction = read_text(directory / "instruction.md")
        if not instruction.strip():
            raise TaskFileError(directory / "instruction.md", "empty: it should hold the task's instruction")
        if not (tests_dir / "test.sh").is_file():
            raise TaskFileError(tests_dir / "test.sh", "missing: Harbor's verifier runs it to score the task")
    env = config.environment
    dockerfile = directory / "environment" / "Dockerfile"
    allow_internet, metadata = _network(config)
    verifier_internet = _verifier_network(config)
    memory_mb = env.memory_mb
    if memory_mb is None and env.memory is not None:
        memory_mb = memory_mb_of(env.memory)
    if env.build_timeout_sec is not None:
        metadata["build_timeout_sec"] = env.build_timeout_sec
    try:
        return Task(
            id=directory.name,
            instruction=instruction,
            image=env.docker_image,
            dockerfile=dockerfile if env.docker_image is None and dockerfile.is_file() else None,
            workdir=env.workdir,
            env=resolve_env(env.env, directory / "task.toml", "[environment.env]"),
            allow_internet=allow_internet,
            allowed_hosts=list(metadata.get("allowed_hosts") or []),
            cpus=env.cpus,
            memory_mb=memory_mb,
            agent_timeout_sec=config.agent.timeout_sec,
            evaluator=steps[0].evaluator
            if steps
            else EvaluatorSpec(
                kind="harbor",
                tests_dir=tests_dir,
                timeout_sec=config.verifier.timeout_sec,
                env=resolve_env(config.verifier.env, directory / "task.toml", "[verifier.env]"),
                internet=verifier_internet,
                reward_key=config.verifier.reward_key,
                environment_mode=config.verifier.environment_mode
                or ("separate" if config.verifier.environment is not None else None),
            ),
            source=str(directory),
            metadata=metadata,
            steps=steps,
            multi_step_reward_strategy=config.multi_step_reward_strategy or "mean",
        )
    except ValidationError as e:
        raise TaskFileError.from_validation(directory, e) from None


_TEMPLATE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-(.*))?\}")


def resolve_env(env: dict[str, str], source: Path, section: str) -> dict[str, str]:
    """A task's environment values as Harbor resolves them: a value that is a whole `${VAR}` or
    `${VAR:-default}` takes VAR from the environment this rollout runs in (a secret an LLM judge
    needs, say), or the default; anything else is literal. A VAR unset without a default is an
    error naming it. The task names which of the operator's variables it reads: a task set is
    the operator's own choice, as in Harbor."""
    out = {}
    for key, value in env.items():
        match = _TEMPLATE.fullmatch(value)
        if match is None:
            out[key] = value
        elif match[1] in os.environ:
            out[key] = os.environ[match[1]]
        elif match[2] is not None:
            out[key] = match[2]
        else:
            raise TaskFileError(
                source, f"{section} {key} = {value!r}: {match[1]} is not set here and has no default"
            )
    return out


def _steps(directory: Path, config: HarborTaskConfig) -> list[TaskStep]:
    """The `[[steps]]` of a multi-step task, each with its files under steps/NAME/."""
    assert config.steps
    verifier_internet = _verifier_network(config)
    steps = []
    for i, section in enumerate(config.steps):
        where = directory / "steps" / section.name
        instruction = read_text(where / "instruction.md") if (where / "instruction.md").is_file() else ""
        if not instruction.strip():
            raise TaskFileError(
                where / "instruction.md", f"step {section.name!r} (steps[{i}]) needs its instruction"
            )
        tests = step_tests(directory / "tests", where / "tests")
        if tests is None:
            raise TaskFileError(
                where / "tests" / "test.sh",
                f"missing, and so is {directory / 'tests' / 'test.sh'}: step {section.name!r} has no verifier",
            )
        workdir = where / "workdir"
        try:
            steps.append(
                TaskStep(
                    name=section.name,
                    instruction=instruction,
                    evaluator=EvaluatorSpec(
                        kind="harbor",
                        tests_dir=tests,
                        timeout_sec=section.verifier.timeout_sec or config.verifier.timeout_sec,
                        env=resolve_env(
                            {**config.verifier.env, **section.verifier.env},
                            directory / "task.toml",
                            "[steps.verifier.env]",
                        ),
                        reward_key=config.verifier.reward_key,
                        internet=verifier_internet,
                    ),
                    agent_timeout_sec=section.agent.timeout_sec,
                    min_reward=section.min_reward,
                    workdir_dir=workdir if workdir.is_dir() else None,
                )
            )
        except ValidationError as e:
            raise TaskFileError.from_validation(directory / "task.toml", e, prefix=("steps", i)) from None
    return steps


def step_tests(shared: Path, own: Path) -> Path | None:
    """The tests a step's verifier gets, as Harbor uploads them: the task's `tests/` with the
    step's own `tests/` laid over it, its test.sh the step's where it has one. Where both exist
    they are merged into a directory named by their content under the temporary directory (made
    once; a changed file makes a new one); else the one that exists. None: no test.sh in either."""
    has_shared, has_own = shared.is_dir(), own.is_dir()
    if not (shared / "test.sh").is_file() and not (own / "test.sh").is_file():
        return None
    if not (has_shared and has_own):
        return own if has_own else shared
    digest = hashlib.sha256()
    for root in (shared, own):
        for f in sorted(p for p in root.rglob("*") if p.is_file()):
            digest.update(str(f.relative_to(root)).encode() + b"\0" + f.read_bytes() + b"\0")
    merged = Path(tempfile.gettempdir()) / "polar-mitm-step-tests" / digest.hexdigest()[:24]
    if not merged.is_dir():
        merged.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix="staging-", dir=merged.parent))
        shutil.copytree(shared, staging, dirs_exist_ok=True)
        shutil.copytree(own, staging, dirs_exist_ok=True)
        try:
            staging.rename(merged)
        except OSError:  # made meanwhile by another loader: the same content
            shutil.rmtree(staging, ignore_errors=True)
    return merged


def _read_config(path: Path) -> HarborTaskConfig:
    if not path.exists():
        return HarborTaskConfig()
    try:
        return HarborTaskConfig.model_validate(read_document(path))
    except ValidationError as e:
        raise TaskFileError.from_validation(path, e) from None


def _verifier_network(config: HarborTaskConfig) -> bool:
    """Whether the verifier may reach the internet: `[verifier] allow_internet` where given, else
    the task's `[environment]` (Harbor's verifier runs in the task's environment, after the
    agent: its `[agent]` network_mode is the agent's alone). Terminal-Bench tests fetch their
    tools (`curl … uv/install.sh`) when they verify."""
    if config.verifier.allow_internet is not None:
        return config.verifier.allow_internet
    env = config.environment
    if env.network_mode is not None:
        return env.network_mode == "public"
    return True if env.allow_internet is None else env.allow_internet


def _network(config: HarborTaskConfig) -> tuple[bool, dict[str, Any]]:
    """Whether the agent may reach the internet, and the task's metadata with any allowlist in it.

    An allowlist is no internet but its hosts (`Task.allowed_hosts`, public addresses only); its
    hosts stay in the metadata too.
    """
    agent, env = config.agent, config.environment
    metadata = dict(config.metadata)
    mode = agent.network_mode or env.network_mode
    if mode is None:
        return (True if env.allow_internet is None else env.allow_internet), metadata
    if mode == "allowlist":
        metadata["network_mode"] = "allowlist"
        metadata["allowed_hosts"] = agent.allowed_hosts if agent.network_mode else env.allowed_hosts
    return mode == "public", metadata
