"""Which viewers (`polar-mitm view`) run on this machine over which store: a small JSON file the
viewer writes and `show` reads, to print a row's viewer URL."""

from __future__ import annotations

import json
import os
from pathlib import Path

from polar_mitm.cache import cache_dir


def registry_path() -> Path:
    """Where a running viewer says which store it shows and at which URL (for `show`)."""
    return cache_dir() / "viewers.json"


def running_url(db: str | Path) -> str | None:
    """The URL of a viewer running on this machine over `db`, if one is (its process alive)."""
    try:
        entries = json.loads(registry_path().read_text())
    except (OSError, ValueError):
        return None
    want = str(Path(db).resolve())
    for entry in entries if isinstance(entries, list) else []:
        if isinstance(entry, dict) and entry.get("db") == want and _alive(entry.get("pid")):
            return str(entry.get("url"))
    return None


def _alive(pid: object) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def register(db: Path, url: str, remove: bool = False) -> None:
    """Note (or, with `remove`, forget) that this process serves a viewer of `db` at `url`."""
    path = registry_path()
    try:
        entries = json.loads(path.read_text())
        entries = entries if isinstance(entries, list) else []
    except (OSError, ValueError):
        entries = []
    entries = [
        e for e in entries if isinstance(e, dict) and _alive(e.get("pid")) and e.get("pid") != os.getpid()
    ]
    if not remove:
        entries.append({"db": str(db.resolve()), "url": url, "pid": os.getpid()})
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(json.dumps(entries))
        os.replace(tmp, path)
    except OSError:
        pass  # only `show`'s hint depends on it
