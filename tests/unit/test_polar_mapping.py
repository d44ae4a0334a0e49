"""Polar's TaskRequest mapped onto ours, field by field, and what polar-mitm will not do refused
with Polar's field named; our samples written back in Polar's shapes, valid under Polar's models
(`tests/support/polar_schema.py`, written from Polar's published schemas)."""

from __future__ import annotations

import json
import subprocess

import pytest

from polar_mitm.service import polar_models as p
from polar_mitm.service.http import ApiError
from polar_mitm.store.service import SampleRow, TaskSummary
from polar_mitm.strategies import Strategy
from tests.support import polar_schema as polar


def request(**kw) -> p.TaskRequest:
    body = {
        "task_id": "t1",
        "instruction": "fix it",
        "agent": {"harness": "claude_code"},
        "runtime": {"image": "img:1"},
        **kw,
    }
    return p.TaskRequest.model_validate(body)


def test_every_field_polar_sends_lands_on_ours(tmp_path):
    tests = tmp_path / "task" / "tests"
    tests.mkdir(parents=True)
    req = request(
        num_samples=4,
        dispatch_priority=7,
        early_stop_min_usable_sessions=3,
        timeout_seconds=900,
        runtime={
            "image": " img:1 ",
            "workdir": "/app",
            "env": {"A": "1", "B": "runtime"},
            "cpus": 2,
            "memory_mb": 2048,
            "prepare": [{"type": "exec", "command": "make", "cwd": "/src", "env": {"X": "y z"}}],
        },
        agent={"harness": "claude_code", "env": {"B": "agent"}, "model_name": "any"},
        builder={"strategy": "prefix_merging"},
        evaluator={
            "strategy": "harbor",
            "config": {"tests_dir": str(tests), "verifier_timeout": 30},
            "env": {"E": "1"},
        },
        metadata={"agent_timeout": 300, "group_id": 5, "policy_version": 2},
    )
    ours = p.to_request(req, task_root=tmp_path)
    assert ours.task is not None
    t = ours.task
    assert (ours.task_id, t.id, t.instruction) == ("t1", "t1", "fix it")
    assert (ours.num_samples, ours.priority, ours.early_stop_min_usable) == (4, 7, 3)
    assert (ours.harness, ours.runtime, ours.builder) == ("claude-code", "docker", Strategy.PREFIX_MERGE)
    assert (t.image, t.workdir, t.cpus, t.memory_mb) == ("img:1", "/app", 2, 2048)
    assert t.env == {"A": "1", "B": "agent"}  # the agent's env over the runtime's
    assert t.setup == ["cd /src && X='y z' sh -c make"]
    assert (t.agent_timeout_sec, t.total_timeout_sec, ours.timeout_seconds, ours.agent_timeout_seconds) == (
        300.0,
        900.0,
        900.0,
        300.0,
    )
    assert (t.evaluator.kind, t.evaluator.tests_dir, t.evaluator.timeout_sec) == ("harbor", tests, 30.0)
    assert t.evaluator.env == {"E": "1"}
    kept = ours.metadata[p.KEY]
    assert kept["metadata"] == {"agent_timeout": 300, "group_id": 5, "policy_version": 2}
    # What is done differently is recorded, field by field, never silently.
    assert set(kept["recorded"]) == {"runtime.network", "runtime.allow_internet", "agent.model_name"}


def test_polars_defaults_are_polars_per_request_builder_and_its_timeout():
    ours = p.to_request(request())
    assert ours.builder == Strategy.PER_REQUEST  # Polar's default, not ours (prefix-merge)
    assert ours.task is not None
    assert (ours.timeout_seconds, ours.task.agent_timeout_sec, ours.task.evaluator.kind) == (
        600.0,
        600.0,
        "session_completed",
    )
    assert "evaluator" in ours.metadata[p.KEY]["recorded"]


def test_network_none_is_no_internet_and_nothing_recorded_for_it():
    ours = p.to_request(request(runtime={"image": "i", "network": "none", "allow_internet": True}))
    assert ours.task is not None and ours.task.allow_internet is False
    assert not ours.metadata[p.KEY]["recorded"].keys() & {"runtime.network", "runtime.allow_internet"}


def test_a_shell_harness_runs_its_command_with_the_instruction_as_its_first_argument(tmp_path):
    ours = p.to_request(
        request(
            agent={
                "harness": "shell",
                "custom_shell": {"command": 'echo "$1" > out', "cwd": str(tmp_path), "env": {"K": "v"}},
            }
        )
    )
    assert ours.harness == "generic" and ours.task is not None and ours.task.env == {"K": "v"}
    assert ours.harness_cmd is not None
    argv = [a.replace("{instruction}", "do 'this'") for a in ours.harness_cmd]
    subprocess.run(argv, check=True)
    assert (tmp_path / "out").read_text() == "do 'this'\n"


def test_prepare_retries_are_run_as_polar_runs_them(tmp_path):
    """max_attempts: the step runs again until it succeeds, and fails the setup after the last."""
    count = tmp_path / "n"
    flaky = f"echo x >> {count}; [ $(wc -l < {count}) -ge 3 ]"
    _, [line] = p._prepare([p.PrepareAction(type="exec", command=flaky, max_attempts=3)], None)
    assert subprocess.run(["sh", "-c", line]).returncode == 0
    assert count.read_text().count("x") == 3
    count.unlink()
    _, [line] = p._prepare([p.PrepareAction(type="exec", command=flaky, max_attempts=2)], None)
    assert subprocess.run(["sh", "-c", line + "; echo after"], capture_output=True, text=True).returncode == 1


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"agent": {"import_path": "my.Agent"}}, "agent.import_path"),
        (
            {
                "agent": {
                    "harness": "claude_code",
                    "mcp_servers": [{"name": "m", "transport": "sse", "url": "http://x"}],
                }
            },
            "agent.mcp_servers",
        ),
        ({"agent": {"harness": "claude_code", "skills_path": "/skills"}}, "agent.skills_path"),
        ({"agent": {"harness": "nope"}}, "agent.harness"),
        ({"runtime": None}, "runtime"),
        ({"runtime": {"image": "i", "import_path": "x.Y"}}, "runtime.import_path"),
        ({"runtime": {"image": "i", "gpus": 1}}, "runtime.gpus"),
        ({"runtime": {"image": "i", "internet_volumes": ["/run/x.sock"]}}, "runtime.internet_volumes"),
        (
            {"runtime": {"image": "i", "eval_prepare": [{"type": "exec", "command": "x"}]}},
            "runtime.eval_prepare",
        ),
        ({"runtime": {"image": "i", "direct_exec_init_command": "x"}}, "runtime.direct_exec_init_command"),
        ({"runtime": {"image": "i", "network": "container:db"}}, "runtime.network"),
        ({"runtime": {"image": "i", "kwargs": {"privileged": True}}}, "runtime.kwargs.privileged"),
        (
            {
                "runtime": {
                    "image": "i",
                    "prepare": [
                        {"type": "exec", "command": "x"},
                        {"type": "upload_dir", "source": ".", "target": "/x"},
                    ],
                }
            },
            "runtime.prepare[1]",
        ),
        ({"builder": {"strategy": "router_policy"}}, "builder.strategy"),
        ({"builder": {"strategy": "per_request", "config": {"x": 1}}}, "builder.config"),
        ({"evaluator": {"strategy": "swebench_harness"}}, "evaluator.strategy"),
        ({"evaluator": {"strategy": "harbor", "config": {}}}, "evaluator.config.tests_dir"),
        ({"task_id": "a/b"}, "task_id"),
        ({"num_samples": 5000}, "num_samples"),
        ({"runtime": {"image": "i", "cpus": 100000}}, "runtime.cpus"),
    ],
)
def test_what_polar_mitm_will_not_do_is_refused_naming_polars_field(change, field, tmp_path):
    with pytest.raises(ApiError) as e:
        p.to_request(request(**change), task_root=tmp_path)
    assert e.value.status == 422
    assert e.value.extra["fields"][0]["field"] == field, e.value.message


@pytest.mark.parametrize("key", ["tests_target", "verifier_dir", "test_command", "extra_key"])
def test_harbor_settings_other_than_harbors_own_layout_are_refused(key, tmp_path):
    cfg = {"tests_dir": str(tmp_path), key: "/elsewhere"}
    with pytest.raises(ApiError) as e:
        p.to_request(request(evaluator={"strategy": "harbor", "config": cfg}), task_root=tmp_path)
    assert e.value.extra["fields"][0]["field"] == f"evaluator.config.{key}"


def test_harbor_tests_need_a_task_root_the_operator_named(tmp_path):
    for root in (None, tmp_path):  # no root, or tests outside it
        with pytest.raises(ApiError) as e:
            p.to_request(
                request(evaluator={"strategy": "harbor", "config": {"tests_dir": "/etc"}}), task_root=root
            )
        assert e.value.status == 403 and "--task-root" in e.value.message


def test_polars_own_request_checks_hold():
    with pytest.raises(ValueError, match="early_stop_min_usable_sessions"):
        request(num_samples=2, early_stop_min_usable_sessions=3)
    with pytest.raises(ValueError, match="agent_timeout"):
        request(metadata={"agent_timeout": True})
    with pytest.raises(ValueError, match="exactly one of harness or import_path"):
        request(agent={})
    with pytest.raises(ValueError, match="custom_shell"):
        request(agent={"harness": "shell"})
    with pytest.raises(ValueError, match="Extra inputs"):
        request(surprise=1)  # a field polar-mitm does not know is refused, never ignored


def _sample(idx: int, status: str, reward: float | None) -> SampleRow:
    return SampleRow(
        task_id="t1", idx=idx, state="finished", stage="done", status=status, cause=None if status == "completed" else "boom",
        node_id="n0", lease=None, dispatches=1, reward=reward, detail=json.dumps({"verifier": "ok"}),
        timings=json.dumps({"queued": 0.5, "starting": 1.0, "running": 2.0, "scoring": 0.25, "other": 9.0}),
        weight_versions='["3"]', session_id=f"s{idx}", rows=None, updated_at=0.0,
    )  # fmt: skip


def _row(n: int) -> dict:
    return {
        "trajectory_id": f"tr{n}", "session_id": "s0", "task_id": "t1", "prompt_ids": [1, 2], "response_ids": [3, 4, 5],
        "loss_mask": [1, 0, 1], "response_logprobs": [-0.5, 0.0, -0.25], "num_turns": 2, "turn_ids": ["a", "b"],
        "finish_reason": "stop", "reward": 1.0, "metadata": json.dumps({"weight_versions": ["3"]}), "role": "main",
        "parent_id": None, "status": "completed",
    }  # fmt: skip


def test_replies_are_valid_under_polars_models_with_the_reward_on_the_last_trace():
    summary = TaskSummary("t1", "done", 0, 3, 1.0, 2.0, None, "claude-code", "docker")
    samples = [_sample(0, "completed", 1.0), _sample(1, "failed", 0.0), _sample(2, "cancelled", None)]
    kept = {"metadata": {"group_id": 5}, "recorded": {"runtime.network": "x"}}
    status = polar.TaskStatus.model_validate(p.task_status(summary, samples, {0: [_row(0), _row(1)]}, kept))
    assert (status.status, status.total_sessions, status.completed_sessions) == ("completed", 3, 2)
    first, failed = status.results
    assert first.status == "COMPLETED" and [t.reward for t in first.trajectory.traces] == [None, 1.0]
    assert first.trajectory.traces[0].metadata["weight_versions"] == ["3"]
    assert first.timing.model_dump(exclude_defaults=True) == {
        "register_to_init_queue_ms": 500.0, "init_ms": 1000.0, "run_ms": 2000.0, "postrun_ms": 250.0, "e2e_ms": 12750.0,
    }  # fmt: skip
    assert first.metadata["group_id"] == 5 and first.metadata["polar_mitm"]["recorded"] == {
        "runtime.network": "x"
    }
    assert (failed.status, failed.error, failed.trajectory.status) == ("ERROR", "boom", "ERROR")
    # ClawBench reads the same list under `sessions`.
    assert (
        p.task_status(summary, samples, {}, kept)["sessions"]
        == p.task_status(summary, samples, {}, kept)["results"]
    )


def test_stages_and_task_states_speak_polars_vocabulary():
    assert p.task_state("queued") == p.task_state("running") == "running"
    assert (p.task_state("done"), p.task_state("cancelled")) == ("completed", "cancelled")
    running = _sample(0, "completed", 1.0)
    running.state, running.stage = "dispatched", "running"
    assert p.session_status(running) == "RUNNING"


def test_uploads_under_the_task_root_are_copied_in_first_and_others_are_refused(tmp_path):
    (tmp_path / "work").mkdir()
    (tmp_path / "run.sh").write_text("true\n")
    prepare = [
        {"type": "upload_dir", "source": str(tmp_path / "work"), "target": "/app"},
        {"type": "upload_file", "source": str(tmp_path / "run.sh"), "target": "/app/run.sh"},
        {"type": "exec", "command": "bash /app/setup.sh", "cwd": "/app"},
    ]
    ours = p.to_request(request(runtime={"image": "i", "prepare": prepare}), task_root=tmp_path)
    assert ours.task is not None
    assert [(str(u.source), u.target) for u in ours.task.uploads] == [
        (str(tmp_path / "work"), "/app"),
        (str(tmp_path / "run.sh"), "/app/run.sh"),
    ]
    assert ours.task.setup == ["cd /app && bash /app/setup.sh"]
    outside = [{"type": "upload_file", "source": "/etc/passwd", "target": "/x"}]
    for root in (tmp_path, None):  # outside the root, or no root at all: 403
        with pytest.raises(ApiError) as e:
            p.to_request(request(runtime={"image": "i", "prepare": outside}), task_root=root)
        assert e.value.status == 403 and e.value.extra["fields"][0]["field"] == "runtime.prepare[0]"
    wrong_kind = [{"type": "upload_dir", "source": str(tmp_path / "run.sh"), "target": "/x"}]
    with pytest.raises(ApiError) as e:
        p.to_request(request(runtime={"image": "i", "prepare": wrong_kind}), task_root=tmp_path)
    assert e.value.status == 422
