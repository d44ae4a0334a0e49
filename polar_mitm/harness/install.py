"""The host's harness installation, prepared for mounting read-only into container sandboxes.

npm harnesses (`npm install -g`): a container gets the npm prefix's `lib/node_modules`, a small
directory of links named after the recipe's binaries (`claude ->
../lib/node_modules/@anthropic-ai/claude-code/bin/claude.exe`), and the node binary the JavaScript
harnesses run on: the prefix's own where it has one (npm's `node` package installed into it),
else the one on PATH. A harness that needs a newer Node than the system's lives in a prefix of its
own under the cache (the recipe's `npm_prefix`, OpenClaw's): PATH has a launcher script for it,
and a container gets that prefix and its Node.

PyPI harnesses (each in a virtualenv of its own, `scripts/install.sh`): a container gets the
virtualenv and the interpreter installation it was built on (a pyenv version, say), each at the
same absolute path as on the host — entry scripts name their interpreter by absolute path in their
`#!` line, and the interpreter finds its standard library from `pyvenv.cfg`'s `home` — and the same
directory of links, here to the entry scripts. Editable installs' source trees (what the
virtualenv's `.pth` files and setuptools' editable finders name) are shown at their paths too. A
virtualenv built on the system's own Python (whose installation is /usr) cannot be shown this way:
mounting the host's /usr would replace the image's.

Nothing is copied; images need only a C library compatible with the host's node or Python (and
the shared libraries the interpreter was built against: libssl, libffi, libsqlite3, zlib, …), or
the harness installed themselves.
"""

from __future__ import annotations

import ast
import hashlib
import os
import shutil
import stat
from pathlib import Path, PurePosixPath

from polar_mitm.cache import cache_dir
from polar_mitm.recipes import Recipe
from polar_mitm.sandbox.base import HarnessMount

# Interpreter installations that are the system's own: a container's image has its own of each.
SYSTEM_PREFIXES = {"/", "/usr", "/usr/local", "/bin", "/opt"}
# Directories of an image that a tree mounted at or under them would hide part of.
SYSTEM_TREES = ("/usr", "/bin", "/sbin", "/lib", "/lib64", "/etc", "/proc", "/sys", "/dev", "/var/lib")
# What a Python harness needs in a sandbox whose installation is mounted read-only: no attempt
# to write bytecode next to the sources (the host's __pycache__ is still read).
PYTHON_ENV = {"PYTHONDONTWRITEBYTECODE": "1"}


class HarnessNotInstalled(RuntimeError):
    pass


def _modules_root(real: Path) -> Path | None:
    """The `.../lib/node_modules` directory a resolved binary lives under, if any."""
    for parent in real.parents:
        if parent.name == "node_modules" and parent.parent.name == "lib":
            return parent
    return None


def _venv_root(real: Path) -> Path | None:
    """The virtualenv (the directory holding `pyvenv.cfg`) a resolved entry script lives in."""
    return next((p for p in real.parents if (p / "pyvenv.cfg").is_file()), None)


def _install_hint(recipe: Recipe) -> str:
    if recipe.npm_prefix:
        return f" (bash scripts/install.sh installs it with the Node it needs into {_own_prefix(recipe)})"
    if recipe.npm:
        return f" (npm install -g {recipe.npm})"
    if recipe.pypi:
        return (
            f" (bash scripts/install.sh puts it in {cache_dir() / 'venvs'} and links it into "
            f"{cache_dir() / 'bin'}; or python3 -m venv VENV && VENV/bin/pip install {recipe.pypi})"
        )
    return ""


def _own_prefix(recipe: Recipe) -> Path:
    assert recipe.npm_prefix is not None
    return cache_dir() / recipe.npm_prefix


def _find(recipe: Recipe, name: str) -> str | None:
    """`name` on PATH; for a PyPI harness also where scripts/install.sh links its commands; for a
    harness in an npm prefix of its own, that prefix's command unless PATH's is an npm installation
    (PATH's is the launcher that runs it on its Node, a script no container can use). The prefix
    is looked for in the cache, and beside the launcher's directory (install.sh writes the launcher
    into the cache's `bin`: a process whose HOME is another finds it there)."""
    found = shutil.which(name)
    if found is None and recipe.pypi:
        found = shutil.which(name, path=str(cache_dir() / "bin"))
    if recipe.npm_prefix and (found is None or _modules_root(Path(found).resolve()) is None):
        bins = [_own_prefix(recipe) / "bin"]
        if found is not None:
            bins.append(Path(found).parent.parent / recipe.npm_prefix / "bin")
        own = recipe.npm_prefix_bin or name
        found = shutil.which(own, path=os.pathsep.join(map(str, bins))) or found
    return found


def _node_for(modules: Path) -> Path | None:
    """The node an npm installation runs on: its prefix's own (`PREFIX/bin/node`, npm's `node`
    package installed into it), else the one on PATH; resolved to the binary itself."""
    own = modules.parent.parent / "bin" / "node"
    node = str(own) if own.exists() else shutil.which("node")
    return Path(node).resolve() if node else None


def _link_dir(target: Path | str, links: dict[str, str]) -> Path:
    """A cached directory of symbolic links name -> target, made once per content."""
    key = hashlib.sha256(repr((str(target), sorted(links.items()))).encode()).hexdigest()[:16]
    bin_dir = cache_dir() / "harness-bin" / key
    if not bin_dir.is_dir():
        tmp = bin_dir.with_name(bin_dir.name + f".{os.getpid()}")
        tmp.mkdir(parents=True, exist_ok=True)
        for name, dest in links.items():
            (tmp / name).unlink(missing_ok=True)
            (tmp / name).symlink_to(dest)
        try:
            tmp.rename(bin_dir)
        except OSError:  # made meanwhile by another process
            shutil.rmtree(tmp, ignore_errors=True)
    return bin_dir


def harness_mount(recipe: Recipe, binary: str | None = None) -> HarnessMount:
    """Where `recipe`'s binaries are installed on the host, as a HarnessMount.

    Raises HarnessNotInstalled (with the command that installs it) when none of them is on PATH,
    or the binary is part of neither an npm installation nor a virtualenv a container can run.
    """
    names = [binary] if binary else recipe.binaries
    found = next(((n, p) for n in names if (p := _find(recipe, n))), None)
    hint = _install_hint(recipe)
    if found is None:
        raise HarnessNotInstalled(f"{recipe.name}: none of {', '.join(names)} is on PATH{hint}")
    real = Path(found[1]).resolve()
    if _modules_root(real) is None and (venv := _venv_root(real)) is not None:
        return _python_mount(recipe, venv, hint)
    modules: Path | None = None
    links: dict[str, str] = {}
    for name in recipe.binaries:
        path = _find(recipe, name)
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
            f"{recipe.name}: {found[1]} is inside neither an npm installation (lib/node_modules) "
            f"nor a virtualenv (pyvenv.cfg); install it{hint} or use an image that has it"
        )
    return HarnessMount(modules=modules, bin=_link_dir(modules, links), node=_node_for(modules))


def _shebang_interpreter(script: Path) -> str | None:
    """The interpreter an entry script names: its `#!` line, or the `'''exec' PATH` line pip
    writes under `#!/bin/sh` when the path is too long for the kernel."""
    try:
        with script.open("rb") as f:
            head = f.read(4096).decode("utf-8", "replace").splitlines()
    except OSError:
        return None
    if not head or not head[0].startswith("#!"):
        return None
    first = head[0][2:].strip().split()
    if first and first[0] == "/bin/sh" and len(head) > 1 and head[1].startswith("'''exec' "):
        return head[1].split()[1]
    return first[0] if first else None


def _symlink_chain(path: str) -> list[str]:
    """`path` and every absolute path its symbolic links pass through, to the real file."""
    chain = [os.path.abspath(path)]
    for _ in range(40):
        try:
            target = os.readlink(chain[-1])
        except OSError:  # not a link (or gone): the end
            break
        chain.append(os.path.normpath(os.path.join(os.path.dirname(chain[-1]), target)))
    return chain


def _prefix_of(interpreter: str) -> str | None:
    """An interpreter's installation: the directory above its `bin`."""
    p = Path(interpreter)
    return str(p.parent.parent) if p.parent.name == "bin" else None


def _readable_by_others(path: Path) -> bool:
    mode = path.stat().st_mode
    need = stat.S_IROTH | (stat.S_IXOTH if stat.S_ISDIR(mode) else 0)
    return mode & need == need


def _python_mount(recipe: Recipe, venv_real: Path, hint: str) -> HarnessMount:
    """A PyPI harness's virtualenv and the interpreter installation it was built on, each shown at
    the path(s) its scripts and links name, and a bin directory of links to its entry scripts."""
    trees: dict[str, Path] = {}  # path in the sandbox -> host directory
    links: dict[str, str] = {}
    interpreter: str | None = None
    for name in recipe.binaries:
        path = _find(recipe, name)
        if path is None or _venv_root(Path(path).resolve()) != venv_real:
            continue
        script = Path(path).resolve()
        shebang = _shebang_interpreter(script)
        if shebang is None:
            raise HarnessNotInstalled(f"{recipe.name}: {script} has no #! line naming its interpreter")
        inside = _venv_root(Path(shebang))  # the virtualenv as its scripts name it
        if inside is None or inside.resolve() != venv_real:
            raise HarnessNotInstalled(
                f"{recipe.name}: {script} runs {shebang}, which is not the interpreter of its virtualenv "
                f"{venv_real}; reinstall it{hint}"
            )
        trees[str(inside)] = venv_real
        links[name] = f"{inside}/{script.relative_to(venv_real)}"
        interpreter = interpreter or shebang
    assert interpreter is not None  # harness_mount found one of the binaries in this virtualenv
    # The interpreter: every installation its link chain passes through, its real one (where the
    # binary's RPATH finds libpython) and the one pyvenv.cfg's `home` names (a pyenv version
    # reached through a symlinked directory is shown at each of its names).
    home = _pyvenv_cfg(venv_real).get("home")
    prefixes = {_prefix_of(p) for p in [*_symlink_chain(interpreter), os.path.realpath(interpreter)]}
    prefixes.add(_prefix_of(f"{home}/python") if home else None)
    for prefix in sorted(p for p in prefixes if p and p not in trees):
        host = Path(prefix).resolve()
        if prefix in SYSTEM_PREFIXES or str(host) in SYSTEM_PREFIXES:
            raise HarnessNotInstalled(
                f"{recipe.name}: {venv_real} is built on the system's Python ({prefix}), which a "
                "container cannot be shown without hiding its own; build the virtualenv on a "
                f"Python installed in a directory of its own (pyenv, uv python install){hint}"
            )
        if not (host / "lib").is_dir():
            raise HarnessNotInstalled(
                f"{recipe.name}: the interpreter of {venv_real} ({interpreter}) is not inside an "
                "installation (PREFIX/bin, PREFIX/lib) a container can be shown"
            )
        trees[prefix] = host
    if len(trees) < 2:
        raise HarnessNotInstalled(
            f"{recipe.name}: found no interpreter installation for {venv_real} (pyvenv.cfg home = {home})"
        )
    # Editable installs (`pip install -e`): their source trees, at the paths the venv names them by.
    shown = {*trees, *(str(host) for host in trees.values())}  # as named and as resolved
    for source in _editable_sources(venv_real):
        tree = PurePosixPath(source)
        if any(tree.is_relative_to(q) for q in shown):
            continue  # already shown (a `pip install -e git+…` clone under the venv's src/)
        if source in SYSTEM_PREFIXES or any(tree.is_relative_to(s) for s in SYSTEM_TREES):
            raise HarnessNotInstalled(
                f"{recipe.name}: {venv_real} has an editable install from {source}, a system "
                "directory a container cannot be shown without hiding its own; install it from a "
                f"directory of its own{hint}"
            )
        trees[source] = Path(source).resolve()
    for host in trees.values():
        if not _readable_by_others(host):
            raise HarnessNotInstalled(
                f"{recipe.name}: {host} is not readable by other users (the harness runs as an "
                f"unprivileged user in the container): chmod -R o+rX {host}"
            )
    return HarnessMount(
        modules=None,
        bin=_link_dir(venv_real, links),
        node=None,
        trees=sorted((host, inside) for inside, host in trees.items()),
        python=interpreter,
        env=dict(PYTHON_ENV),
    )


def _editable_sources(venv: Path) -> list[str]:
    """The directories `venv`'s site-packages puts on sys.path: the path lines of
    its `.pth` files (what hatchling, flit, pdm and uv write for an editable install, and any
    `.pth` a user adds), and the package directories of setuptools' editable finders (their
    `MAPPING`). Paths that do not exist are skipped, as Python skips them; the caller passes over
    those already shown (the virtualenv's own)."""
    out: list[str] = []
    for site in sorted(venv.glob("lib/python*/site-packages")):
        for pth in sorted(site.glob("*.pth")):
            for line in pth.read_text(errors="replace").splitlines():
                line = line.strip()
                if not line or line.startswith(("#", "import ", "import\t")):
                    continue
                path = os.path.normpath(os.path.join(site, line))
                if os.path.isdir(path):
                    out.append(path)
        for finder in sorted(site.glob("__editable___*_finder.py")):
            out += [p for p in _finder_mapping(finder) if os.path.isabs(p) and os.path.isdir(p)]
    return sorted(set(out))


def _finder_mapping(finder: Path) -> list[str]:
    """The package directories a setuptools editable finder maps its packages to (its `MAPPING`
    literal), read without running it."""
    try:
        tree = ast.parse(finder.read_text(errors="replace"))
    except SyntaxError:
        return []
    target: ast.expr
    for node in tree.body:
        if isinstance(node, ast.AnnAssign):
            target, value = node.target, node.value
        elif isinstance(node, ast.Assign):
            target, value = node.targets[0], node.value
        else:
            continue
        if isinstance(target, ast.Name) and target.id == "MAPPING" and value is not None:
            try:
                mapping = ast.literal_eval(value)
            except ValueError:
                return []
            return [v for v in mapping.values() if isinstance(v, str)] if isinstance(mapping, dict) else []
    return []


def _pyvenv_cfg(venv: Path) -> dict[str, str]:
    out: dict[str, str] = {}
    for line in (venv / "pyvenv.cfg").read_text(errors="replace").splitlines():
        key, sep, value = line.partition("=")
        if sep:
            out[key.strip()] = value.strip()
    return out
