"""The instances we started, each recorded as a JSON file in a registry directory (Apptainer keeps
no labels): what `ApptainerRuntime.cleanup(labels)` finds after a crash, and stops.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, Field

from polar_mitm.cache import cache_dir
from polar_mitm.sandbox.apptainer.argv import stop_argv
from polar_mitm.sandbox.apptainer.host import run_argv


def default_registry_dir() -> Path:
    return cache_dir() / "apptainer" / "instances"


class InstanceRecord(BaseModel):
    """One instance we started, kept until it is stopped (what `cleanup` finds after a crash)."""

    name: str
    binary: str
    image: str
    session_dir: Path
    labels: dict[str, str] = Field(default_factory=dict)
    started_at: float


async def stop_recorded(registry_dir: Path, labels: dict[str, str], binary: str | None = None) -> int:
    """Stop every recorded instance whose labels include all of `labels` (with `binary`, else the
    one that started it); returns how many."""
    if not registry_dir.is_dir():
        return 0
    count = 0
    for path in sorted(registry_dir.glob("*.json")):
        try:
            record = InstanceRecord.model_validate_json(path.read_text())
        except (OSError, ValueError):
            continue
        if any(record.labels.get(k) != v for k, v in labels.items()):
            continue
        await run_argv(stop_argv(binary or record.binary, record.name), timeout=60)
        path.unlink(missing_ok=True)
        count += 1
    return count
