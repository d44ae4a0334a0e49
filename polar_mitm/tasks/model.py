"""The task model every loader produces and every runtime, evaluator and pipeline stage reads.

A `Task` is one thing to ask a harness to do in a fresh sandbox, with what it takes to score the
result. Loaders (`tasks/harbor.py`, `tasks/swebench.py`, `tasks/plain.py`) turn the formats users
bring into it; nothing downstream knows which format a task came from.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

# Allowed for starting the sandbox when a task's total time is derived from its parts.
SANDBOX_START_SEC = 300.0

EvaluatorKind = Literal["command", "harbor", "swebench", "session_completed"]


# The sandbox runtimes a task can run on (polar_mitm.sandbox.make_runtime builds them).
RUNTIMES = ("docker", "local", "apptainer")


class EvaluatorSpec(BaseModel):
    """How a sample of the task is scored after the harness ends: on container runtimes in a fresh
    sandbox from the task's image holding the agent's workdir (`rollout/verify.py`).

    - `command`: run `command` (a shell line) in the workdir; reward 1.0 when it exits 0, else 0.0,
      unless `reward_file` names a file the command writes (a float, or JSON `{"reward": x}`); the
      file is removed before the command runs, so one the agent left never counts.
    - `harbor`: `tests_dir` at `/tests` (read-only where the runtime can), `/logs/verifier` created
      empty, `/tests/test.sh` run, `reward.json` or else `reward.txt` read there, as Harbor does
      (only the one the tests name when they name one), whatever the script's exit status.
    - `swebench`: the repository, test files and conftest.py files from the image, apply
      `test_patch`, run `test_command`; 1.0 when every FAIL_TO_PASS test passes and every
      PASS_TO_PASS test still passes.
    - `session_completed`: not a verifier: 1.0 when the harness exited 0 within its time, whatever
      it did (the agent sets this reward itself; for harvesting and smoke tests).
    """

    model_config = ConfigDict(extra="forbid")

    kind: EvaluatorKind = "session_completed"
    command: str | None = None
    reward_file: str | None = None
    tests_dir: Path | None = None
    test_patch: str | None = None
    test_command: str | None = None
    fail_to_pass: list[str] = Field(default_factory=list)
    pass_to_pass: list[str] = Field(default_factory=list)
    timeout_sec: float = 600.0
    env: dict[str, str] = Field(default_factory=dict)
    # A verdict the run's own evidence contradicts (a process that outlived the tests, pytest's
    # record against the reward: rollout/verdict.py): "zero" scores it 0, "record" keeps the
    # reward and only records why in reward_detail.suspect.
    on_suspect: Literal["zero", "record"] = "zero"
    # Whether the verifier may reach the internet (through its own channel, under the same egress
    # rules as the agent: never this machine, never the model); None: as the task allows.
    internet: bool | None = None
    # The one number a trainer gets from a reward file with several keys (`reward.json`'s
    # `{"correctness": 1, "performance": 0.5}`): a key, or `mean` / `min` / `max` of them all;
    # None: `reward` where there is one, else the only key, else the mean (every key is kept in
    # reward_detail.rewards). The rollout's `--reward-key` applies where the task names none.
    reward_key: str | None = None
    # Where the tests run (rollout/verify.py): "shared", a sandbox from a snapshot of the agent's
    # (everything it changed, nothing it runs: Harbor's default), or "separate", one from the
    # task's image with the agent's workdir; None: shared for `harbor`, separate otherwise.
    environment_mode: Literal["shared", "separate"] | None = None

    @model_validator(mode="after")
    def _complete(self) -> EvaluatorSpec:
        if self.kind == "command" and not self.command:
            raise ValueError("evaluator 'command' needs a command to run")
        if self.kind == "harbor" and self.tests_dir is None:
            raise ValueError("evaluator 'harbor' needs tests_dir (the task's tests/ directory)")
        if self.kind == "swebench" and not self.test_command:
            raise ValueError("evaluator 'swebench' needs test_command")
        return self


class Upload(BaseModel):
    """A host file or directory copied into the sandbox before the task's setup runs."""

    model_config = ConfigDict(extra="forbid")

    source: Path
    target: str = Field(min_length=1, max_length=4096)


class TaskStep(BaseModel):
    """One step of a multi-step task (Harbor's `[[steps]]`): its own instruction, run in the same
    agent sandbox as the steps before it, and its own scoring.

    Before the harness runs, `workdir_dir` (a host directory: Harbor's `steps/NAME/workdir/`) is
    copied into the task's workdir, and a `setup.sh` it holds is run there. When the step's reward
    is below `min_reward` (a number: the step's reward; a table: each named key of its rewards,
    a missing key counting as below) no later step runs."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1)
    instruction: str = Field(min_length=1)
    evaluator: EvaluatorSpec
    agent_timeout_sec: float | None = None  # None: the task's
    min_reward: float | dict[str, float] | None = None
    workdir_dir: Path | None = None


class Task(BaseModel):
    """One task: what the harness is asked, where it runs, and how its result is scored.

    A multi-step task has `steps`: the harness runs once per step, in one sandbox, each step
    scored on its own and the sample's reward combined by `multi_step_reward_strategy` (`mean`
    of the steps that were scored, or the `final` step's). Its `instruction` and `evaluator` are
    the first step's, and its timeouts the sum of its steps'."""

    model_config = ConfigDict(extra="forbid")

    id: str = Field(min_length=1)
    instruction: str = Field(min_length=1)
    image: str | None = None  # container image (docker, apptainer)
    dockerfile: Path | None = None  # built (cached by content) when no image is given
    workdir: str = "/workspace"  # where the harness starts, inside the sandbox
    setup: list[str] = Field(default_factory=list)  # shell lines run once the sandbox is up
    uploads: list[Upload] = Field(default_factory=list)  # copied in before setup (service: under --task-root)
    env: dict[str, str] = Field(default_factory=dict)
    allow_internet: bool = True  # False: the proxy refuses every host but the model's
    # Hosts its sandboxes may reach even without the internet (Harbor's `allowlist` network
    # mode), at public addresses: by name or `*.suffix`. The operator's --egress-allow widens more.
    allowed_hosts: list[str] = Field(default_factory=list)
    cpus: float | None = None
    memory_mb: int | None = None
    agent_timeout_sec: float = 600.0
    total_timeout_sec: float | None = None  # sandbox start to end of scoring; derived when not given
    evaluator: EvaluatorSpec = Field(default_factory=EvaluatorSpec)
    source: str | None = None  # the file or directory it was loaded from
    metadata: dict[str, Any] = Field(default_factory=dict)
    steps: list[TaskStep] = Field(default_factory=list)
    multi_step_reward_strategy: Literal["mean", "final"] = "mean"

    def step_task(self, step: TaskStep) -> Task:
        """This task as one of its steps: the step's instruction, evaluator and agent time, no
        steps of its own (what a harness run and a scoring of that step read). Its id stays the
        task's: runtimes find the task's image by it."""
        return self.model_copy(
            update={
                "instruction": step.instruction,
                "evaluator": step.evaluator,
                "agent_timeout_sec": step.agent_timeout_sec or self.agent_timeout_sec,
                "steps": [],
            }
        )

    @property
    def verifier_internet(self) -> bool:
        """Whether its verifier may reach the internet: the evaluator's `internet`, else as the
        task allows its agent."""
        return self.allow_internet if self.evaluator.internet is None else self.evaluator.internet

    @model_validator(mode="after")
    def _default_total_timeout(self) -> Task:
        # Unless given: the harness's time, the evaluator's, and a sandbox start.
        if self.total_timeout_sec is None and self.steps:
            self.total_timeout_sec = SANDBOX_START_SEC + sum(
                (s.agent_timeout_sec or self.agent_timeout_sec) + s.evaluator.timeout_sec for s in self.steps
            )
        if self.total_timeout_sec is None:
            self.total_timeout_sec = self.agent_timeout_sec + self.evaluator.timeout_sec + SANDBOX_START_SEC
        names = [s.name for s in self.steps]
        if len(set(names)) != len(names):
            raise ValueError(f"step names must be unique, got {names}")
        return self


class TaskFileError(ValueError):
    """A task file that cannot be loaded: names the file (and line), the field and what was expected."""

    def __init__(self, path: str | Path, problem: str, *, line: int | None = None):
        self.path = str(path)
        self.problem = problem
        self.line = line
        where = self.path if line is None else f"{self.path} line {line}"
        super().__init__(f"{where}: {problem}")

    @classmethod
    def from_validation(
        cls,
        path: str | Path,
        error: ValidationError,
        *,
        line: int | None = None,
        prefix: tuple[str | int, ...] = (),
    ) -> TaskFileError:
        """The error for a file whose content failed validation; `prefix` locates the validated part."""
        return cls(path, "; ".join(validation_problems(error, prefix)), line=line)


def field_path(loc: tuple[str | int, ...]) -> str:
    """A pydantic location as the dotted path a user reads in their file: `tasks[1].evaluator.command`."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else f"{'.' if out else ''}{part}"
    return out


# What each pydantic error type expected, in the words of a task file (TOML, YAML or JSON).
_EXPECTED = {
    "string_type": "a string",
    "float_type": "a number",
    "float_parsing": "a number",
    "int_type": "an integer",
    "int_parsing": "an integer",
    "int_from_float": "an integer",
    "bool_type": "true or false",
    "bool_parsing": "true or false",
    "list_type": "a list",
    "dict_type": "a table (mapping)",
    "model_type": "a table (mapping)",
    "model_attributes_type": "a table (mapping)",
    "path_type": "a path (string)",
}


def validation_problems(error: ValidationError, prefix: tuple[str | int, ...] = ()) -> list[str]:
    """One line per problem: `field 'x.y': expected ..., got ...` (or `: required`, `: unknown field`)."""
    problems = []
    for item in error.errors():
        where = field_path(prefix + tuple(item["loc"]))
        problem = _describe(item)
        problems.append(f"field '{where}': {problem}" if where else problem)
    return problems


def _describe(item: Any) -> str:
    kind, ctx, value = item["type"], item.get("ctx") or {}, item.get("input")
    if kind == "missing":
        return "required"
    if kind == "extra_forbidden":
        return "unknown field (check its spelling)"
    if kind in ("value_error", "assertion_error"):
        said = str(ctx.get("error", item["msg"]))
        # A model's own check receives the whole table: repeating it would only be noise.
        return said if isinstance(value, dict | list) else f"{said}, got {_show(value)}"
    if kind == "literal_error":
        expected = f"one of {ctx['expected']}"
    elif kind == "string_too_short" and ctx.get("min_length") == 1:
        expected = "a non-empty string"
    elif kind == "too_short":
        expected = f"at least {ctx.get('min_length')} item(s)"
    else:
        expected = _EXPECTED.get(kind) or item["msg"].removeprefix("Input should be ")
    return f"expected {expected}, got {_show(value)}"


def _show(value: Any) -> str:
    shown = repr(value)
    return shown if len(shown) <= 60 else shown[:57] + "..."
