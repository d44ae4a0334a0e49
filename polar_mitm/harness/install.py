"""The host's harness installation, prepared for mounting read-only into container sandboxes.

The harness CLIs are npm packages installed on the host (`npm install -g`). A container gets the
npm prefix's `lib/node_modules`, a small directory of links named after the recipe's binaries
(`claude -> ../lib/node_modules/@anthropic-ai/claude-code/bin/claude.exe`), and the node binary
the JavaScript harnesses run on. Nothing is copied; images need only a C library compatible with
the host's node (and libstdc++), or the harness installed themselves.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

from polar_mitm.recipes import Recipe
from polar_mitm.sandbox.base import HarnessMount


class HarnessNotInstalled(RuntimeError):
    pass


def cache_dir() -> Path:
    return Path(os.environ.get("POLAR_MITM_CACHE") or Path.home() / ".cache" / "polar-mitm")


def _modules_root(real: Path) -> Path | None:
    """The `.../lib/node_modules` directory a resolved binary lives under, if any."""
    for parent in real.parents:
        if parent.name == "node_modules" and parent.parent.name == "lib":
            return parent
    return None


def harness_mount(recipe: Recipe, binary: str | None = None) -> HarnessMount:
    """Where `recipe`'s binaries are installed on the host, as a HarnessMount.

    Raises HarnessNotInstalled (with the npm command to run) when none of them is on PATH or the
    binary is not part of an npm installation.
    """
    names = [binary] if binary else recipe.binaries
    found = next(((n, shutil.which(n)) for n in names if shutil.which(n)), None)
    hint = f" (npm install -g {recipe.npm})" if recipe.npm else ""
    if found is None:
        raise HarnessNotInstalled(f"{recipe.name}: none of {', '.join(names)} is on PATH{hint}")
    modules: Path | None = None
    links: dict[str, str] = {}
    for name in recipe.binaries:
        path = shutil.which(name)
        if path is None:
            continue
        real = Path(path).resolve()
        root = _modules_root(real)
        if root is None:
            continue
        if modules is None:
            modules = root
        if root == modules:
            links[name] = f"../lib/node_modules/{real.relative_to(root)}"
    if modules is None:
        raise HarnessNotInstalled(
            f"{recipe.name}: {found[1]} is not inside an npm installation (lib/node_modules); "
            f"install it with npm{hint} or use an image that has it"
        )
    key = hashlib.sha256(repr((str(modules), sorted(links.items()))).encode()).hexdigest()[:16]
    bin_dir = cache_dir() / "harness-bin" / key
    if not bin_dir.is_dir():
        tmp = bin_dir.with_name(bin_dir.name + f".{os.getpid()}")
        tmp.mkdir(parents=True, exist_ok=True)
        for name, target in links.items():
            (tmp / name).unlink(missing_ok=True)
            (tmp / name).symlink_to(target)
        try:
            tmp.rename(bin_dir)
        except OSError:  # made meanwhile by another process
            shutil.rmtree(tmp, ignore_errors=True)
    node = shutil.which("node")
    return HarnessMount(modules=modules, bin=bin_dir, node=Path(node).resolve() if node else None)
