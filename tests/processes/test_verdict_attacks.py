"""The verdict, attacked again from the program the tests run (real containers; Docker and the
real Apptainer): each attack here paid 1.0 (or masked a failure as `failed`) before the tests
were mounted read-only, the verdict read strictly, a timeout scored as a result, per-test
results read first-wins against pytest's report, and the canary added; each gets 0 with status
`completed` now, the cause under `suspect`, while an honest solution gets 1.0 and an honest wrong
answer 0.0.

The "agent" is a shell script (`--harness-cmd`) that writes the program named in its instruction
(`prog:NAME`) where the tests will run it: /app/solution.py for the Harbor and `command` tasks,
calc.py of the repository for the SWE-bench ones.
"""

from __future__ import annotations

import base64
import json
import os
import resource
from pathlib import Path

import pytest

from polar_mitm.rollout import verdict
from polar_mitm.tasks import load_tasks
from polar_mitm.tasks.model import EvaluatorSpec, Task
from tests.processes.test_reward_cheats import harbor_task, rollout
from tests.support.docker_rollout import TEST_IMAGE

pytestmark = [pytest.mark.docker, pytest.mark.slow]

# The programs the tests run. Each answers 41 (wrong) unless it is an honest one.
PROGRAMS = {
    "honest": "print(42)\n",
    "wrong": "print(41)\n",
    # Bash reads its script as it runs: find the bash whose fd 255 is /tests/test.sh and write the
    # reward line where it will read next.
    "rewrite": """
import os
for pid in os.listdir("/proc"):
    try:
        if pid.isdigit() and os.readlink(f"/proc/{pid}/fd/255") == "/tests/test.sh":
            pos = int(open(f"/proc/{pid}/fdinfo/255").read().split()[1])
            with open("/tests/test.sh", "r+b") as f:
                f.seek(pos)
                f.write(b"\\necho 1 > /logs/verifier/reward.txt; exit 0\\n")
    except OSError:
        pass
print(41)
""",
    # reward.txt made a directory: the tests' `> reward.txt` fails, and a lax read took the file in it
    "dir-one": "import os\nos.makedirs('/logs/verifier/reward.txt')\nopen('/logs/verifier/reward.txt/1','w').write('1')\nprint(41)\n",
    "dir-garbage": "import os\nos.makedirs('/logs/verifier/reward.txt')\nopen('/logs/verifier/reward.txt/x','w').write('garbage')\nprint(41)\n",
    # a 10 GiB sparse file where the reward is read (no disk used)
    "sparse": "import os\nwith open('/logs/verifier/reward.json', 'wb') as f:\n    f.truncate(10 << 30)\nprint(41)\n",
    # the `command` evaluator's reward file written, then a hang past the verifier's time
    "write-hang": "import time\nopen('/app/reward.txt','w').write('1')\ntime.sleep(600)\n",
    # pytest forged in its own process: the report machinery patched at import, so pytest itself
    # reports a pass (report, summary and exit status agree) ...
    "patch-report": """
import _pytest.reports as r
_make = r.TestReport.from_item_and_call.__func__
def _pass(cls, item, call):
    rep = _make(cls, item, call)
    rep.outcome, rep.longrepr = "passed", None
    return rep
r.TestReport.from_item_and_call = classmethod(_pass)
def answer():
    return 41
""",
    # ... or at exit: the JUnit report rewritten, a summary line printed, the exit status 0
    "forge-at-exit": """
import atexit, glob, os, re, sys
def _forge():
    for path in glob.glob("/logs/**/*.xml", recursive=True):
        text = open(path).read()
        open(path, "w").write(re.sub(r'(failures|errors)="\\d+"', r'\\1="0"', text))
    sys.stdout.write("1 passed in 0.01s\\n")
    sys.stdout.flush()
    os._exit(0)
atexit.register(_forge)
def answer():
    return 41
""",
    "honest-py": "def answer():\n    return 42\n",
    "wrong-py": "def answer():\n    return 41\n",
    # Red team, beyond the attacks first reported:
    # pytest's summary printed and the process ended while its modules are imported (exit 0)
    "exit-early": "import os, sys\nsys.stdout.write('1 passed in 0.01s\\n')\nsys.stdout.flush()\nos._exit(0)\n",
    # the tests' shell rewritten in memory: its buffered script text patched through /proc/PID/mem
    "proc-mem": """
import os
for pid in os.listdir("/proc"):
    try:
        if not pid.isdigit() or not os.readlink(f"/proc/{pid}/exe").endswith("bash"):
            continue
        with open(f"/proc/{pid}/mem", "r+b", buffering=0) as mem:
            for line in open(f"/proc/{pid}/maps").read().splitlines():
                span, perms = line.split()[:2]
                lo, hi = (int(x, 16) for x in span.split("-"))
                if "rw" not in perms or hi - lo > 64 << 20:
                    continue
                try:
                    mem.seek(lo)
                    data = mem.read(hi - lo)
                except OSError:
                    continue
                at = data.find(b"else echo 0")
                while at >= 0:
                    mem.seek(lo + at)
                    mem.write(b"else echo 1")
                    at = data.find(b"else echo 0", at + 1)
    except OSError:
        pass
print(41)
""",
    # ... and the same through ptrace: attach to the tests' shell, find the line in its heap, poke
    "ptrace": """import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
libc.ptrace.restype = ctypes.c_long
libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
ATTACH, PEEK, POKE, DETACH = 16, 2, 5, 17
def patch(pid):
    if libc.ptrace(ATTACH, pid, None, None) != 0:
        return "attach refused: " + os.strerror(ctypes.get_errno())
    os.waitpid(pid, 0)
    hits = 0
    try:
        for line in open(f"/proc/{pid}/maps"):
            span, perms = line.split()[:2]
            if "rw" not in perms or "[heap]" not in line:
                continue
            lo, hi = (int(x, 16) for x in span.split("-"))
            buf = bytearray()
            for a in range(lo, hi, 8):
                w = libc.ptrace(PEEK, pid, ctypes.c_void_p(a), None)
                buf += (w & 0xFFFFFFFFFFFFFFFF).to_bytes(8, "little")
            at = buf.find(b"else echo 0")
            while at >= 0:
                pos = at + len("else echo ")
                word = pos - pos % 8
                data = bytearray(buf[word:word + 8]); data[pos - word] = ord("1")
                libc.ptrace(POKE, pid, ctypes.c_void_p(lo + word), ctypes.c_void_p(int.from_bytes(data, "little")))
                buf[pos] = ord("1"); hits += 1
                at = buf.find(b"else echo 0", at + 1)
    finally:
        libc.ptrace(DETACH, pid, None, None)
    return f"patched {hits}"
me = os.getpid()
for pid in os.listdir("/proc"):
    try:
        if pid.isdigit() and int(pid) != me and os.readlink(f"/proc/{pid}/exe").endswith("bash"):
            patch(int(pid))
    except OSError:
        pass
print(41)
""",
    # an interpreter hook in the tests' working directory, loaded at start-up were it on the path
    "sitecustomize": {
        "/app/solution.py": "def answer():\n    return 41\n",
        "/app/sitecustomize.py": "PATCH",
        "/app/usercustomize.py": "PATCH",
    },
    # the verifier's init signalled; a flood of files where the verdict is read
    "kill-init": "import os\ntry:\n    os.kill(1, 9)\nexcept OSError:\n    pass\nprint(41)\n",
    "many-files": "import os\nos.makedirs('/logs/verifier/junk')\nfor i in range(20000):\n"
    "    open(f'/logs/verifier/junk/{i}', 'w').close()\nprint(41)\n",
    # reward.txt a link to a file holding 1 (the tests then write through it)
    "symlink": "import os\nopen('/tmp/one','w').write('1')\nos.symlink('/tmp/one', '/logs/verifier/reward.txt')\nprint(41)\n",
    # the reward written by the program itself, then the tests that ran it killed, or made to fail
    # before they write theirs (Harbor reads whatever reward file is left, whatever the exit status)
    "write-kill": """
import os, signal
open("/logs/verifier/reward.txt", "w").write("1")
for pid in os.listdir("/proc"):
    try:
        if pid.isdigit() and os.readlink(f"/proc/{pid}/exe").endswith("bash"):
            os.kill(int(pid), signal.SIGKILL)
    except OSError:
        pass
print(41)
""",
    "write-abort": "open('/logs/verifier/reward.txt', 'w').write('1')\nprint(41)\n",
}
PROGRAMS["sitecustomize"] = {
    k: PROGRAMS["patch-report"].replace("def answer():\n    return 41\n", "") if v == "PATCH" else v
    for k, v in PROGRAMS["sitecustomize"].items()  # type: ignore[union-attr]
}


def _writes(prog: str | dict[str, str]) -> str:
    files = {"/app/solution.py": prog} if isinstance(prog, str) else prog
    return "; ".join(
        f"echo {base64.b64encode(src.encode()).decode()} | base64 -d > {path}" for path, src in files.items()
    )


AGENT = "\n".join(
    ['case "$1" in']
    + [f'  *"prog:{name} "*) {_writes(src)} ;;' for name, src in PROGRAMS.items()]
    + ["esac", "exit 0"]
)
# The tests run the program, then (a line later: bash reads on after the program ends) score it.
RUN = (
    "out=$(python3 /app/solution.py 2>/dev/null)\n"
    'if [ "$out" = 42 ]; then echo 1; else echo 0; fi > /logs/verifier/reward.txt\n'
)
PYTEST = (
    "cd /app && python3 -m pytest -q -p no:cacheprovider /tests/test_solution.py\n"
    "if [ $? -eq 0 ]; then echo 1; else echo 0; fi > /logs/verifier/reward.txt\n"
)
TEST_SOLUTION = "import sys\nsys.path.insert(0, '/app')\nfrom solution import answer\n\n\ndef test_answer():\n    assert answer() == 42\n"


def harbor(root: Path, name: str, prog: str, test_sh: str) -> Path:
    d = harbor_task(root, name, "none", test_sh)
    (d / "instruction.md").write_text(f"Print 42. prog:{prog} .\n")
    (d / "tests" / "test_solution.py").write_text(TEST_SOLUTION)
    return d


def outcomes(got: dict) -> dict[str, tuple[str, float]]:
    return {t: (status, reward) for t, (status, reward, _) in got.items()}


def details(got: dict) -> dict[str, dict]:
    return {t: d for t, (_, _, d) in got.items()}


async def test_harbor_attacks_from_the_program_the_tests_run_get_nothing(
    make_stack, tmp_path, docker_client, runtime
):
    root = tmp_path / "tasks"
    for name in ("rewrite", "dir-one", "dir-garbage", "sparse", "honest", "wrong"):
        harbor(root, name, name, RUN)
    for name in ("patch-report", "forge-at-exit", "honest-py", "wrong-py", "exit-early", "sitecustomize"):
        harbor(root, name, name, PYTEST)
    for name in ("proc-mem", "ptrace", "kill-init", "many-files", "symlink", "write-kill"):
        harbor(root, name, name, RUN)
    # The tests run the agent's program through our helper: as nobody, it can neither write the
    # reward nor touch the tests' shell.
    untrusted = RUN.replace("$(python3", "$(/opt/polar-mitm/verifier/untrusted python3")
    harbor(root, "untrusted-write-kill", "write-kill", untrusted)
    harbor(root, "untrusted-honest", "honest", untrusted)
    harbor(root, "write-abort", "write-abort", 'set -e\nout=$(python3 /app/solution.py)\n[ "$out" = 42 ]\n'
           "echo 1 > /logs/verifier/reward.txt\n")  # fmt: skip
    # The named reward file itself, huge (tests that stop at a wrong answer and never write it):
    # refused by its size, before a byte of it is read.
    harbor(root, "sparse-named", "sparse", 'set -e\nout=$(python3 /app/solution.py)\n[ "$out" = 42 ]\n'
           "echo 1 > /logs/verifier/reward.json\n")  # fmt: skip
    tasks = [
        *load_tasks([root]),
        Task(
            id="write-hang",
            instruction="Print 42. prog:write-hang .",
            image=TEST_IMAGE,
            workdir="/app",
            evaluator=EvaluatorSpec(
                kind="command", command="python3 /app/solution.py", reward_file="reward.txt", timeout_sec=5
            ),
        ),
    ]
    stack = await make_stack()
    peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    got = await rollout(stack, tasks, tmp_path, docker_client, runtime, harness=AGENT)
    grew_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak_before) / 1024
    print(f"\nreading every verdict (a 10 GiB sparse one among them) grew the peak RSS by {grew_mb:.0f} MB")
    assert outcomes(got) == {
        "rewrite": ("completed", 0.0),
        "dir-one": ("completed", 0.0),
        "dir-garbage": ("completed", 0.0),
        "sparse": ("completed", 0.0),
        "sparse-named": ("completed", 0.0),
        "write-hang": ("completed", 0.0),
        "patch-report": ("completed", 0.0),
        "forge-at-exit": ("completed", 0.0),
        "honest": ("completed", 1.0),
        "wrong": ("completed", 0.0),
        "honest-py": ("completed", 1.0),
        "wrong-py": ("completed", 0.0),
        "exit-early": ("completed", 0.0),
        "sitecustomize": ("completed", 0.0),
        "proc-mem": ("completed", 0.0),
        "ptrace": ("completed", 0.0),
        "kill-init": ("completed", 0.0),
        "many-files": ("completed", 0.0),
        "symlink": ("completed", 0.0),
        "write-kill": ("completed", 0.0),
        "write-abort": ("completed", 0.0),
        "untrusted-write-kill": ("completed", 0.0),
        "untrusted-honest": ("completed", 1.0),
    }, details(got)
    d = details(got)
    assert any("never finished" in s for s in d["exit-early"]["suspect"]), d["exit-early"]
    assert d["sitecustomize"]["reward_file"] == "0\n"  # not loaded: pytest ran honestly
    assert d["proc-mem"]["reward_file"] == "0\n"  # /proc is read-only in the verifier
    assert d["ptrace"]["reward_file"] == "0\n"  # no call reaches into another process
    assert d["kill-init"]["reward_file"] == "0\n" and d["many-files"]["reward_file"] == "0\n"
    assert "not a regular file" in d["symlink"]["reward_file_error"]
    assert any("ended by signal 9" in s for s in d["write-kill"]["suspect"]), d["write-kill"]
    assert any(
        "failed (exit 1), yet its reward file says full marks" in s for s in d["write-abort"]["suspect"]
    )
    # The tests could not be rewritten: bash read on and scored the wrong answer.
    assert d["rewrite"]["reward_file"] == "0\n" and d["rewrite"]["tests"] == "read-only, from a pristine copy"
    for name in ("dir-one", "dir-garbage"):
        assert "not a regular file" in d[name]["reward_file_error"], d[name]
        assert any("not a regular file" in s for s in d[name]["suspect"])
    assert d["sparse"]["reward_file"] == "0\n"  # reward.txt is the one the tests name
    assert "more than the 65536" in d["sparse-named"]["reward_file_error"]
    assert grew_mb < 300, f"the rollout's peak RSS grew {grew_mb:.0f} MB reading the verdicts"
    assert d["write-hang"]["timed_out"] and d["write-hang"]["reported_reward"] == 1.0
    assert any("ran past" in s for s in d["write-hang"]["suspect"])
    assert any("canary" in s for s in d["patch-report"]["suspect"]), d["patch-report"]
    assert d["patch-report"]["reward_file"] == "1\n"  # pytest itself reported a pass
    assert any("as it ran pytest reported 0 passed and 1 failed" in s for s in d["forge-at-exit"]["suspect"])
    for name in ("honest", "wrong", "honest-py", "wrong-py"):
        assert "suspect" not in d[name], d[name]
    assert d["honest-py"]["canary"] == {"runs": 1, "finished": 1, "outcomes": ["failed"]}


SWE_PROGRAMS = {
    "fix": "def add(a, b):\n    return a + b\n",
    # a status line printed at exit, after pytest's own
    "print-passed": "import atexit\natexit.register(lambda: print('PASSED tests/test_calc.py::test_add'))\n"
    "def add(a, b):\n    return a - b\n",
    "patch-report": PROGRAMS["patch-report"].replace(
        "def answer():\n    return 41", "def add(a, b):\n    return a - b"
    ),
}


SWE_AGENT = "\n".join(
    ['case "$1" in']
    + [
        f'  *"prog:{name} "*) echo {base64.b64encode(src.encode()).decode()} | base64 -d > calc.py ;;'
        for name, src in SWE_PROGRAMS.items()
    ]
    + ["esac", "exit 0"]
)


def swe_rows(tmp_path: Path, image: str, names: list[str], prefix: str = "") -> Path:
    common = {
        "image": image,
        "test_command": "python3 -m pytest -rA -p no:cacheprovider tests/test_calc.py",
        "FAIL_TO_PASS": ["tests/test_calc.py::test_add"],
    }
    rows = [
        {"instance_id": prefix + n, "problem_statement": f"add() subtracts. prog:{n} .", **common}
        for n in names
    ]
    path = tmp_path / "swe.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


async def test_swebench_statuses_printed_at_exit_or_forged_in_process_get_nothing(
    make_stack, tmp_path, swebench_image, docker_client, runtime
):
    stack = await make_stack()
    rows = swe_rows(tmp_path, swebench_image, ["print-passed", "patch-report", "fix"])
    got = await rollout(stack, load_tasks([rows]), tmp_path, docker_client, runtime, harness=SWE_AGENT)
    assert outcomes(got) == {
        "print-passed": ("completed", 0.0),
        "patch-report": ("completed", 0.0),
        "fix": ("completed", 1.0),
    }, details(got)
    d = details(got)
    assert d["print-passed"]["FAIL_TO_PASS"] == {"tests/test_calc.py::test_add": "FAILED"}  # the first line
    assert d["patch-report"]["FAIL_TO_PASS"] == {"tests/test_calc.py::test_add": "PASSED"}  # forged ...
    assert any("canary" in s for s in d["patch-report"]["suspect"])  # ... and caught
    assert "suspect" not in d["fix"] and d["fix"]["reported"] == {"tests/test_calc.py::test_add": "passed"}


async def test_the_canary_alone_catches_both_pytest_forgeries(
    make_stack, tmp_path, swebench_image, docker_client, monkeypatch
):
    """With every other check switched off (no seal leftovers, no report totals, no per-test
    comparison), the forgeries above are still caught: by the canary and its record, which no
    rule written for them; honest runs keep their rewards."""
    monkeypatch.setattr(verdict, "CHECKS", frozenset({"canary"}))
    root = tmp_path / "tasks"
    for name in ("patch-report", "forge-at-exit", "honest-py", "wrong-py"):
        harbor(root, name, name, PYTEST)
    stack = await make_stack()
    got = await rollout(stack, load_tasks([root]), tmp_path, docker_client, harness=AGENT)
    assert outcomes(got) == {
        "patch-report": ("completed", 0.0),
        "forge-at-exit": ("completed", 0.0),
        "honest-py": ("completed", 1.0),
        "wrong-py": ("completed", 0.0),
    }, details(got)
    got = await rollout(
        stack,
        load_tasks([swe_rows(tmp_path, swebench_image, ["patch-report", "fix"], prefix="swe-")]),
        tmp_path,
        docker_client,
        harness=SWE_AGENT,
    )
    swe = {t: v for t, v in outcomes(got).items() if t.startswith("swe-")}
    assert swe == {"swe-patch-report": ("completed", 0.0), "swe-fix": ("completed", 1.0)}, details(got)


MIRROR_TEST = (
    "python3 -c \"import urllib.request; urllib.request.urlretrieve('http://{mirror}:8000/tool.sh', '/tmp/tool.sh')\""
    " && bash /tmp/tool.sh\n"
)
TOOL = 'if [ "$(cat /app/answer.txt 2>/dev/null)" = 42 ]; then echo 1; else echo 0; fi > /logs/verifier/reward.txt\n'


@pytest.fixture
def mirror(docker_client):
    """A package mirror on a private network (10.213.7.0/24, a Docker network of this test's
    own): what a cluster's PyPI or apt proxy is."""
    import docker.types

    name = f"polar-test-mirror-{os.getpid()}"
    ipam = docker.types.IPAMConfig(pool_configs=[docker.types.IPAMPool(subnet="10.213.7.0/24")])
    net = docker_client.networks.create(name, driver="bridge", ipam=ipam)
    script = base64.b64encode(TOOL.encode()).decode()
    server = docker_client.containers.run(
        TEST_IMAGE,
        [
            "sh",
            "-c",
            f"mkdir -p /srv && echo {script} | base64 -d > /srv/tool.sh && cd /srv && exec python3 -m http.server 8000",
        ],
        detach=True,
        network=name,
        name=f"{name}-server",
    )
    try:
        server.reload()
        yield server.attrs["NetworkSettings"]["Networks"][name]["IPAddress"]
    finally:
        server.remove(force=True)
        net.remove()


async def test_a_private_mirror_is_reached_only_when_the_operator_allows_it(
    make_stack, tmp_path, docker_client, mirror
):
    """The verifier fetches its tool from a mirror on a private address: refused by default (the
    egress rules keep sandboxes off private networks), so the tests write 0, and
    reward_detail.egress_refused says the network decided it; with `--egress-allow` naming the
    mirror, the same solved task scores 1.0. Before, there was no way to allow it and nothing in the
    detail said why the 0."""
    root = tmp_path / "tasks"
    d = harbor(root, "mirror", "honest", MIRROR_TEST.format(mirror=mirror))
    (d / "task.toml").write_text(
        "[agent]\ntimeout_sec = 60\n[verifier]\ntimeout_sec = 60\n"
        f'[environment]\ndocker_image = "{TEST_IMAGE}"\nnetwork_mode = "public"\n'
    )
    agent = 'case "$1" in *prog:*) echo 42 > /app/answer.txt ;; esac'
    refused = await rollout(
        await make_stack(), load_tasks([root]), tmp_path / "a", docker_client, harness=agent
    )
    allowed = await rollout(
        await make_stack(egress_allow=[mirror]),
        load_tasks([root]),
        tmp_path / "b",
        docker_client,
        harness=agent,
    )
    assert outcomes(refused) == {"mirror": ("completed", 0.0)}, details(refused)
    assert details(refused)["mirror"]["egress_refused"]["verifier"] == {mirror: 1}
    assert outcomes(allowed) == {"mirror": ("completed", 1.0)}, details(allowed)
    assert "egress_refused" not in details(allowed)["mirror"]
