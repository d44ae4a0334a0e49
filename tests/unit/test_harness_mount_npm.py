"""Where a container's npm harness comes from (harness/install.py): the npm installation the
command on PATH resolves into, with the Node of that installation's prefix; for a harness in a
prefix of its own under the cache (OpenClaw, on npm's Node 24), that prefix, though PATH's command
is install.sh's launcher script."""

from __future__ import annotations

from pathlib import Path

import pytest

from polar_mitm import recipes
from polar_mitm.harness.install import HarnessNotInstalled, harness_mount


def npm_prefix(root: Path, package: str, entry: str, *, node: bool) -> Path:
    """An npm prefix as `npm install -g --prefix ROOT` leaves it: the package under
    lib/node_modules, its command linked from bin; with `node`, npm's `node` package too."""
    pkg = root / "lib" / "node_modules" / package
    pkg.mkdir(parents=True)
    (pkg / entry).write_text("#!/usr/bin/env node\n")
    (pkg / entry).chmod(0o755)  # npm makes a package's bin executable
    (root / "bin").mkdir()
    (root / "bin" / package).symlink_to(f"../lib/node_modules/{package}/{entry}")
    if node:
        binary = root / "lib" / "node_modules" / "node" / "bin" / "node"
        binary.parent.mkdir(parents=True)
        binary.write_text("ELF")
        (root / "bin" / "node").symlink_to("../lib/node_modules/node/bin/node")
    return root


def launcher(bin_dir: Path, name: str, prefix: Path) -> None:
    """scripts/install.sh's launcher: the prefix first on PATH, then its command."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    (bin_dir / name).write_text(f'#!/bin/sh\nPATH="{prefix}/bin:$PATH" exec "{prefix}/bin/{name}" "$@"\n')
    (bin_dir / name).chmod(0o755)


def test_a_harness_in_a_prefix_of_its_own_is_mounted_from_it_with_its_node(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    claw = npm_prefix(cache / "openclaw", "openclaw", "openclaw.mjs", node=True)
    launcher(cache / "bin", "openclaw", claw)
    monkeypatch.setenv("POLAR_MITM_CACHE", str(cache))
    monkeypatch.setenv("PATH", f"{cache / 'bin'}:/usr/bin:/bin")
    mount = harness_mount(recipes.get("openclaw"))
    assert mount.modules == claw / "lib" / "node_modules"
    assert (mount.bin / "openclaw").readlink() == Path("../lib/node_modules/openclaw/openclaw.mjs")
    assert mount.node == (claw / "lib" / "node_modules" / "node" / "bin" / "node").resolve()  # not PATH's
    # The same for the command a --harness-cmd names.
    assert harness_mount(recipes.get("openclaw"), "openclaw").modules == mount.modules


def test_a_harness_in_a_prefix_of_its_own_found_on_path_as_an_npm_install_is_taken_from_path(
    tmp_path, monkeypatch
):
    """A user's own OpenClaw (npm install -g on a Node 24 of theirs) wins over the cache's."""
    cache = tmp_path / "cache"
    npm_prefix(cache / "openclaw", "openclaw", "openclaw.mjs", node=True)
    mine = npm_prefix(tmp_path / "mine", "openclaw", "openclaw.mjs", node=True)
    monkeypatch.setenv("POLAR_MITM_CACHE", str(cache))
    monkeypatch.setenv("PATH", f"{mine / 'bin'}:/usr/bin:/bin")
    mount = harness_mount(recipes.get("openclaw"))
    assert mount.modules == mine / "lib" / "node_modules"
    assert mount.node == (mine / "bin" / "node").resolve()


def test_a_prefix_without_a_node_of_its_own_runs_on_paths_node(tmp_path, monkeypatch):
    prefix = npm_prefix(tmp_path / "npm", "cline", "cli.mjs", node=False)
    node = tmp_path / "system" / "node"
    node.parent.mkdir()
    node.write_text("ELF")
    node.chmod(0o755)
    monkeypatch.setenv("PATH", f"{prefix / 'bin'}:{node.parent}")
    monkeypatch.setenv("POLAR_MITM_CACHE", str(tmp_path / "cache"))
    mount = harness_mount(recipes.get("cline"))
    assert mount.modules == prefix / "lib" / "node_modules" and mount.node == node


def test_a_missing_own_prefix_names_install_sh(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    launcher(cache / "bin", "openclaw", cache / "openclaw")  # the launcher left, the prefix gone
    monkeypatch.setenv("POLAR_MITM_CACHE", str(cache))
    monkeypatch.setenv("PATH", f"{cache / 'bin'}:/usr/bin:/bin")
    with pytest.raises(HarnessNotInstalled, match="scripts/install.sh") as e:
        harness_mount(recipes.get("openclaw"))
    assert str(cache / "openclaw") in str(e.value)


def test_the_own_prefix_is_found_beside_the_launcher_when_home_is_another(tmp_path, monkeypatch):
    """A rollout's process may run with a HOME of its own (a fresh one, in the e2e tests): the
    cache it would look in is empty, and the launcher on PATH names the installed one's place."""
    cache = tmp_path / "cache"
    claw = npm_prefix(cache / "openclaw", "openclaw", "openclaw.mjs", node=True)
    launcher(cache / "bin", "openclaw", claw)
    monkeypatch.setenv("POLAR_MITM_CACHE", str(tmp_path / "other-home-cache"))
    monkeypatch.setenv("PATH", f"{cache / 'bin'}:/usr/bin:/bin")
    assert harness_mount(recipes.get("openclaw")).modules == claw / "lib" / "node_modules"
