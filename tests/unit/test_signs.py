"""Signs that point somewhere: the module and file names a module's docstring, README.md and
docs/*.md name in backticks (`polar_mitm/x/y.py`, `proxy/addons/egress.py`,
`polar_mitm.rollout.verify`), and their relative links, must lead to something that exists. A
file that moves or a module that is renamed fails here, naming the doc that still points at it."""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "polar_mitm"
DOCS = [
    ROOT / "README.md",
    ROOT / "CONTRIBUTING.md",
    ROOT / "CHANGELOG.md",
    *sorted((ROOT / "docs").glob("*.md")),
]
# The folders a path in backticks may start from: the repository's, and the package's own (as in
# `proxy/addons/egress.py`). Paths under other folders are other projects' (`srt/managers/…`).
TOP = ("polar_mitm", "tests", "docs", "scripts", "examples", "bench", ".ci", "certs") + tuple(
    sorted(p.name for p in PACKAGE.iterdir() if p.is_dir() and not p.name.startswith("_"))
)
FILE = re.compile(r"^[\w.\-]+\.(?:py|md|sh|toml|cjs|js|jinja)$")  # a bare file name
PATH = re.compile(r"^[\w.\-/]+$")
MODULE = re.compile(r"^polar_mitm(?:\.\w+)+(?:\(\))?$")
# Files a doc names that live outside this repository (a harness's or the user's).
# A Harbor task's files; the interpreter's hook the threat model speaks of; a model directory's.
OUTSIDE = {
    "task.toml",
    "test.sh",
    "solve.sh",
    "tests/test.sh",
    "sitecustomize.py",
    "pytest.py",
    "chat_template.jinja",
}
# Upper-case stems that are placeholders (`polar_mitm/recipes/NAME.toml`), not files.
NOT_PLACEHOLDERS = {"README", "CHANGELOG", "CONTRIBUTING", "LICENSE"}


def _prose(text: str) -> str:
    """The text without fenced code blocks (commands and output, not signs)."""
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def _backticked(text: str) -> list[str]:
    return [t.strip() for t in re.findall(r"`([^`\n]+)`", _prose(text))]


def _module_docstrings() -> list[tuple[Path, str]]:
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        doc = ast.get_docstring(ast.parse(path.read_text()))
        if doc:
            out.append((path, doc))
    return out


@cache
def _repo_files() -> frozenset[str]:
    skip = {".git", ".venv", "node_modules", "__pycache__", "demo"}
    return frozenset(
        p.name for p in ROOT.rglob("*") if p.is_file() and not skip & set(p.relative_to(ROOT).parts)
    )


def _file_exists(name: str, here: Path) -> bool:
    name = name.removeprefix("./")
    if name in OUTSIDE:
        return True
    stem = Path(name).stem
    if stem.isupper() and stem not in NOT_PLACEHOLDERS:
        return True
    if "/" not in name:  # a bare file name: beside the doc, or anywhere in the repository
        return (here / name).exists() or name in _repo_files()
    bases = [ROOT, PACKAGE, here, *[p for p in here.parents if ROOT in (p, *p.parents)]]
    return any((b / name).exists() for b in bases)


@cache
def _top_names(path: Path) -> frozenset[str]:
    names: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.ImportFrom):
            names |= {a.asname or a.name for a in node.names}
    return frozenset(names)


def _module_exists(dotted: str) -> bool:
    """`polar_mitm.a.b` is a module or package, or `polar_mitm.a.b.name` a top-level name of one."""
    parts = dotted.removesuffix("()").split(".")
    for n in range(len(parts), 0, -1):
        base = ROOT.joinpath(*parts[:n])
        path = base / "__init__.py" if base.is_dir() else base.with_suffix(".py")
        if path.is_file():
            rest = parts[n:]
            return not rest or rest[0] in _top_names(path)
    return False


def _broken_names(text: str, here: Path) -> list[str]:
    bad = []
    for token in _backticked(text):
        token = re.sub(r":\d+(?:-\d+)?$", "", token)  # path:line
        if MODULE.match(token):
            if not _module_exists(token):
                bad.append(token)
        elif FILE.match(token) or (PATH.match(token) and token.startswith(tuple(t + "/" for t in TOP))):
            if token.endswith("/"):
                continue
            if not _file_exists(token, here):
                bad.append(token)
    return bad


def test_module_docstrings_name_modules_and_files_that_exist():
    bad = [
        f"{p.relative_to(ROOT)}: {n}" for p, doc in _module_docstrings() for n in _broken_names(doc, p.parent)
    ]
    assert not bad, "names that lead nowhere:\n" + "\n".join(bad)


def test_readme_and_docs_name_modules_and_files_that_exist():
    bad = [f"{d.relative_to(ROOT)}: {n}" for d in DOCS for n in _broken_names(d.read_text(), d.parent)]
    assert not bad, "names that lead nowhere:\n" + "\n".join(bad)


def _anchors(md: Path) -> set[str]:
    """GitHub's anchors of a markdown file's headings."""
    seen: dict[str, int] = {}
    out = set()
    for line in _prose(md.read_text()).splitlines():
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def test_relative_links_lead_to_files_and_headings_that_exist():
    bad = []
    for doc in DOCS:
        for target in re.findall(r"\]\(([^)\s]+)\)", _prose(doc.read_text())):
            if re.match(r"^[a-z]+:", target):  # https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            dest = (doc.parent / path).resolve() if path else doc
            if not dest.exists():
                bad.append(f"{doc.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                bad.append(f"{doc.relative_to(ROOT)}: {target} (no such heading)")
    assert not bad, "links that lead nowhere:\n" + "\n".join(bad)


def test_the_schema_in_docs_data_md_lists_every_parquet_column():
    from polar_mitm.reconstruct.trajectory import TRAJECTORY_SCHEMA

    text = (ROOT / "docs" / "data.md").read_text()
    table = text.split("#### Parquet schema", 1)[1].split("\n\n", 2)[1]
    listed = re.findall(r"^\| `(\w+)` \|", table, flags=re.M)
    assert listed == TRAJECTORY_SCHEMA.names


def test_the_checks_catch_what_they_look_for(tmp_path):
    """A name or link that leads nowhere is caught (so an empty result above means something)."""
    assert _broken_names("see `polar_mitm/cli.py` and `polar_mitm.rollout.nowhere`", PACKAGE) == [
        "polar_mitm/cli.py",
        "polar_mitm.rollout.nowhere",
    ]
    assert _broken_names("`proxy/addons/egress.py`, `polar_mitm.rollout.verify`", PACKAGE) == []
    assert _broken_names(
        "`polar_mitm.bridges.verl.agent_loop_class()`, `polar_mitm.cli.app.gone`", PACKAGE
    ) == ["polar_mitm.cli.app.gone"]
    (tmp_path / "a.md").write_text("# A title, here\n")
    assert _anchors(tmp_path / "a.md") == {"a-title-here"}
