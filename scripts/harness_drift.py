"""Harness drift: install the newest release of each recipe harness into a scratch prefix and run
its end-to-end tests against it, then print one table (harness, pinned, newest, works / what
changed). Run by scripts/harness-drift.sh; see docs/harnesses.md ("Harness drift").

Pins are read from scripts/install.sh (NPM_PACKAGES, PY_ENVS), newest versions from the registries'
own clients (`npm view`, `pip index versions`). An npm harness goes into a prefix of its own
(`npm install -g --prefix`), first on PATH; a PyPI harness into a virtualenv of its own under a
scratch POLAR_MITM_CACHE (built on the interpreter of its pinned virtualenv), whose `bin/` the
tests look in first. Nothing installed for the suite is touched. The tests are the harness's
`tests/e2e/test_NAME*.py`, without the Docker ones.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from polar_mitm import recipes  # noqa: E402
from polar_mitm.cache import cache_dir  # noqa: E402


@dataclass
class Harness:
    name: str
    registry: str  # "npm" | "pypi"
    package: str
    pinned: str | None
    venv: str | None = None  # PyPI: the install.sh entry's virtualenv name
    commands: tuple[str, ...] = ()
    node: str | None = None  # npm: the Node it is installed with, where it needs its own
    extras: str = ""  # PyPI: the extras install.sh installs it with ("[anthropic]")
    newest: str | None = None
    result: str = ""


def pins(install_sh: Path) -> tuple[dict[str, str], dict[str, tuple[str, str, tuple[str, ...], str]]]:
    """install.sh's npm pins (package -> version) and PyPI pins (package -> (version, venv,
    commands, extras))."""
    text = install_sh.read_text()
    npm_block = re.search(r"NPM_PACKAGES=\((.*?)\n\)", text, re.S)
    py_block = re.search(r"PY_ENVS=\((.*?)\n\)", text, re.S)
    npm: dict[str, str] = {}
    specs = re.findall(r'^\s*"([^"#$]+)"', npm_block[1] if npm_block else "", re.M)
    # The main job's pins (Claude Code), which NPM_PACKAGES takes as "${MAIN_NPM[@]}".
    main_block = re.search(r"^MAIN_NPM=\((.*?)\)", text, re.M | re.S)
    specs += re.findall(r'"([^"$]+)"', main_block[1] if main_block else "")
    # Harnesses installed with a Node of their own: NAME_PINS="node@V package@V" (OpenClaw's).
    for line in re.findall(r'^[A-Z_]+_PINS="([^"]*node@[^"]*)"', text, re.M):
        specs += line.split()
    for spec in specs:
        name, _, version = spec.rpartition("@")
        npm[name] = version
    py: dict[str, tuple[str, str, tuple[str, ...], str]] = {}
    for entry in re.findall(r'^\s*"([^"#]+)"', py_block[1] if py_block else "", re.M):
        venv, pkgs, cmds, *_ = entry.split("|")
        for req in pkgs.split():
            pkg, _, version = req.partition("==")
            pkg, bracket, extras = pkg.partition("[")
            py[pkg] = (version, venv, tuple(cmds.split()), bracket + extras)
    return npm, py


# Harnesses the generic recipe runs (no recipe of their own): their e2e tests' name, registry,
# package.
GENERIC = [("grok-cli", "npm", "@vibe-kit/grok-cli"), ("mistral-vibe", "pypi", "mistral-vibe")]


def harnesses(install_sh: Path) -> list[Harness]:
    npm, py = pins(install_sh)
    out = []
    for name, registry, package in GENERIC:
        if registry == "npm":
            out.append(Harness(name, "npm", package, npm.get(package)))
        else:
            version, venv, cmds, extras = py.get(package, (None, None, (), ""))
            out.append(Harness(name, "pypi", package, version, venv, cmds, extras=extras))
    for r in recipes.all_recipes().values():
        if r.npm:
            own_node = re.search(rf'_PINS="node@(\S+) {re.escape(r.npm)}@', install_sh.read_text())
            node = own_node[1] if own_node else None
            # A harness with a Node of its own is run by a launcher named as the recipe's binary.
            cmds = tuple(r.binaries[:1]) if node else ()
            out.append(Harness(r.name, "npm", r.npm, npm.get(r.npm), commands=cmds, node=node))
        elif r.pypi:
            pkg = re.split(r"[=<>!~ ]", r.pypi, maxsplit=1)[0]
            version, venv, cmds, extras = py.get(pkg, (None, None, (), ""))
            out.append(
                Harness(r.name, "pypi", pkg, version, venv, cmds or tuple(r.binaries[:1]), extras=extras)
            )
    return sorted(out, key=lambda h: h.name)


def newest(h: Harness) -> str | None:
    if h.registry == "npm":
        r = subprocess.run(["npm", "view", h.package, "version"], capture_output=True, text=True, timeout=120)
        return r.stdout.strip() or None
    r = subprocess.run(
        [sys.executable, "-m", "pip", "index", "versions", h.package],
        capture_output=True,
        text=True,
        timeout=120,
    )
    m = re.search(rf"^{re.escape(h.package)} \(([^)]+)\)", r.stdout, re.M)
    return m[1] if m else None


def _tail(text: str, lines: int = 2) -> str:
    """The last lines that say something (npm's log-file pointers and warnings left out)."""
    kept = [
        ln.removeprefix("npm error").strip()
        for ln in text.strip().splitlines()
        if ln.strip() and not ln.startswith("npm warn") and "A complete log of this run" not in ln
    ]
    kept = [ln for ln in kept if ln]
    return " / ".join(kept[-lines:])[:300]


def install(h: Harness, scratch: Path) -> tuple[dict[str, str] | None, str]:
    """Install h.newest under `scratch`; the environment changes that put it first, or None and why."""
    assert h.newest is not None
    cache = _scratch_cache(scratch, h.name)
    if h.registry == "npm":
        prefix = scratch / "npm" / h.name
        # The scratch cache too: the tests look in its bin/ before PATH (where the suite's
        # OpenClaw wrapper would be found first).
        path = {
            "PATH": f"{prefix / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}",
            "POLAR_MITM_CACHE": str(cache),
        }
        # A harness with a Node of its own (OpenClaw) gets that Node in its prefix first.
        specs = ([f"node@{h.node}"] if h.node else []) + [f"{h.package}@{h.newest}"]
        for spec in specs:
            r = subprocess.run(
                ["npm", "install", "-g", "--prefix", str(prefix), "--no-fund", "--no-audit", spec],
                capture_output=True,
                text=True,
                timeout=1800,
                env={**os.environ, **path},
            )
            if r.returncode != 0:
                return None, f"cannot install: {_tail(r.stderr)}"
        _launchers(h, prefix, cache / "bin")
        return path, ""
    venv = cache / "venvs" / (h.venv or h.name)
    if not (venv / "bin" / "python").exists():
        subprocess.run([_interpreter(h), "-m", "venv", str(venv)], check=True, timeout=300)
    r = subprocess.run(
        [str(venv / "bin" / "pip"), "install", "-q", f"{h.package}{h.extras}=={h.newest}"],
        capture_output=True,
        text=True,
        timeout=1800,
    )
    if r.returncode != 0:
        return None, f"cannot install: {_tail(r.stderr)}"
    for cmd in h.commands:
        link = cache / "bin" / cmd
        link.unlink(missing_ok=True)
        link.symlink_to(venv / "bin" / cmd)
    return {"POLAR_MITM_CACHE": str(cache)}, ""


def _launchers(h: Harness, prefix: Path, bin_dir: Path) -> None:
    """install.sh's launcher for a harness with a Node of its own whose command is not the
    package's binary (Kimi Code's `kimi-code` runs `kimi`): the prefix's binary with the prefix
    first on PATH."""
    manifest = prefix / "lib" / "node_modules" / h.package / "package.json"
    bins = json.loads(manifest.read_text()).get("bin") if manifest.exists() else None
    if not isinstance(bins, dict) or len(bins) != 1:
        return
    binary = next(iter(bins))
    for cmd in h.commands:
        if cmd != binary:
            launcher = bin_dir / cmd
            launcher.write_text(f'#!/bin/sh\nPATH="{prefix}/bin:$PATH" exec "{prefix}/bin/{binary}" "$@"\n')
            launcher.chmod(0o755)


def _scratch_cache(scratch: Path, name: str) -> Path:
    """A POLAR_MITM_CACHE of the harness's own: an empty bin/, the suite's built tokenizers."""
    cache = scratch / "cache" / name
    (cache / "bin").mkdir(parents=True, exist_ok=True)
    tokenizers = cache / "tokenizers"
    if not tokenizers.exists():
        tokenizers.symlink_to(cache_dir() / "tokenizers")
    return cache


def _interpreter(h: Harness) -> str:
    """The Python the pinned virtualenv was built on (Kimi CLI needs 3.13), else this one."""
    cfg = cache_dir() / "venvs" / (h.venv or h.name) / "pyvenv.cfg"
    if cfg.exists():
        home = re.search(r"^home\s*=\s*(.+)$", cfg.read_text(), re.M)
        version = re.search(r"^version(?:_info)?\s*=\s*(\d+\.\d+)", cfg.read_text(), re.M)
        if home and version:
            cand = Path(home[1].strip()) / f"python{version[1]}"
            if cand.exists():
                return str(cand)
    return sys.executable


def tests_of(h: Harness) -> list[str]:
    return sorted(
        str(p.relative_to(ROOT))
        for p in (ROOT / "tests" / "e2e").glob(f"test_{h.name.replace('-', '_')}*.py")
    )


def run_tests(h: Harness, env_changes: dict[str, str], python: str) -> str:
    files = tests_of(h)
    if not files:
        return "no e2e test"
    env = {**os.environ, **env_changes, "PYTHONPATH": str(ROOT)}
    t0 = time.monotonic()
    r = subprocess.run(
        [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rf", "-m", "e2e and not docker", *files],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=3600,
    )
    took = time.monotonic() - t0
    summary = next(
        (ln for ln in reversed(r.stdout.splitlines()) if " in " in ln and ("passed" in ln or "failed" in ln)),
        "",
    )
    counts = re.sub(r"\s+in [\d.]+s.*$", "", summary.strip("= "))
    failed = []
    for line in r.stdout.splitlines():
        if line.startswith("FAILED "):
            name, _, msg = line.removeprefix("FAILED ").partition(" - ")
            failed.append(f"{name.split('::')[-1]}: {msg[:160]}" if msg else name.split("::")[-1])
    if r.returncode == 0:
        return f"works ({counts}, {took:.0f} s)"
    why = "; ".join(failed)
    errors = [ln[1:].strip() for ln in r.stdout.splitlines() if ln.startswith("E ") and ln[1:].strip()]
    if errors:  # the first line pytest marked as the error: the assertion or exception
        why += f" ({errors[0][:200]})"
    return f"fails ({counts or 'rc ' + str(r.returncode)}): {why or _tail(r.stdout + r.stderr)}"


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--scratch", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")) / "polar-mitm-drift"
    )
    ap.add_argument("--all", action="store_true", help="also run harnesses whose pin is the newest release")
    ap.add_argument(
        "--python", default=sys.executable, help="the interpreter that runs the tests (the project's)"
    )
    ap.add_argument("only", nargs="*", help="recipe names (default: every recipe harness)")
    args = ap.parse_args()
    rows = [h for h in harnesses(ROOT / "scripts" / "install.sh") if not args.only or h.name in args.only]
    args.scratch.mkdir(parents=True, exist_ok=True)
    for h in rows:
        h.newest = newest(h)
        if h.newest is None:
            h.result = "newest version not found in the registry"
        elif h.newest == h.pinned and not args.all:
            h.result = "pinned is the newest (the suite's e2e tests run it)"
        else:
            print(
                f"harness-drift: {h.name} {h.pinned} -> {h.newest}: installing", file=sys.stderr, flush=True
            )
            env_changes, why = install(h, args.scratch)
            h.result = why if env_changes is None else run_tests(h, env_changes, args.python)
        print(f"harness-drift: {h.name}: {h.result}", file=sys.stderr, flush=True)
    print(f"Harness drift, {time.strftime('%Y-%m-%d')} (scripts/harness-drift.sh):\n")
    print("| harness | package | pinned | newest | works / what changed |")
    print("|---|---|---|---|---|")
    for h in rows:
        print(
            f"| {h.name} | {h.registry} `{h.package}` | {h.pinned or '—'} | {h.newest or '?'} | {h.result.replace('|', '/')} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
