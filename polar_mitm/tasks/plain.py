"""Plain task files: one task, or a `tasks` list of them, in TOML, YAML or JSON, spelled with `Task`'s
own field names.

Also where every loader reads files: `read_text` and `read_document` turn unreadable files and
syntax errors into `TaskFileError`s that name the file and the parser's line.
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from polar_mitm.tasks.model import Task, TaskFileError, field_path

PLAIN_SUFFIXES = (".toml", ".yaml", ".yml", ".json")


def read_text(path: Path) -> str:
    """The file's text, or a `TaskFileError` saying why it cannot be read."""
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise TaskFileError(path, f"not UTF-8 text (byte {e.start})") from None
    except OSError as e:
        raise TaskFileError(path, f"cannot read it: {e.strerror}") from None


def read_document(path: Path) -> Any:
    """Parse a TOML, JSON or YAML file (by its suffix); syntax errors give the parser's line."""
    text = read_text(path)
    suffix = path.suffix.lower()
    if suffix == ".toml":
        try:
            return tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            raise TaskFileError(path, f"invalid TOML: {e}") from None
    if suffix == ".json":
        try:
            return json.loads(text)
        except json.JSONDecodeError as e:
            raise TaskFileError(path, f"invalid JSON: {e.msg} (column {e.colno})", line=e.lineno) from None
    if suffix in (".yaml", ".yml"):
        return _read_yaml(path, text)
    raise TaskFileError(path, f"cannot parse '{suffix}' files: use .toml, .json, .yaml or .yml")


def _read_yaml(path: Path, text: str) -> Any:
    try:
        import yaml
    except ImportError:
        raise TaskFileError(
            path, "reading YAML needs PyYAML: `pip install pyyaml`, or write the task as .toml or .json"
        ) from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        if mark is None:
            raise TaskFileError(path, f"invalid YAML: {e}") from None
        problem = getattr(e, "problem", None) or str(e)
        raise TaskFileError(
            path, f"invalid YAML: {problem} (column {mark.column + 1})", line=mark.line + 1
        ) from None


def load_plain_file(path: Path) -> list[Task]:
    """The tasks of one plain task file: a table of `Task` fields, or a `tasks` list of such tables.

    A single task without an `id` takes the file's stem. Relative `dockerfile` and
    `evaluator.tests_dir` paths are relative to the file's directory.
    """
    document = read_document(path)
    if not isinstance(document, dict):
        raise TaskFileError(
            path, f"expected a table of task fields or a 'tasks' list at the top, got {kind_of(document)}"
        )
    if "tasks" not in document:
        return [_task(path, {"id": path.stem, **document}, ())]
    others = sorted(set(document) - {"tasks"})
    if others:
        raise TaskFileError(
            path, f"a file with a 'tasks' list holds nothing else; move {others} into each task"
        )
    entries = document["tasks"]
    if not isinstance(entries, list):
        raise TaskFileError(path, f"field 'tasks': expected a list of tasks, got {kind_of(entries)}")
    if not entries:
        raise TaskFileError(path, "field 'tasks': the list is empty")
    return [_task(path, entry, ("tasks", i)) for i, entry in enumerate(entries)]


def _task(path: Path, entry: Any, loc: tuple[str | int, ...]) -> Task:
    if not isinstance(entry, dict):
        raise TaskFileError(
            path, f"field '{field_path(loc)}': expected a table of task fields, got {kind_of(entry)}"
        )
    try:
        task = Task.model_validate({**entry, "source": str(path)})
    except ValidationError as e:
        raise TaskFileError.from_validation(path, e, prefix=loc) from None
    base = path.parent.absolute()
    if task.dockerfile is not None:
        task.dockerfile = base / task.dockerfile
        if not task.dockerfile.is_file():
            where = field_path((*loc, "dockerfile"))
            raise TaskFileError(path, f"field '{where}': no such file {task.dockerfile}")
    if task.evaluator.tests_dir is not None:
        task.evaluator.tests_dir = base / task.evaluator.tests_dir
        if not task.evaluator.tests_dir.is_dir():
            where = field_path((*loc, "evaluator", "tests_dir"))
            raise TaskFileError(path, f"field '{where}': no such directory {task.evaluator.tests_dir}")
    return task


def kind_of(value: Any) -> str:
    """What a parsed value is, in the words of a task file: `a table (mapping)`, `a list`, ..."""
    names = {dict: "a table (mapping)", list: "a list", str: "a string", type(None): "nothing"}
    return names.get(type(value), type(value).__name__)
