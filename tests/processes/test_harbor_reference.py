"""polar-mitm's verdicts on Harbor tasks against Harbor's own, side by side.

Small tasks of our own (each `FROM` the local test image, no network) are run by Harbor itself
(`harbor run -a oracle|nop -e docker`, tests/support/harbor_ref.py) and by polar-mitm's rollout
pipeline with the same two agents: the task's `solution/solve.sh` run as root as the harness
(Harbor's oracle), and a harness that does nothing (Harbor's nop). Every pair of verdicts must
be equal: the reward a trainer gets and, where Harbor keeps several keys, every key.

A kind of task where polar-mitm is known to differ from Harbor is marked `xfail(strict=True)`
with the difference as the reason (none today), so it fails loudly once the verdicts agree.

One Harbor job per agent runs every task at once, beside polar-mitm's own rollout of all of them
(module-scoped: the parametrized cases only read the verdicts).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import http.server
import json
import os
import sqlite3
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from polar_mitm.rollout.pipeline import Pipeline, RolloutOptions
from polar_mitm.rollout.spec import Specs
from polar_mitm.sandbox.docker import DockerRuntime
from polar_mitm.tasks import load_tasks
from tests.support.docker_rollout import TEST_IMAGE
from tests.support.harbor_ref import HarborVerdict, finish_harbor, harbor_missing, start_harbor

pytestmark = [pytest.mark.docker, pytest.mark.slow]

LABEL = "polar-mitm.rollout"
SOLVED = '[ "$(cat /app/answer.txt 2>/dev/null)" = 42 ]'


@dataclass
class Case:
    """One task: its test.sh, its solution, and what differs from Harbor today (None: agrees)."""

    test_sh: str
    solve_sh: str = "echo 42 > /app/answer.txt"
    files: dict[str, str] = field(default_factory=dict)  # more files under the task's directory
    task_toml: str = ""  # more task.toml lines
    oracle_differs: str | None = None
    nop_differs: str | None = None


CASES: dict[str, Case] = {
    "plain": Case(f"if {SOLVED}; then echo 1; else echo 0; fi > /logs/verifier/reward.txt"),
    "plain-json": Case(
        f'if {SOLVED}; then r=1; else r=0; fi; echo "{{\\"reward\\": $r}}" > /logs/verifier/reward.json'
    ),
    # Harbor's multi-reward recipe: every key kept, the scalar `reward` key absent.
    "multi-key": Case(
        f"if {SOLVED}; then r=1; else r=0; fi\n"
        'echo "{\\"correctness\\": $r, \\"performance\\": $r}" > /logs/verifier/reward.json',
    ),
    # Both files: Harbor reads reward.json first.
    "both-files": Case(
        f"echo 0 > /logs/verifier/reward.txt\nif {SOLVED}; then r=1; else r=0; fi\n"
        'echo "{\\"reward\\": $r}" > /logs/verifier/reward.json',
    ),
    # A partial reward, then the test script exits non-zero (as `pytest; exit $?` does).
    "partial-exit": Case(
        f"if {SOLVED}; then echo 0.5; else echo 0; fi > /logs/verifier/reward.txt\nexit 1",
    ),
    # The solution installs a Python package outside the workdir, which the tests import.
    "installs-package": Case(
        'python3 -c "import answerpkg, sys; sys.exit(answerpkg.ANSWER != 42)"'
        " && echo 1 > /logs/verifier/reward.txt || echo 0 > /logs/verifier/reward.txt",
        solve_sh="d=$(python3 -c 'import site; print(site.getsitepackages()[0])')/answerpkg\n"
        'mkdir -p "$d" && echo "ANSWER = 42" > "$d/__init__.py"',
    ),
    # The solution edits a file outside the workdir.
    "edits-etc": Case(
        'if [ "$(cat /etc/answer.conf 2>/dev/null)" = 42 ]; then echo 1; else echo 0; fi > /logs/verifier/reward.txt',
        solve_sh="echo 42 > /etc/answer.conf",
    ),
}

# Tests that fetch their tool while they verify, from a mirror on a private address: this host's
# Docker bridge address (a server the fixture starts), which Harbor's containers reach directly
# and polar-mitm's verifier through its proxy, as `--egress-allow` names it.
MIRROR_HOST = "172.17.0.1"
MIRROR_TOOL = f"if {SOLVED}; then echo 1; else echo 0; fi > /logs/verifier/reward.txt\n"
CASES["downloads-tool"] = Case(
    "python3 -c \"import urllib.request; urllib.request.urlretrieve('http://"
    + MIRROR_HOST
    + ":@PORT@/tool.sh', '/tmp/tool.sh')\" && bash /tmp/tool.sh"
)

# A multi-step task: three steps in one environment, each its own instruction, solution and
# verifier setting; step two gets a file in its workdir, step three tests of its own (laid over
# the task's); step one gates the rest (min_reward), the reward is the steps' mean.
MULTI_STEP = "multi-step"
MULTI_STEP_TOML = """[[steps]]
name = "one"
min_reward = 1.0
[steps.verifier]
env = { WANT = "/app/s1=1" }
[[steps]]
name = "two"
[steps.verifier]
env = { WANT = "/app/s2=2" }
[[steps]]
name = "three"
"""
MULTI_STEP_TEST = 'f=${WANT%%=*}; if [ "$(cat "$f" 2>/dev/null)" = "${WANT#*=}" ]; then echo 1; else echo 0; fi > /logs/verifier/reward.txt'
MULTI_STEP_STEPS = {
    # name: (solution, the step's own test.sh or None, files of its workdir/)
    "one": ("echo 1 > /app/s1", None, {}),
    "two": ("cp /app/seed.txt /app/s2", None, {"seed.txt": "2\n"}),
    "three": (
        "cat /app/s1 /app/s2 | paste -sd+ > /app/s3",
        'if [ "$(cat /app/s3 2>/dev/null)" = "1+2" ]; then echo 1; else echo 0; fi > /logs/verifier/reward.txt',
        {},
    ),
}

AGENTS = ("oracle", "nop")


# The tasks' image: the test image with /app as its working directory (where Harbor runs the
# oracle, uploads a step's workdir and runs the tests; an `[environment] workdir` would be a
# `docker exec -w`, which needs the directory in the image). Built once from the local test image
# (nothing pulled) and named by `docker_image`, so neither Harbor nor polar-mitm builds per task.
TASK_IMAGE = f"polar-mitm/test-harbor-ref:{os.getpid()}"


def task_toml(top: str = "", tables: str = "") -> str:
    """task.toml: top-level keys first (a key after a table header belongs to that table)."""
    return (
        top
        + f'[agent]\ntimeout_sec = 120\n[verifier]\ntimeout_sec = 60\n[environment]\ndocker_image = "{TASK_IMAGE}"\n'
        + tables
    )


def write_task(root: Path, name: str, case: Case) -> Path:
    d = root / name
    (d / "tests").mkdir(parents=True)
    (d / "solution").mkdir()
    # The case's name in the instruction tells the polar-mitm harness which solution to run
    # (Harbor's oracle reads solution/ itself and ignores the instruction).
    (d / "instruction.md").write_text(f"Write 42 to /app/answer.txt. case:{name};\n")
    (d / "task.toml").write_text(task_toml(tables=case.task_toml))
    (d / "tests" / "test.sh").write_text("#!/bin/bash\n" + case.test_sh + "\n")
    (d / "solution" / "solve.sh").write_text("#!/bin/bash\nset -e\n" + case.solve_sh + "\n")
    for rel, text in case.files.items():
        (d / rel).parent.mkdir(parents=True, exist_ok=True)
        (d / rel).write_text(text)
    return d


def write_multi_step_task(root: Path) -> Path:
    d = root / MULTI_STEP
    (d / "tests").mkdir(parents=True)
    (d / "task.toml").write_text(task_toml('multi_step_reward_strategy = "mean"\n', MULTI_STEP_TOML))
    (d / "tests" / "test.sh").write_text("#!/bin/bash\n" + MULTI_STEP_TEST + "\n")
    for name, (solve, test_sh, files) in MULTI_STEP_STEPS.items():
        step = d / "steps" / name
        (step / "solution").mkdir(parents=True)
        (step / "instruction.md").write_text(f"Step {name}. case:{MULTI_STEP}/{name};\n")
        (step / "solution" / "solve.sh").write_text("#!/bin/bash\nset -e\n" + solve + "\n")
        if test_sh is not None:
            (step / "tests").mkdir()
            (step / "tests" / "test.sh").write_text("#!/bin/bash\n" + test_sh + "\n")
        for rel, text in files.items():
            (step / "workdir").mkdir(exist_ok=True)
            (step / "workdir" / rel).write_text(text)
    return d


def oracle_harness(root: Path) -> str:
    """One shell script that runs, as the harness, the solve.sh of the task (or step) its
    instruction names."""
    arms = []
    for d in sorted(p for p in root.iterdir() if p.is_dir()):
        solutions = {d.name: d / "solution" / "solve.sh"}
        if (d / "steps").is_dir():
            solutions = {f"{d.name}/{s.name}": s / "solution" / "solve.sh" for s in (d / "steps").iterdir()}
        for marker, path in solutions.items():
            arms.append(f"  *case:{marker}\\;*) bash -s <<'SOLVE_EOF'\n{path.read_text()}SOLVE_EOF\n  ;;")
    return "\n".join(["cd /app || exit 1", 'case "$1" in', *arms, "esac"])


@dataclass
class PolarVerdict:
    status: str
    reward: float | None
    detail: dict

    @property
    def rewards(self) -> dict | None:
        """Every key of the verifier's reward file, where the evaluator keeps them."""
        return self.detail.get("rewards")


@dataclass
class Verdicts:
    harbor: dict[str, dict[str, HarborVerdict]] | None  # None: Harbor cannot run here
    polar: dict[str, dict[str, PolarVerdict]]
    seconds: float
    harbor_missing: str | None = None

    def pair(self, agent: str, case: str) -> tuple[HarborVerdict, PolarVerdict]:
        """Harbor's verdict and ours on one case; the test skips where Harbor cannot run."""
        if self.harbor is None:
            pytest.skip(f"no Harbor to compare with: {self.harbor_missing}")
        return self.harbor[agent][case], self.polar[agent][case]


_RUN: dict[str, Verdicts | BaseException] = {}  # the one run every case reads (module-wide)


@pytest.fixture
async def verdicts(tmp_path_factory, docker_client, make_stack) -> Verdicts:
    """Harbor's and polar-mitm's verdict on every case with every agent, all run at once, the
    first time a test asks; the later ones read the same (or the same error: never run twice)."""
    if "run" not in _RUN:
        try:
            _RUN["run"] = await _run_all(tmp_path_factory.mktemp("harbor-ref"), docker_client, make_stack)
        except Exception as e:
            _RUN["run"] = e
            raise
    got = _RUN["run"]
    if isinstance(got, BaseException):
        raise RuntimeError(f"the run of Harbor and polar-mitm failed: {got!r}")
    return got


@contextlib.contextmanager
def mirror(directory: Path):
    """An HTTP server on MIRROR_HOST serving `directory`; yields its port."""
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(directory))
    server = http.server.ThreadingHTTPServer((MIRROR_HOST, 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


async def _run_all(tmp: Path, docker_client, make_stack) -> Verdicts:
    (tmp / "mirror").mkdir()
    (tmp / "mirror" / "tool.sh").write_text(MIRROR_TOOL)
    with mirror(tmp / "mirror") as port:
        return await _run_tasks(tmp, docker_client, make_stack, port)


async def _run_tasks(tmp: Path, docker_client, make_stack, port: int) -> Verdicts:
    root = tmp / "tasks"
    for name, case in CASES.items():
        case = dataclasses.replace(case, test_sh=case.test_sh.replace("@PORT@", str(port)))
        write_task(root, name, case)
    write_multi_step_task(root)
    t0 = time.monotonic()
    (tmp / "image").mkdir()
    (tmp / "image" / "Dockerfile").write_text(f"FROM {TEST_IMAGE}\nWORKDIR /app\n")
    docker_client.images.build(path=str(tmp / "image"), tag=TASK_IMAGE, rm=True)
    try:
        return await _run_both(root, tmp, docker_client, make_stack, t0)
    finally:
        docker_client.images.remove(TASK_IMAGE, force=True)


async def _run_both(root: Path, tmp: Path, docker_client, make_stack, t0: float) -> Verdicts:
    jobs = tmp / "jobs"
    missing = harbor_missing()  # without Harbor, polar-mitm's side still runs (and is checked)
    procs = {} if missing else {a: start_harbor(root, a, jobs, concurrent=len(CASES) + 1) for a in AGENTS}
    try:
        polar = await _polar(root, tmp, docker_client, make_stack)
        harbor = {a: await asyncio.to_thread(finish_harbor, p, jobs, a, 600) for a, p in procs.items()}
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
    return Verdicts(None if missing else harbor, polar, time.monotonic() - t0, missing)


async def _polar(root: Path, tmp: Path, docker_client, make_stack) -> dict[str, dict[str, PolarVerdict]]:
    stack = await make_stack(egress_allow=[MIRROR_HOST])  # the operator's mirror, on purpose
    runtime = DockerRuntime()
    # Harbor's oracle runs solve.sh as the environment's user: root here.
    options = RolloutOptions(
        harness="claude-code", runtime="docker", retries=0, harness_user=None,
        init_workers=4, run_workers=4, postrun_workers=4,
    )  # fmt: skip
    p = Pipeline(options, stack.proxy, runtime, work_dir=tmp / "work")
    resolve = Specs()
    specs = {
        "oracle": await resolve.get(
            "claude-code", ["sh", "-c", oracle_harness(root), "harness", "{instruction}"], runtime
        ),
        "nop": await resolve.get("claude-code", ["sh", "-c", "exit 0", "nop", "{instruction}"], runtime),
    }
    tasks = load_tasks([root])
    await p.start()
    try:
        for agent, spec in specs.items():
            for t in tasks:
                await p.add(t, group_id=f"{agent}/{t.id}", size=1, spec=spec)
        await p.drain()
    finally:
        await p.close()
    left = docker_client.containers.list(all=True, filters={"label": f"{LABEL}={p.rollout_id}"})
    assert [c.name for c in left] == []
    rows = sqlite3.connect(stack.db).execute(
        "SELECT group_id, status, reward, reward_detail, cause FROM samples"
    )
    out: dict[str, dict[str, PolarVerdict]] = {a: {} for a in AGENTS}
    for gid, status, reward, detail, cause in rows:
        agent, task = gid.split("/", 1)
        out[agent][task] = PolarVerdict(status, reward, json.loads(detail) if detail else {"cause": cause})
    return out


def agree(harbor: HarborVerdict, polar: PolarVerdict) -> bool:
    """Equal verdicts: a completed sample with Harbor's reward, and Harbor's every key where it
    kept several."""
    if harbor.exception is not None or polar.status != "completed":
        return False
    if len(harbor.rewards or {}) > 1 and polar.rewards != harbor.rewards:
        return False
    expected = harbor.reward
    if expected is None:  # several keys and no `reward`: the scalar is polar-mitm's choice
        return polar.reward is not None
    return polar.reward == pytest.approx(expected)


def _params():
    for name, case in CASES.items():
        for agent in AGENTS:
            differs = case.oracle_differs if agent == "oracle" else case.nop_differs
            marks = [pytest.mark.xfail(strict=True, reason=differs)] if differs else []
            yield pytest.param(name, agent, marks=marks, id=f"{name}-{agent}")


@pytest.mark.parametrize(("case", "agent"), list(_params()))
def test_polar_mitm_gives_harbors_verdict(verdicts, case, agent):
    harbor, polar = verdicts.pair(agent, case)
    assert agree(harbor, polar), {"harbor": harbor, "polar-mitm": polar}


@pytest.mark.parametrize("agent", AGENTS)
def test_a_multi_step_task_gets_harbors_verdict_step_by_step(verdicts, agent):
    """The oracle passes all three steps (mean 1.0); the no-op fails step one, below its
    min_reward, and no later step runs (0.0 after one step), in polar-mitm and in Harbor alike.
    Each step was verified in a fresh container; between steps the agent's was kept."""
    polar = verdicts.polar[agent][MULTI_STEP]
    expected = [("one", 1.0), ("two", 1.0), ("three", 1.0)] if agent == "oracle" else [("one", 0.0)]
    assert (polar.status, polar.reward) == ("completed", 1.0 if agent == "oracle" else 0.0), polar
    assert [(s["name"], s["reward"]) for s in polar.detail["steps"]] == expected, polar.detail
    assert polar.detail["stopped_early"] is (agent == "nop") and polar.detail["steps_total"] == 3
    assert all(s["detail"]["verifier"]["sandbox"] == "fresh" for s in polar.detail["steps"]), polar.detail
    if agent == "oracle":
        first, second = (s["detail"]["verifier"] for s in polar.detail["steps"][:2])
        assert first["agent_sandbox"] == polar.detail["verifier"]["agent_sandbox"]  # one agent sandbox
        assert (
            "agent_kept" in first and "agent_kept" in second and "agent_kept" not in polar.detail["verifier"]
        )
    harbor, polar = verdicts.pair(agent, MULTI_STEP)
    assert agree(harbor, polar), {"harbor": harbor, "polar-mitm": polar}
    assert [(s["name"], (s["rewards"] or {}).get("reward")) for s in harbor.steps] == expected


def test_the_reference_itself(verdicts):
    """Harbor gives the oracle full marks and the no-op none on every case: the tasks test
    what they mean to (and the comparison is not between two wrong answers)."""
    print(f"\nHarbor x2 and polar-mitm on {len(CASES) + 1} tasks: {verdicts.seconds:.0f} s")
    if verdicts.harbor is None:
        pytest.skip(f"no Harbor here: {verdicts.harbor_missing}")
    for name in CASES:
        oracle, nop = verdicts.harbor["oracle"][name], verdicts.harbor["nop"][name]
        assert oracle.exception is None and nop.exception is None, (name, oracle, nop)
        full = 0.5 if name == "partial-exit" else 1.0
        assert all(v == full for v in (oracle.rewards or {}).values()), (name, oracle)
        assert all(v == 0 for v in (nop.rewards or {}).values()), (name, nop)
