"""SWE-bench-shaped tasks: JSON lines, one dataset row per line, with the dataset's own column names.

A row is read by `SwebenchRow` (the columns we use; others, such as `patch` or `hints_text`, are
ignored) and becomes a `Task` scored by the `swebench` evaluator: apply `test_patch`, run the tests,
1.0 when every FAIL_TO_PASS test passes and every PASS_TO_PASS test still does.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from polar_mitm.tasks.model import EvaluatorSpec, Task, TaskFileError
from polar_mitm.tasks.plain import kind_of, read_text

SWEBENCH_WORKDIR = "/testbed"  # where SWE-bench images hold the repository
DEFAULT_TEST_RUNNER = "python -m pytest -rA -p no:cacheprovider"


def swebench_image(instance_id: str) -> str:
    """The published SWE-bench evaluation image of an instance.

    The dataset's naming rule: `swebench/sweb.eval.x86_64.<id>:latest`, the id lower-cased and its
    `__` (between owner and repository) written as `_1776_`, since Docker Hub names cannot hold `__`.
    """
    return f"swebench/sweb.eval.x86_64.{instance_id.lower().replace('__', '_1776_')}:latest"


def default_test_command(tests: list[str]) -> str:
    """pytest over the given test ids, each shell-quoted (rows for non-pytest repos give `test_command`)."""
    return " ".join([DEFAULT_TEST_RUNNER, *(shlex.quote(test) for test in tests)])


class SwebenchRow(BaseModel):
    """One row, with the SWE-bench dataset's column names and our few optional additions."""

    model_config = ConfigDict(extra="ignore")

    instance_id: str = Field(min_length=1)
    problem_statement: str = Field(min_length=1)
    repo: str | None = None
    base_commit: str | None = None
    version: str | None = None
    image: str | None = None
    workdir: str = SWEBENCH_WORKDIR
    test_patch: str | None = None
    FAIL_TO_PASS: list[str] = Field(min_length=1)
    PASS_TO_PASS: list[str] = Field(default_factory=list)
    test_command: str | None = None
    setup: list[str] = Field(default_factory=list)
    env: dict[str, str] = Field(default_factory=dict)
    agent_timeout_sec: float = 600.0
    allow_internet: bool = True

    @field_validator("FAIL_TO_PASS", "PASS_TO_PASS", mode="before")
    @classmethod
    def _json_list(cls, value: Any) -> Any:
        # The Hugging Face dataset stores these lists as strings holding JSON.
        if not isinstance(value, str):
            return value
        try:
            return json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(
                f"expected a list of test ids, or a string holding a JSON list ({e.msg})"
            ) from None

    @field_validator("version", mode="before")
    @classmethod
    def _version_text(cls, value: Any) -> Any:
        return str(value) if isinstance(value, int | float) and not isinstance(value, bool) else value


def load_swebench_jsonl(path: Path) -> list[Task]:
    """The tasks of a JSON-lines file of SWE-bench rows; blank lines are skipped."""
    tasks: list[Task] = []
    first_seen: dict[str, int] = {}
    # Split on newlines only: str.splitlines would also split inside strings holding U+2028.
    for number, line in enumerate(read_text(path).split("\n"), start=1):
        if not line.strip():
            continue
        try:
            data = json.loads(line)
        except json.JSONDecodeError as e:
            raise TaskFileError(path, f"invalid JSON: {e.msg} (column {e.colno})", line=number) from None
        if not isinstance(data, dict):
            raise TaskFileError(path, f"expected a JSON object, got {kind_of(data)}", line=number)
        try:
            row = SwebenchRow.model_validate(data)
        except ValidationError as e:
            raise TaskFileError.from_validation(path, e, line=number) from None
        if row.instance_id in first_seen:
            raise TaskFileError(
                path,
                f"field 'instance_id': {row.instance_id!r} again (first on line {first_seen[row.instance_id]})",
                line=number,
            )
        first_seen[row.instance_id] = number
        tasks.append(_task(path, row, number))
    if not tasks:
        raise TaskFileError(path, "no rows: expected one JSON object per line")
    return tasks


def _task(path: Path, row: SwebenchRow, line: int) -> Task:
    tests = row.FAIL_TO_PASS + row.PASS_TO_PASS
    metadata = {key: getattr(row, key) for key in ("repo", "base_commit", "version")}
    try:
        return Task(
            id=row.instance_id,
            instruction=row.problem_statement,
            image=row.image or swebench_image(row.instance_id),
            workdir=row.workdir,
            setup=row.setup,
            env=row.env,
            allow_internet=row.allow_internet,
            agent_timeout_sec=row.agent_timeout_sec,
            evaluator=EvaluatorSpec(
                kind="swebench",
                test_patch=row.test_patch,
                test_command=row.test_command or default_test_command(tests),
                fail_to_pass=row.FAIL_TO_PASS,
                pass_to_pass=row.PASS_TO_PASS,
            ),
            source=str(path),
            metadata={key: value for key, value in metadata.items() if value is not None},
        )
    except ValidationError as e:
        raise TaskFileError.from_validation(path, e, line=line) from None
