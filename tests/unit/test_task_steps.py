"""Multi-step Harbor tasks (`[[steps]]`): loading them as Harbor reads them, and how their steps'
rewards make a sample's (`rollout/steps.py`, Harbor's `MultiStepTrial` semantics)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from polar_mitm.reconstruct.groups import step_of_turns
from polar_mitm.rollout.evaluators import HarnessOutcome, Score
from polar_mitm.rollout.steps import StepRecord, below_min_reward, combine
from polar_mitm.tasks import TaskFileError, load_tasks
from polar_mitm.tasks.model import SANDBOX_START_SEC

TOML = """\
multi_step_reward_strategy = "{strategy}"
[agent]
timeout_sec = 100
[verifier]
timeout_sec = 50
env = {{ A = "task", B = "task" }}
[environment]
docker_image = "img"

[[steps]]
name = "one"
min_reward = 1.0
[steps.agent]
timeout_sec = 10
[steps.verifier]
env = {{ B = "step" }}

[[steps]]
name = "two"
min_reward = {{ correctness = 0.5 }}

[[steps]]
name = "three"
[steps.verifier]
timeout_sec = 5
"""


def multi_step_task(root: Path, strategy: str = "final") -> Path:
    d = root / "ms"
    (d / "tests").mkdir(parents=True)
    (d / "tests" / "test.sh").write_text("#!/bin/bash\necho shared\n")
    (d / "tests" / "helper.py").write_text("shared = 1\n")
    (d / "task.toml").write_text(TOML.format(strategy=strategy))
    for name in ("one", "two", "three"):
        (d / "steps" / name).mkdir(parents=True)
        (d / "steps" / name / "instruction.md").write_text(f"do {name}\n")
    (d / "steps" / "two" / "tests").mkdir()
    (d / "steps" / "two" / "tests" / "test.sh").write_text("#!/bin/bash\necho two\n")
    (d / "steps" / "two" / "workdir").mkdir()
    (d / "steps" / "two" / "workdir" / "data.txt").write_text("x\n")
    return d


def test_a_multi_step_task_loads_each_step_as_harbor_reads_it(tmp_path):
    [task] = load_tasks([multi_step_task(tmp_path)])
    assert [s.name for s in task.steps] == ["one", "two", "three"]
    assert task.multi_step_reward_strategy == "final"
    one, two, three = task.steps
    assert task.instruction == "do one\n" and task.evaluator == one.evaluator
    assert [s.instruction for s in task.steps] == ["do one\n", "do two\n", "do three\n"]
    # Timeouts: the step's, else the task's; the verifier's env: the task's, the step's over it.
    assert (one.agent_timeout_sec, two.agent_timeout_sec) == (10, None)
    assert [s.evaluator.timeout_sec for s in task.steps] == [50, 50, 5]
    assert one.evaluator.env == {"A": "task", "B": "step"} and two.evaluator.env == {"A": "task", "B": "task"}
    assert (one.min_reward, two.min_reward, three.min_reward) == (1.0, {"correctness": 0.5}, None)
    # Tests: the task's alone; or the task's with the step's laid over them, its test.sh winning.
    assert one.evaluator.tests_dir == Path(task.source) / "tests"
    merged = two.evaluator.tests_dir
    assert (merged / "test.sh").read_text() == "#!/bin/bash\necho two\n"
    assert (merged / "helper.py").read_text() == "shared = 1\n"
    assert (
        two.workdir_dir is not None and (two.workdir_dir / "data.txt").is_file() and one.workdir_dir is None
    )
    # The sample's time: the sandbox's start and each step's harness and verifier.
    assert task.total_timeout_sec == SANDBOX_START_SEC + (10 + 50) + (100 + 50) + (100 + 5)
    step = task.step_task(two)
    assert (step.id, step.instruction, step.evaluator, step.steps) == (task.id, "do two\n", two.evaluator, [])


def test_the_merged_tests_follow_their_content(tmp_path):
    d = multi_step_task(tmp_path)
    first = load_tasks([d])[0].steps[1].evaluator.tests_dir
    assert load_tasks([d])[0].steps[1].evaluator.tests_dir == first  # made once
    (d / "steps" / "two" / "tests" / "test.sh").write_text("#!/bin/bash\necho changed\n")
    again = load_tasks([d])[0].steps[1].evaluator.tests_dir
    assert again != first and (again / "test.sh").read_text().endswith("changed\n")


def test_a_step_without_instruction_or_any_test_sh_is_refused(tmp_path):
    d = multi_step_task(tmp_path)
    (d / "steps" / "three" / "instruction.md").unlink()
    with pytest.raises(TaskFileError, match="step 'three'.*needs its instruction"):
        load_tasks([d])
    (d / "steps" / "three" / "instruction.md").write_text("do three\n")
    (d / "tests" / "test.sh").unlink()
    with pytest.raises(TaskFileError, match="step 'one' has no verifier"):
        load_tasks([d])


def test_a_task_set_finds_a_multi_step_task_without_instruction_md(tmp_path):
    multi_step_task(tmp_path)
    [task] = load_tasks([tmp_path])
    assert task.id == "ms" and len(task.steps) == 3


def record(name: str, reward: float, **detail) -> StepRecord:
    return StepRecord(name, [f"t-{name}"], HarnessOutcome(0), Score(reward, dict(detail)))


def test_mean_and_final_as_harbor_combines_them(tmp_path):
    steps = [record("one", 1.0), record("two", 0.0), record("three", 0.5, suspect=["forged"])]
    mean = combine(load_tasks([multi_step_task(tmp_path / "a", "mean")])[0], steps, stopped_early=False)
    final = combine(load_tasks([multi_step_task(tmp_path / "b", "final")])[0], steps, stopped_early=False)
    assert mean.reward == pytest.approx(0.5) and final.reward == 0.5
    assert [s["reward"] for s in mean.detail["steps"]] == [1.0, 0.0, 0.5]
    assert mean.detail["steps"][1]["turn_ids"] == ["t-two"]
    assert mean.detail["suspect"] == ["step three: forged"]
    assert (mean.detail["steps_run"], mean.detail["steps_total"], mean.detail["stopped_early"]) == (
        3,
        3,
        False,
    )


def test_mean_per_key_counts_a_missing_key_as_zero(tmp_path):
    task = load_tasks([multi_step_task(tmp_path, "mean")])[0]
    steps = [record("one", 1.0, rewards={"a": 1.0, "b": 1.0}), record("two", 0.0, rewards={"a": 0.0})]
    got = combine(task, steps, stopped_early=True)
    assert got.detail["rewards"] == {"a": 0.5, "b": 0.5} and got.reward == 0.5


def test_min_reward_as_harbor_gates_on_it():
    assert not below_min_reward(None, Score(0.0))
    assert below_min_reward(1.0, Score(0.5)) and not below_min_reward(0.5, Score(0.5))
    assert below_min_reward({"correctness": 0.5}, Score(1.0))  # a missing key counts as -inf
    assert not below_min_reward({"correctness": 0.5}, Score(0.0, {"rewards": {"correctness": 0.5}}))
    assert below_min_reward({"a": 1, "b": 1}, Score(1.0, {"rewards": {"a": 1, "b": 0}}))


def test_a_trajectory_is_tagged_with_the_step_of_its_turns():
    detail = json.dumps(
        {"steps": [{"name": "one", "turn_ids": ["t1", "t2"]}, {"name": "two", "turn_ids": ["t3"]}]}
    )
    assert step_of_turns(detail, ["t3"]) == "two" and step_of_turns(detail, ["t1", "t2"]) == "one"
    assert step_of_turns(detail, ["other"]) is None and step_of_turns('{"reward_file": "1"}', ["t1"]) is None
    assert step_of_turns(None, ["t1"]) is None


def test_an_exported_row_carries_its_step_in_its_metadata():
    import numpy as np

    from polar_mitm.reconstruct.groups import annotate
    from polar_mitm.reconstruct.trajectory import Trajectory
    from polar_mitm.store.rollouts import SampleInfo

    detail = json.dumps({"steps": [{"name": "one", "turn_ids": ["t1"]}, {"name": "two", "turn_ids": ["t2"]}]})
    sample = SampleInfo("s", "ro", "g", "task", 0, 0, "completed", None, 1.0, detail, "{}")
    rows = [
        Trajectory.from_sequence(
            np.array([1, 2]),
            np.array([0, 1]),
            np.array([0.0, -0.5]),
            trajectory_id=f"r{i}",
            session_id="s",
            task_id="task",
            turn_ids=[t],
            finish_reason="stop",
        )  # fmt: skip
        for i, t in enumerate(("t1", "t2"))
    ]
    assert [json.loads(annotate(r, sample, 0.0).metadata)["step"] for r in rows] == ["one", "two"]
