"""The import structure: each part imports only the parts below it, and no module imports itself
back through others. Measured from the code's own `import` statements (ast), so a new upward
import or circle fails here, with the import that makes it."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "polar_mitm"

# From the bottom up; a part may import parts of its own floor or below. Where two parts share a
# floor they do not import each other (the circle check below holds them to it).
FLOORS: list[set[str]] = [
    {
        "neutral",
        "sse",
        "outcomes",
        "redact",
        "auth",
        "tasks",
        "procs",
        "strategies",
        "retry",
        "netaddr",
        "cache",
        "jsontext",
        "once",
    },
    {"recipes", "store", "providers"},
    {"backends", "api"},
    {"policy"},
    {"fake", "reconstruct"},
    {"proxy"},
    {"sandbox", "client"},
    {"harness"},
    {"rollout"},
    {"service", "bridges", "view"},
    {"cli", "mitmdump"},
    {"__main__"},
]


def part(module: str) -> str:
    return module.split(".")[1] if module.count(".") >= 1 else module


def floor_of(p: str) -> int:
    return next(i for i, f in enumerate(FLOORS) if p in f)


def module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports() -> dict[str, set[str]]:
    """module -> the polar_mitm modules it imports (anywhere in it, lazy imports too)."""
    out: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        name = module_name(path)
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found |= {a.name for a in node.names if a.name.startswith("polar_mitm")}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                if node.module.startswith("polar_mitm"):
                    found.add(node.module)
                    # `from polar_mitm.x import y` may name a module y
                    found |= {f"{node.module}.{a.name}" for a in node.names}
        out[name] = found
    known = set(out)
    return {m: {i for i in deps if i in known and i != m} for m, deps in out.items()}


def test_every_part_is_on_a_floor():
    parts = {part(m) for m in imports() if m != "polar_mitm"}
    missing = parts - set().union(*FLOORS)
    assert not missing, f"put these parts on a floor of FLOORS: {sorted(missing)}"


def test_no_import_runs_from_a_lower_floor_up():
    up = []
    for m, deps in imports().items():
        if m == "polar_mitm":
            continue
        for d in deps:
            if d == "polar_mitm" or part(d) == part(m):
                continue
            if floor_of(part(d)) > floor_of(part(m)):
                up.append(f"{m} -> {d}")
    assert not up, "imports from a lower floor up:\n" + "\n".join(sorted(up))


def test_no_circle_between_modules():
    graph = imports()
    state: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for d in sorted(graph.get(m, ())):
            # a package's __init__ importing its own submodules is how packages work
            if d.startswith(m + "."):
                continue
            if state.get(d) == 1:
                circles.append(stack[stack.index(d) :] + [d])
            elif d not in state:
                visit(d)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
    assert not circles, "circles:\n" + "\n".join(" -> ".join(c) for c in circles)


def _loaded(imports: str, modules: tuple[str, ...]) -> list[str]:
    """Which of `modules` a fresh interpreter has loaded once it ran `import <imports>`."""
    code = f"import sys, {imports}\nprint([m for m in {modules!r} if m in sys.modules])\n"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return ast.literal_eval(out.stdout.strip())


@pytest.mark.slow
def test_the_trainers_client_loads_no_proxy_no_server_and_no_policy():
    bad = ("mitmproxy", "aiohttp.web", "polar_mitm.policy", "polar_mitm.proxy", "polar_mitm.service.server")
    assert _loaded("polar_mitm.client", (*bad, "tokenizers", "pyarrow")) == []


@pytest.mark.slow
def test_rendering_and_the_engine_apis_load_no_http():
    """The pure rooms of `backends/` (rendering, each engine API's words) load neither aiohttp
    nor the engine client: only the client speaks HTTP."""
    pure = (
        "polar_mitm.backends.render, polar_mitm.backends.sglang, polar_mitm.backends.vllm, "
        "polar_mitm.backends.vllm_generate"
    )
    assert _loaded(pure, ("aiohttp", "polar_mitm.backends.engine_client")) == []
