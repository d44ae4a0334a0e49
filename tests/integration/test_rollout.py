"""Rollouts without containers: the pipeline on the local runtime, groups and advantages on export,
the per-task report, the egress policy, and the errors a user sees before anything starts.

The "harness" here is a shell command (`--harness-cmd`), so the pipeline's mechanics (stages,
retries, timeouts, early stop, cancellation, the store) are tested in seconds; real harnesses in
real containers are in tests/e2e/test_rollout_docker.py.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import ssl
import urllib.request
from pathlib import Path

import pyarrow.parquet as pq
import pytest

import polar_mitm.rollout.pipeline as pipeline_module
from polar_mitm.reconstruct.export import export
from polar_mitm.reconstruct.groups import advantages
from polar_mitm.reconstruct.report import rollout_reports
from polar_mitm.reconstruct.source import Selection
from polar_mitm.rollout.pipeline import Pipeline, RolloutOptions
from polar_mitm.sandbox.base import SandboxError, refuse_unenforced
from polar_mitm.sandbox.tempdir import TempdirRuntime
from polar_mitm.tasks.model import EvaluatorSpec, Task
from tests.support.helpers import MODEL_CALL, process_gone, wait_until_async


def shell_task(task_id: str, instruction: str, check: str, **kw) -> Task:
    return Task(
        id=task_id,
        instruction=instruction,
        evaluator=EvaluatorSpec(kind="command", command=check),
        **kw,
    )


def sh(cmd: str) -> list[str]:
    return ["sh", "-c", cmd, "harness", "{instruction}"]


async def run_pipeline(stack, tasks, tmp_path, runtime=None, **opts):
    options = RolloutOptions(harness="claude-code", runtime="local", **opts)
    p = Pipeline(options, stack.proxy, runtime or TempdirRuntime(), work_dir=tmp_path / "work")
    return p, await p.run(tasks)


def samples_of(db) -> list[tuple]:
    con = sqlite3.connect(db)
    return con.execute(
        "SELECT g.task_id, s.sample_index, s.attempt, s.status, s.reward, s.cause FROM samples s"
        " JOIN rollout_groups g ON g.id = s.group_id ORDER BY g.task_id, s.sample_index, s.attempt"
    ).fetchall()


async def test_groups_are_scored_recorded_and_reported(make_stack, tmp_path):
    stack = await make_stack()
    tasks = [
        shell_task("good", "write ok", "grep -q ok out.txt"),
        shell_task("bad", "write no", "grep -q ok out.txt"),
    ]
    p, result = await run_pipeline(
        stack, tasks, tmp_path, samples=3, harness_cmd=sh('echo "$1" | cut -d" " -f2 > out.txt')
    )
    assert not result.interrupted
    rows = samples_of(stack.db)
    assert [(t, i, st, r) for t, i, _a, st, r, _c in rows] == [
        *[("bad", i, "completed", 0.0) for i in range(3)],
        *[("good", i, "completed", 1.0) for i in range(3)],
    ]
    # Every sample is a session of the proxy, with its task and reward.
    con = sqlite3.connect(stack.db)
    sessions = con.execute(
        "SELECT s.task_id, s.reward, s.harness FROM sessions s JOIN samples x ON x.session_id = s.id"
    ).fetchall()
    assert sorted(sessions) == sorted([("bad", 0.0, "claude-code")] * 3 + [("good", 1.0, "claude-code")] * 3)
    reports = {r.task_id: r for r in rollout_reports(stack.db, result.rollout_id)}
    assert reports["good"].pass_at_1 == 1.0 and reports["good"].pass_at_k == 1.0
    assert reports["bad"].pass_at_1 == 0.0 and reports["bad"].mean_reward == 0.0
    assert reports["good"].groups_all_equal == 1  # all rewards equal: no GRPO signal
    assert set(reports["good"].stage_seconds) >= {"starting", "ready", "running", "scoring"}
    assert p.counts["done"] == 6 and p.counts["running"] == 0 and p.counts["queued"] == 0
    # `stats` reports the same per task.
    from click.testing import CliRunner

    from polar_mitm.cli import main

    r = CliRunner().invoke(main, ["stats", "--db", stack.db, "--json", "--rollout", result.rollout_id])
    by_task = {t["task_id"]: t for t in json.loads(r.output)["tasks"]}
    assert by_task["good"]["pass@1"] == 1.0 and by_task["good"]["pass@3"] == 1.0
    assert by_task["bad"]["mean_reward"] == 0.0 and by_task["bad"]["groups_all_equal"] == 1
    r = CliRunner().invoke(main, ["stats", "--db", stack.db])
    assert "rollout samples by task" in r.output and "(k=3)" in r.output
    assert not list((tmp_path / "work").iterdir())  # sample directories removed


@pytest.mark.slow
async def test_agent_timeout_is_trainable_with_reward_zero_and_kills_the_harness(make_stack, tmp_path):
    stack = await make_stack()
    marker, pid = tmp_path / "still-running", tmp_path / "child.pid"
    tasks = [shell_task("slow", "x", "true", agent_timeout_sec=0.5)]
    child = f"sh -c 'echo $$ > {pid}; sleep 2; touch {marker}'"
    _, result = await run_pipeline(stack, tasks, tmp_path, harness_cmd=sh(f"{child} & sleep 30"))
    [(_, _, _, status, reward, cause)] = samples_of(stack.db)
    assert (status, reward, cause) == ("agent_timeout", 0.0, "agent timeout")
    child_pid = int(pid.read_text())
    await wait_until_async(lambda: process_gone(child_pid), timeout=2, message="the harness's child killed")
    assert not marker.exists()  # the harness's own children were killed too


class FlakyRuntime(TempdirRuntime):
    """A local runtime whose first `failures` sandbox starts fail (an infrastructure failure)."""

    def __init__(self, failures: int):
        self.failures = failures

    async def start(self, task, spec):
        if self.failures > 0:
            self.failures -= 1
            raise SandboxError("the daemon refused to start the sandbox")
        return await super().start(task, spec)


async def test_sandbox_failures_are_retried_then_recorded_as_failed_never_dropped(make_stack, tmp_path):
    stack = await make_stack()
    tasks = [shell_task("t", "x", "true")]
    _, result = await run_pipeline(
        stack, tasks, tmp_path, runtime=FlakyRuntime(1), retries=1, harness_cmd=sh("true")
    )
    assert [r[2:4] for r in samples_of(stack.db)] == [(0, "retried"), (1, "completed")]

    stack2 = await make_stack()
    _, result = await run_pipeline(
        stack2, tasks, tmp_path / "b", runtime=FlakyRuntime(5), retries=1, harness_cmd=sh("true")
    )
    rows = samples_of(stack2.db)
    assert [r[2:5] for r in rows] == [(0, "retried", None), (1, "failed", 0.0)]
    assert "sandbox start: the daemon refused" in rows[-1][5]
    assert result.samples[0].status == "failed"


class UnboundedRuntime(TempdirRuntime):
    """A runtime that finds at its first start that it cannot enforce the memory limit (as
    Apptainer finds no cgroups when a start fails on them), after `rollout`'s check passed."""

    found = False

    def unenforced(self, limits):
        return "the memory limits (found at the first start)" if self.found and limits.memory_mb else None

    async def start(self, task, spec):
        self.found = True
        refuse_unenforced(self, spec.limits.for_task(task))
        return await super().start(task, spec)


async def test_a_start_refused_for_its_limits_fails_the_sample_at_once_and_allowed_it_runs(
    make_stack, tmp_path
):
    """The refusal is the same on every attempt: the sample fails with it, not retried."""
    stack = await make_stack()
    tasks = [shell_task("t", "x", "true")]
    await run_pipeline(stack, tasks, tmp_path, runtime=UnboundedRuntime(), retries=2, harness_cmd=sh("true"))
    [row] = samples_of(stack.db)
    assert row[2:5] == (0, "failed", 0.0) and "--allow-unenforced-limits" in row[5], row

    stack2 = await make_stack()
    await run_pipeline(
        stack2, tasks, tmp_path / "b", runtime=UnboundedRuntime(), retries=2, harness_cmd=sh("true"),
        allow_unenforced_limits=True,
    )  # fmt: skip
    assert [r[2:4] for r in samples_of(stack2.db)] == [(0, "completed")]


class BuggyRuntime(TempdirRuntime):
    """A runtime with a bug: an exception no stage expects, at sandbox start or in the harness run."""

    def __init__(self, where: str):
        self.where = where

    async def start(self, task, spec):
        if self.where == "start":
            raise ValueError("a bug in the runtime's start")
        box = await super().start(task, spec)
        if self.where == "run":

            async def broken(*a, **k):
                raise KeyError("a bug in the harness run")

            box.exec_harness = broken
        return box


@pytest.mark.parametrize("where", ["start", "run", "score"])
async def test_an_unexpected_error_in_a_stage_fails_the_sample_and_the_rollout_ends(
    make_stack, tmp_path, where, monkeypatch
):
    """A bug in one stage must not end the worker that runs it: the rollout would wait forever for
    a sample no worker holds. The sample is recorded failed with the error, the rest goes on."""
    stack = await make_stack()
    tasks = [shell_task("t", "x", "true")]
    if where == "score":

        async def broken_score(*a, **k):
            raise ZeroDivisionError("a bug in the scoring")

        monkeypatch.setattr(pipeline_module.verify, "score", broken_score)
    _, result = await asyncio.wait_for(
        run_pipeline(
            stack, tasks, tmp_path, runtime=BuggyRuntime(where), retries=0, samples=2, harness_cmd=sh("true")
        ),
        30,
    )
    rows = samples_of(stack.db)
    assert sorted(r[3] for r in rows) == ["failed", "failed"]
    assert all("a bug in the" in r[5] and "internal error" in r[5] for r in rows), rows
    assert [s.status for s in result.samples] == ["failed", "failed"]


async def test_early_stop_cancels_the_rest_of_the_group(make_stack, tmp_path):
    stack = await make_stack()
    tasks = [shell_task("t", "x", "true")]
    # Sample 0 finishes at once; the others would take 30 s.
    cmd = sh('mkdir "$HOME/../../first" 2>/dev/null || sleep 30')
    (tmp_path / "work").mkdir()
    _, result = await run_pipeline(
        stack, tasks, tmp_path, samples=4, early_stop=1, run_workers=2, harness_cmd=cmd
    )
    statuses = sorted(s.status for s in result.samples)
    assert statuses == ["cancelled", "cancelled", "cancelled", "completed"]
    assert result.seconds < 20
    assert {s.cause for s in result.samples if s.status == "cancelled"} == {"early stop: 1 usable samples in"}
    con = sqlite3.connect(stack.db)
    assert con.execute("SELECT status FROM rollout_groups").fetchone() == ("early_stopped",)


async def test_cancelling_a_rollout_stops_everything_and_records_every_sample(make_stack, tmp_path):
    stack = await make_stack()
    tasks = [shell_task("t", "x", "true")]
    options = RolloutOptions(harness="claude-code", runtime="local", samples=3, harness_cmd=sh("sleep 60"))
    p = Pipeline(options, stack.proxy, TempdirRuntime(), work_dir=tmp_path / "work")
    task = asyncio.create_task(p.run(tasks))
    await wait_until_async(lambda: p.counts["running"] >= 2, timeout=30, message="two samples running")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert sorted(r[3] for r in samples_of(stack.db)) == ["cancelled"] * 3
    con = sqlite3.connect(stack.db)
    assert con.execute("SELECT status FROM rollouts").fetchone() == ("interrupted",)


def test_advantages_std_and_leave_one_out():
    adv = advantages({"a": 1.0, "b": 0.0, "c": 0.0, "d": 1.0}, "std")
    assert adv == {"a": 1.0, "b": -1.0, "c": -1.0, "d": 1.0}
    loo = advantages({"a": 1.0, "b": 0.0, "c": 0.0}, "loo")
    assert loo == pytest.approx({"a": 1.0, "b": -0.5, "c": -0.5})
    assert advantages({"a": 0.5, "b": 0.5}, "std") == {"a": 0.0, "b": 0.0}  # no signal
    assert advantages({"a": 1.0}, "loo") == {"a": 0.0}


@pytest.mark.slow
async def test_export_carries_groups_masks_failed_samples_and_normalizes(make_stack, tmp_path):
    """Each 'harness' makes one real model call through the proxy (so its sample has a row), then
    the first sample of a group writes 'pass' and the others 'fail'. The evaluator of 'broken' cannot
    run (it cannot clear its reward file, "."): an evaluator failure, whose rows stay, masked. (A
    reward file it cannot parse is a result, 0 and suspect, not a failure.)"""
    stack = await make_stack()
    cmd = sh(
        MODEL_CALL
        + 'if mkdir "$HOME/../../first-$1" 2>/dev/null; then echo pass > out.txt; else echo fail > out.txt; fi\n'
        + "echo garbage > reward.txt"
    )
    tasks = [
        shell_task("mixed", "mixed", "grep -q pass out.txt"),
        Task(
            id="broken",
            instruction="broken",
            evaluator=EvaluatorSpec(kind="command", command="true", reward_file="."),
        ),
    ]
    (tmp_path / "work").mkdir()
    _, result = await run_pipeline(stack, tasks, tmp_path, samples=3, run_workers=1, harness_cmd=cmd)
    con = sqlite3.connect(stack.db)
    assert con.execute("SELECT COUNT(*) FROM turns WHERE status = 'ok'").fetchone() == (6,)
    out = tmp_path / "groups.parquet"
    export(stack.db, out, selection=Selection(rollout=result.rollout_id), normalize="std", quiet=True)
    rows = pq.read_table(out).to_pylist()
    mixed = sorted((r for r in rows if r["task_id"] == "mixed"), key=lambda r: -r["reward"])
    assert [r["reward"] for r in mixed] == [1.0, 0.0, 0.0]
    # std: mean 1/3, std sqrt(2)/3 -> +sqrt(2), -1/sqrt(2), -1/sqrt(2)
    assert [r["advantage"] for r in mixed] == pytest.approx([2**0.5, -(2**-0.5), -(2**-0.5)])
    assert {r["group_id"] for r in mixed} == {f"{result.rollout_id}/mixed"}
    assert sorted(r["sample_index"] for r in mixed) == [0, 1, 2]
    assert all(r["status"] == "completed" and sum(r["loss_mask"]) > 0 for r in mixed)
    assert json.loads(mixed[0]["reward_detail"])["evaluator"] == "command"
    broken = [r for r in rows if r["task_id"] == "broken"]
    assert len(broken) == 3  # failed samples are kept ...
    for r in broken:  # ... masked, with reward 0 and the cause
        assert r["status"] == "failed" and sum(r["loss_mask"]) == 0 and r["reward"] == 0.0
        assert r["advantage"] == 0.0
        assert json.loads(r["metadata"])["masked"].startswith("evaluator: task broken: cannot clear")
    export(stack.db, out, selection=Selection(rollout=result.rollout_id), normalize="loo", quiet=True)
    loo = sorted(
        (r["advantage"] for r in pq.read_table(out).to_pylist() if r["task_id"] == "mixed"), reverse=True
    )
    assert loo == pytest.approx([1.0, -0.5, -0.5])


async def test_offline_sessions_reach_only_the_hosts_the_proxy_answers(make_stack, tmp_path, certs_dir):
    """allow_internet = false: a CONNECT to any other host is refused with a 403 that says why,
    while the same session's model calls still work. The 'other host' is a loopback server."""
    from aiohttp import web

    app = web.Application()
    app.router.add_get("/", lambda r: web.Response(text="reachable"))
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    stack = await make_stack()
    stack.proxy.egress.deny_internet("offline")

    def fetch(session: str, url: str) -> str:
        handler = urllib.request.ProxyHandler(
            {"http": stack.proxy.session_url(session), "https": stack.proxy.session_url(session)}
        )
        ctx = ssl.create_default_context(cafile=str(stack.proxy.ca.cert))
        opener = urllib.request.build_opener(handler, urllib.request.HTTPSHandler(context=ctx))
        try:
            return opener.open(url, timeout=10).read().decode()
        except urllib.error.HTTPError as e:
            return f"{e.code} {e.read().decode()}"
        except OSError as e:
            return f"error {e}"

    try:
        online = await asyncio.to_thread(fetch, "online", f"http://127.0.0.1:{port}/")
        offline = await asyncio.to_thread(fetch, "offline", f"http://127.0.0.1:{port}/")
        tunnel = await asyncio.to_thread(fetch, "offline", f"https://127.0.0.1:{port}/")
        models = await asyncio.to_thread(fetch, "offline", "https://api.openai.com/v1/models")
    finally:
        await runner.cleanup()
    assert online == "reachable"
    assert offline.startswith("403") and "does not allow internet access" in offline
    assert "403" in tunnel  # CONNECT refused before any connection is made
    assert json.loads(models)["data"]  # the model's API still answers
    assert stack.proxy.egress.refused == 2


def test_pipeline_refuses_container_evaluators_on_the_local_runtime(tmp_path):
    harbor = Task(id="h", instruction="x", evaluator=EvaluatorSpec(kind="harbor", tests_dir=tmp_path))
    p = Pipeline(
        RolloutOptions(harness="claude-code", runtime="local"),
        None,
        TempdirRuntime(),
        work_dir=tmp_path,  # type: ignore[arg-type]
    )
    with pytest.raises(ValueError, match="needs a container: use --runtime docker"):
        p._check_task(harbor)


def test_a_recipe_without_a_headless_command_needs_harness_cmd(tmp_path):
    p = Pipeline(
        RolloutOptions(harness="generic", runtime="local"), None, TempdirRuntime(), work_dir=tmp_path
    )  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="pass --harness-cmd"):
        p._check_task(shell_task("t", "x", "true"))


def test_rollout_command_reports_bad_task_files_and_unknown_harnesses(tmp_path):
    from click.testing import CliRunner

    from polar_mitm.cli import main

    bad = tmp_path / "bad.toml"
    bad.write_text('id = "t"\ninstruction = "x"\nagent_timeout_sec = "long"\n')
    r = CliRunner().invoke(main, ["rollout", str(bad), "--harness", "claude-code", "--runtime", "local"])
    assert r.exit_code == 1 and "bad.toml" in r.output and "agent_timeout_sec" in r.output
    good = tmp_path / "good.toml"
    good.write_text('id = "t"\ninstruction = "x"\n')
    r = CliRunner().invoke(main, ["rollout", str(good), "--harness", "nope", "--runtime", "local"])
    assert r.exit_code == 2 and "unknown recipe 'nope'" in r.output


def test_rollout_command_checks_the_backend_before_anything_starts(tmp_path):
    from click.testing import CliRunner

    from polar_mitm.cli import main

    good = tmp_path / "good.toml"
    good.write_text('id = "t"\ninstruction = "x"\n')
    db = tmp_path / "x.sqlite"
    r = CliRunner().invoke(
        main,
        [
            "rollout",
            str(good),
            "--harness",
            "claude-code",
            "--runtime",
            "local",
            "--backend",
            "http://127.0.0.1:9",
            "--db",
            str(db),
        ],
    )
    assert r.exit_code == 78 and "cannot reach the policy backend at http://127.0.0.1:9" in r.output
    assert not db.exists()


def test_rollout_command_says_when_docker_is_not_running(tmp_path, monkeypatch):
    from click.testing import CliRunner

    from polar_mitm.cli import main

    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path}/no-docker.sock")
    good = tmp_path / "good.toml"
    good.write_text('id = "t"\ninstruction = "x"\nimage = "polar-mitm/rollout-base:bookworm"\n')
    r = CliRunner().invoke(
        main, ["rollout", str(good), "--harness", "claude-code", "--db", str(tmp_path / "x.sqlite")]
    )
    assert r.exit_code == 1 and "cannot reach the Docker daemon" in r.output and "dockerd" in r.output
    assert not (tmp_path / "x.sqlite").exists()  # nothing started, nothing written


def test_reward_files_and_pytest_summaries_are_read_as_their_tools_write_them():
    from polar_mitm.rollout.evaluators import parse_reward, patched_files, pytest_results

    assert parse_reward(b"1\n", "r") == 1.0 and parse_reward('{"reward": 0.25}', "r.json") == 0.25
    assert parse_reward('{"accuracy": 0.5}', "r.json") == 0.5  # a single metric
    assert parse_reward('{"a": 1, "b": 0}', "r.json") == 0.5  # several: their mean (every key kept)
    out = "PASSED tests/test_calc.py::test_add\nFAILED tests/test_calc.py::test_sub - assert 1 == 2\n"
    assert pytest_results(out) == {
        "tests/test_calc.py::test_add": "PASSED",
        "tests/test_calc.py::test_sub": "FAILED",
    }
    assert patched_files("--- a/x.py\n+++ b/x.py\n@@\n+++ b/y/z.py\n") == ["x.py", "y/z.py"]


async def test_a_reward_file_the_agent_leaves_does_not_count_and_the_detail_says_where_it_ran(
    make_stack, tmp_path
):
    """The command writes the reward file only when the task is solved; the agent writes it
    itself without solving. On the local runtime scoring stays in the agent's directory, as the
    detail records."""
    stack = await make_stack()
    check = "if grep -q solved out.txt 2>/dev/null; then echo 1 > reward.txt; fi"
    task = Task(
        id="forged",
        instruction="x",
        evaluator=EvaluatorSpec(kind="command", command=check, reward_file="reward.txt"),
    )
    await run_pipeline(stack, [task], tmp_path, harness_cmd=sh("echo 1 > reward.txt"))
    [(_t, _i, _a, status, reward, _c)] = samples_of(stack.db)
    assert (status, reward) == ("completed", 0.0)
    [detail] = sqlite3.connect(stack.db).execute("SELECT reward_detail FROM samples").fetchone()
    verifier = json.loads(detail)["verifier"]
    assert verifier["sandbox"] == "agent" and verifier["runtime"] == "local" and not verifier["isolated"]


def test_harbor_reward_file_is_the_one_the_tests_name_else_reward_json_first(tmp_path):
    from polar_mitm.rollout.evaluators import harbor_reward_names, harbor_reward_order

    (tmp_path / "test.sh").write_text("python3 /tests/grade.py\n")
    assert harbor_reward_names(tmp_path) == []
    (tmp_path / "grade.py").write_text("open('/logs/verifier/reward.json', 'w').write('1')\n")
    assert harbor_reward_names(tmp_path) == ["reward.json"]
    # Named: only that file counts, even when the other one is there too.
    assert harbor_reward_order(["reward.json"])[0] == ["reward.json"]
    # Not named (or both): Harbor's order, reward.json when it was written, else reward.txt.
    assert harbor_reward_order([])[0] == ["reward.json", "reward.txt"]


def test_swebench_artefacts_leave_out_what_comes_from_the_image():
    import io
    import tarfile

    from polar_mitm.rollout.evaluators import from_image
    from polar_mitm.rollout.verify import without

    spec = EvaluatorSpec(
        kind="swebench",
        test_command="pytest",
        test_patch="--- a/tests/test_new.py\n+++ b/tests/test_new.py\n",
        fail_to_pass=["tests/test_calc.py::test_add", "../escape.py::t"],
    )
    keep = from_image(spec)
    assert keep.paths == (".git", "pytest.ini", "tests/test_calc.py", "tests/test_new.py")
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, kind in [("testbed", tarfile.DIRTYPE), ("testbed/.git", tarfile.DIRTYPE),
                           ("testbed/.git/HEAD", tarfile.REGTYPE), ("testbed/calc.py", tarfile.REGTYPE),
                           ("testbed/conftest.py", tarfile.REGTYPE), ("testbed/sub/conftest.py", tarfile.REGTYPE),
                           ("testbed/tests", tarfile.SYMTYPE), ("testbed/pytest.ini", tarfile.REGTYPE)]:  # fmt: skip
            member = tarfile.TarInfo(name)
            member.type = kind
            if kind == tarfile.SYMTYPE:
                member.linkname = "/usr/lib"
            tar.addfile(member, io.BytesIO(b"") if kind == tarfile.REGTYPE else None)
    out = io.BytesIO()
    dropped = without(buf, keep, out)
    assert dropped == [".git", "conftest.py", "sub/conftest.py", "tests", "pytest.ini"]
    out.seek(0)
    with tarfile.open(fileobj=out) as tar:
        assert tar.getnames() == ["testbed", "testbed/calc.py"]


def test_the_example_tasks_load_as_harbor_tasks():
    from polar_mitm.tasks import load_tasks

    tasks = load_tasks([Path(__file__).resolve().parents[2] / "examples" / "tasks"])
    assert [t.id for t in tasks] == ["answer-right", "answer-wrong"]
    assert all(t.evaluator.kind == "harbor" and not t.allow_internet and t.workdir == "/app" for t in tasks)


async def test_a_samples_side_calls_are_tagged_by_its_own_harness_s_rules(make_stack, tmp_path):
    """The proxy has no recipe (a node's has none); each sample's session carries its spec's. A
    call whose system prompt is another harness's side call (aider's commit message) is a main turn
    of a Claude Code sample, and a side call of an aider one, in the same pipeline. Before, every
    recipe's rules tagged every session of such a proxy."""
    from polar_mitm.rollout.spec import Specs

    stack = await make_stack()
    system = "'system': 'You write one-line Git commit messages based on the provided diffs.', "
    call = MODEL_CALL.replace("'max_tokens': 8, ", "'max_tokens': 8, " + system)
    assert call != MODEL_CALL
    p = Pipeline(RolloutOptions(), stack.proxy, work_dir=tmp_path / "work")
    await p.start()
    specs, runtime = Specs(), TempdirRuntime()
    task = shell_task("t", "x", "true")
    for harness in ("claude-code", "aider"):
        await p.add(task, spec=await specs.get(harness, sh(call), runtime), group_id=harness, size=1)
    await p.drain()
    await p.close()
    assert [(j.final, j.cause) for j in p.jobs] == [("completed", None)] * 2
    con = sqlite3.connect(stack.db)
    tags = con.execute(
        "SELECT s.harness, t.tag FROM turns t JOIN sessions s ON s.id = t.session_id"
    ).fetchall()
    assert sorted(tags, key=str) == [("aider", "commit-message"), ("claude-code", None)]
