"""Tasks: what a harness is asked to do in a sandbox, and how the result is scored.

`load_tasks` reads the formats users bring, choosing by what each path is:

- a directory: a Harbor / Terminal-Bench task (it holds `instruction.md`) or a set of them
  (`harbor.py`);
- a `.jsonl` file: SWE-bench-shaped rows (`swebench.py`);
- a `.toml`, `.yaml`, `.yml` or `.json` file: plain tasks with `Task`'s field names (`plain.py`).

Every problem is a `TaskFileError` naming the file, the field and what was expected.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from polar_mitm.tasks.harbor import load_harbor
from polar_mitm.tasks.model import EvaluatorSpec, Task, TaskFileError
from polar_mitm.tasks.plain import PLAIN_SUFFIXES, load_plain_file
from polar_mitm.tasks.swebench import load_swebench_jsonl

__all__ = ["EvaluatorSpec", "Task", "TaskFileError", "load_path", "load_tasks"]


def load_tasks(paths: Sequence[str | Path]) -> list[Task]:
    """Every task in the given files and directories, in order; task ids must be unique across them."""
    tasks: list[Task] = []
    loaded_from: dict[str, str] = {}
    for path in paths:
        for task in load_path(Path(path)):
            source = task.source or str(path)
            if task.id in loaded_from:
                first = loaded_from[task.id]
                where = "earlier in the same file" if first == source else f"from {first}"
                raise TaskFileError(source, f"duplicate task id {task.id!r}: already loaded {where}")
            loaded_from[task.id] = source
            tasks.append(task)
    return tasks


def load_path(path: Path) -> list[Task]:
    """The tasks in one file or directory, read by the loader its kind calls for."""
    if path.is_dir():
        return load_harbor(path)
    if not path.exists():
        raise TaskFileError(path, "no such file or directory")
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        return load_swebench_jsonl(path)
    if suffix in PLAIN_SUFFIXES:
        return load_plain_file(path)
    raise TaskFileError(
        path,
        f"unknown kind of task file {suffix or '(no extension)'!r}: supported are "
        f"{', '.join(PLAIN_SUFFIXES)} (plain tasks), .jsonl (SWE-bench rows) "
        "and directories (Harbor tasks or task sets)",
    )
