"""Task loaders: Harbor directories and task sets, SWE-bench JSON lines, plain task files, and the
errors each bad file gives (naming the file, the field and what was expected)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from polar_mitm.tasks import EvaluatorSpec, Task, TaskFileError, load_tasks
from polar_mitm.tasks.harbor import memory_mb_of
from polar_mitm.tasks.model import SANDBOX_START_SEC
from polar_mitm.tasks.swebench import swebench_image


def harbor_task(root: Path, name: str, task_toml: str | None = None, *, dockerfile: bool = True) -> Path:
    """A Harbor task directory: instruction.md, tests/test.sh, and optionally task.toml and a Dockerfile."""
    directory = root / name
    (directory / "tests").mkdir(parents=True)
    (directory / "instruction.md").write_text(f"Do {name}.\n")
    (directory / "tests" / "test.sh").write_text("#!/bin/sh\necho 1 > /logs/verifier/reward.txt\n")
    if dockerfile:
        (directory / "environment").mkdir()
        (directory / "environment" / "Dockerfile").write_text("FROM ubuntu:24.04\n")
    if task_toml is not None:
        (directory / "task.toml").write_text(task_toml)
    return directory


def swebench_row(**fields) -> dict:
    row = {
        "instance_id": "astropy__astropy-12907",
        "repo": "astropy/astropy",
        "base_commit": "d16bfe05a744909de4b27f5875fe0d4ed41ce607",
        "version": "4.3",
        "problem_statement": "Modeling's `separability_matrix` does not compute separability correctly",
        "test_patch": "diff --git a/x b/x\n",
        "FAIL_TO_PASS": ["astropy/modeling/tests/test_separable.py::test_separable[compound_model6]"],
        "PASS_TO_PASS": ["astropy/modeling/tests/test_separable.py::test_coord_matrix"],
        "patch": "the gold patch, not ours to use",
    }
    return {**row, **fields}


def write_jsonl(path: Path, *rows: dict | str) -> Path:
    path.write_text("\n".join(row if isinstance(row, str) else json.dumps(row) for row in rows) + "\n")
    return path


def load_error(*paths: Path) -> str:
    with pytest.raises(TaskFileError) as caught:
        load_tasks(paths)
    return str(caught.value)


# --- Harbor ------------------------------------------------------------------------------------


def test_harbor_task_with_every_field(tmp_path):
    directory = harbor_task(
        tmp_path,
        "fix-git",
        """
version = "1.0"
[metadata]
difficulty = "easy"
tags = ["git"]
[agent]
timeout_sec = 900.0
[verifier]
timeout_sec = 120
env = { STRICT = "1" }
[environment]
cpus = 2
memory = "2G"
network_mode = "no-network"
env = { LANG = "C.UTF-8" }
build_timeout_sec = 300
storage = "10G"           # a field we do not use
[solution]                # a section we do not use
env = {}
""",
    )
    [task] = load_tasks([directory])
    assert task.id == "fix-git"
    assert task.instruction == "Do fix-git.\n"
    assert task.image is None and task.dockerfile == directory.absolute() / "environment" / "Dockerfile"
    assert task.workdir == "/app"
    assert task.cpus == 2.0 and task.memory_mb == 2048
    assert task.allow_internet is False
    assert task.env == {"LANG": "C.UTF-8"}
    assert task.agent_timeout_sec == 900.0
    assert task.evaluator == EvaluatorSpec(
        kind="harbor",
        tests_dir=directory.absolute() / "tests",
        timeout_sec=120.0,
        env={"STRICT": "1"},
        internet=False,  # [environment] network_mode: its verifier's too
    )
    assert task.verifier_internet is False
    assert task.total_timeout_sec == 900.0 + 120.0 + SANDBOX_START_SEC
    assert task.metadata == {"difficulty": "easy", "tags": ["git"], "build_timeout_sec": 300}
    assert task.source == str(directory.absolute())


def test_harbor_task_without_task_toml_takes_harbor_defaults(tmp_path):
    [task] = load_tasks([harbor_task(tmp_path, "hello")])
    assert (task.workdir, task.allow_internet, task.agent_timeout_sec) == ("/app", True, 600.0)
    assert task.evaluator.timeout_sec == 600.0 and task.total_timeout_sec == 1500.0
    assert task.cpus is None and task.memory_mb is None and task.metadata == {}


def test_harbor_docker_image_wins_over_the_dockerfile(tmp_path):
    toml = '[environment]\ndocker_image = "ghcr.io/org/hello:1"\nmemory_mb = 512\nallow_internet = false\n'
    [task] = load_tasks([harbor_task(tmp_path, "hello", toml)])
    assert task.image == "ghcr.io/org/hello:1" and task.dockerfile is None
    assert task.memory_mb == 512 and task.allow_internet is False


def test_harbor_allowlist_counts_as_no_internet_and_keeps_its_hosts(tmp_path):
    toml = '[environment]\nnetwork_mode = "public"\n[agent]\nnetwork_mode = "allowlist"\nallowed_hosts = ["pypi.org"]\n'
    [task] = load_tasks([harbor_task(tmp_path, "pip", toml)])
    assert task.allow_internet is False
    assert task.metadata == {"network_mode": "allowlist", "allowed_hosts": ["pypi.org"]}


def test_harbor_task_set_loads_its_tasks_sorted_by_name(tmp_path):
    harbor_task(tmp_path, "zeta")
    harbor_task(tmp_path, "alpha")
    (tmp_path / "notes").mkdir()  # neither instruction.md nor task.toml: not a task
    (tmp_path / "README.md").write_text("a task set\n")
    assert [task.id for task in load_tasks([tmp_path])] == ["alpha", "zeta"]


@pytest.mark.parametrize(
    ("size", "mb"), [("2G", 2048), ("512M", 512), ("1.5g", 1536), ("4Gi", 4096), ("2GB", 2048)]
)
def test_memory_sizes(size, mb):
    assert memory_mb_of(size) == mb


def test_harbor_wrong_type_names_the_section_and_field(tmp_path):
    directory = harbor_task(tmp_path, "bad", '[environment]\ncpus = "many"\n')
    message = load_error(directory)
    assert "task.toml" in message and "field 'environment.cpus': expected a number, got 'many'" in message


def test_harbor_bad_memory_size_and_network_mode(tmp_path):
    directory = harbor_task(tmp_path, "bad", '[environment]\nmemory = "lots"\nnetwork_mode = "none"\n')
    message = load_error(directory)
    assert "task.toml" in message
    assert "field 'environment.memory': expected a size like '2G' or '512M', got 'lots'" in message
    assert (
        "field 'environment.network_mode': expected one of 'public', 'no-network' or 'allowlist'" in message
    )


def test_harbor_section_that_is_not_a_table(tmp_path):
    message = load_error(harbor_task(tmp_path, "bad", "agent = 5\n"))
    assert "task.toml" in message and "field 'agent': expected a table (mapping), got 5" in message


def test_harbor_invalid_toml_gives_the_line(tmp_path):
    message = load_error(harbor_task(tmp_path, "bad", "[agent]\ntimeout_sec = = 3\n"))
    assert "task.toml: invalid TOML" in message and "line 2" in message


def test_harbor_task_without_test_sh(tmp_path):
    directory = harbor_task(tmp_path, "untested")
    (directory / "tests" / "test.sh").unlink()
    message = load_error(directory)
    assert "untested/tests/test.sh" in message and "missing" in message


def test_harbor_empty_instruction(tmp_path):
    directory = harbor_task(tmp_path, "empty")
    (directory / "instruction.md").write_text("\n")
    assert "empty/instruction.md: empty" in load_error(directory)


def test_task_set_subdirectory_with_task_toml_but_no_instruction(tmp_path):
    harbor_task(tmp_path, "good")
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "task.toml").write_text("[agent]\ntimeout_sec = 10\n")
    message = load_error(tmp_path)
    assert "broken" in message and "no instruction.md" in message


def test_directory_with_no_tasks(tmp_path):
    (tmp_path / "empty").mkdir()
    message = load_error(tmp_path / "empty")
    assert str(tmp_path / "empty") in message and "no instruction.md" in message


# --- SWE-bench ---------------------------------------------------------------------------------


def test_swebench_image_naming_rule():
    assert (
        swebench_image("django__django-11099") == "swebench/sweb.eval.x86_64.django_1776_django-11099:latest"
    )
    assert (
        swebench_image("Astropy__astropy-12907")
        == "swebench/sweb.eval.x86_64.astropy_1776_astropy-12907:latest"
    )


def test_swebench_rows(tmp_path):
    path = write_jsonl(
        tmp_path / "tasks.jsonl",
        swebench_row(),
        "",
        swebench_row(
            instance_id="django__django-11099",
            repo="django/django",
            version=3.0,
            FAIL_TO_PASS=json.dumps(
                ["test_ascii_validator (auth_tests.test_validators.UsernameValidatorsTests)"]
            ),
            PASS_TO_PASS="[]",
            test_command="./tests/runtests.py --verbosity 2 auth_tests.test_validators",
            image="registry.local/django:11099",
            setup=["pip install -e ."],
            env={"DJANGO_SETTINGS_MODULE": "test_sqlite"},
            agent_timeout_sec=1200,
            allow_internet=False,
        ),
    )
    astropy, django = load_tasks([path])

    assert astropy.id == "astropy__astropy-12907"
    assert astropy.instruction.startswith("Modeling's `separability_matrix`")
    assert astropy.image == "swebench/sweb.eval.x86_64.astropy_1776_astropy-12907:latest"
    assert astropy.workdir == "/testbed" and astropy.allow_internet is True
    assert astropy.evaluator.kind == "swebench" and astropy.evaluator.test_patch == "diff --git a/x b/x\n"
    assert astropy.evaluator.test_command == (
        "python -m pytest -rA -p no:cacheprovider "
        "'astropy/modeling/tests/test_separable.py::test_separable[compound_model6]' "
        "astropy/modeling/tests/test_separable.py::test_coord_matrix"
    )
    assert astropy.metadata == {
        "repo": "astropy/astropy",
        "base_commit": "d16bfe05a744909de4b27f5875fe0d4ed41ce607",
        "version": "4.3",
    }
    assert astropy.source == str(path)

    assert django.evaluator.fail_to_pass == [
        "test_ascii_validator (auth_tests.test_validators.UsernameValidatorsTests)"
    ]
    assert django.evaluator.pass_to_pass == []
    assert django.evaluator.test_command == "./tests/runtests.py --verbosity 2 auth_tests.test_validators"
    assert django.image == "registry.local/django:11099"
    assert (django.setup, django.env) == (["pip install -e ."], {"DJANGO_SETTINGS_MODULE": "test_sqlite"})
    assert django.agent_timeout_sec == 1200.0 and django.allow_internet is False
    assert django.total_timeout_sec == 1200.0 + 600.0 + SANDBOX_START_SEC
    assert django.metadata["version"] == "3.0"


def test_swebench_problem_statement_keeps_line_separators(tmp_path):
    # U+2028 inside a JSON string is legal; splitting the file on it would break the row.
    path = write_jsonl(tmp_path / "t.jsonl", swebench_row(problem_statement="one\u2028two"))
    path.write_text(path.read_text().replace("\\u2028", "\u2028"))
    [task] = load_tasks([path])
    assert task.instruction == "one\u2028two"


def test_swebench_missing_field_names_file_line_and_field(tmp_path):
    row = swebench_row()
    del row["instance_id"]
    path = write_jsonl(tmp_path / "tasks.jsonl", swebench_row(), "", row)
    assert f"{path} line 3: field 'instance_id': required" in load_error(path)


def test_swebench_bad_fail_to_pass_string(tmp_path):
    path = write_jsonl(tmp_path / "tasks.jsonl", swebench_row(FAIL_TO_PASS="[not json"))
    message = load_error(path)
    assert "tasks.jsonl line 1: field 'FAIL_TO_PASS': expected a list of test ids" in message


def test_swebench_wrong_types(tmp_path):
    path = write_jsonl(tmp_path / "tasks.jsonl", swebench_row(FAIL_TO_PASS=[], env={"A": 1}))
    message = load_error(path)
    assert "tasks.jsonl line 1" in message
    assert "field 'FAIL_TO_PASS': expected at least 1 item(s), got []" in message
    assert "field 'env.A': expected a string, got 1" in message


def test_swebench_invalid_json_line(tmp_path):
    path = write_jsonl(tmp_path / "tasks.jsonl", swebench_row(), '{"instance_id": ')
    assert "tasks.jsonl line 2: invalid JSON" in load_error(path)


def test_swebench_line_that_is_not_an_object(tmp_path):
    path = write_jsonl(tmp_path / "tasks.jsonl", "[1, 2]")
    assert "tasks.jsonl line 1: expected a JSON object, got a list" in load_error(path)


def test_swebench_duplicate_instance_in_one_file(tmp_path):
    path = write_jsonl(tmp_path / "tasks.jsonl", swebench_row(), swebench_row())
    message = load_error(path)
    assert "tasks.jsonl line 2: field 'instance_id'" in message and "first on line 1" in message


def test_swebench_empty_file(tmp_path):
    path = tmp_path / "tasks.jsonl"
    path.write_text("\n\n")
    assert "tasks.jsonl: no rows" in load_error(path)


# --- plain task files ----------------------------------------------------------------------------


def test_plain_toml_single_task_takes_the_file_stem_as_id(tmp_path):
    (tmp_path / "docker").mkdir()
    (tmp_path / "docker" / "Dockerfile").write_text("FROM python:3.12\n")
    path = tmp_path / "count-words.toml"
    path.write_text(
        """
instruction = "Count the words in /data/book.txt and write the number to /data/count."
dockerfile = "docker/Dockerfile"
setup = ["mkdir -p /data"]
allow_internet = false
cpus = 1.5
memory_mb = 1024
agent_timeout_sec = 300
metadata = { difficulty = "easy" }

[evaluator]
kind = "command"
command = "test \\"$(cat /data/count)\\" = 42"
timeout_sec = 60
"""
    )
    [task] = load_tasks([path])
    assert task.id == "count-words"
    assert task.dockerfile == tmp_path.absolute() / "docker" / "Dockerfile"
    assert task.workdir == "/workspace" and task.setup == ["mkdir -p /data"]
    assert (task.allow_internet, task.cpus, task.memory_mb) == (False, 1.5, 1024)
    assert task.evaluator == EvaluatorSpec(
        kind="command", command='test "$(cat /data/count)" = 42', timeout_sec=60
    )
    assert task.total_timeout_sec == 300 + 60 + SANDBOX_START_SEC
    assert task.metadata == {"difficulty": "easy"} and task.source == str(path)


def test_plain_json_task_list_and_given_total_timeout(tmp_path):
    (tmp_path / "checks").mkdir()
    path = tmp_path / "tasks.json"
    path.write_text(
        json.dumps(
            {
                "tasks": [
                    {"id": "a", "instruction": "Say hi.", "image": "python:3.12", "total_timeout_sec": 99},
                    {
                        "id": "b",
                        "instruction": "Pass the checks.",
                        "evaluator": {"kind": "harbor", "tests_dir": "checks"},
                    },
                ]
            }
        )
    )
    a, b = load_tasks([path])
    assert (a.id, a.image, a.total_timeout_sec, a.evaluator.kind) == (
        "a",
        "python:3.12",
        99,
        "session_completed",
    )
    assert b.evaluator.tests_dir == tmp_path.absolute() / "checks"


def test_plain_yaml_task_list(tmp_path):
    pytest.importorskip("yaml")
    path = tmp_path / "tasks.yaml"
    path.write_text(
        "tasks:\n"
        "  - id: one\n    instruction: First.\n    env: {MODE: fast}\n"
        "  - id: two\n    instruction: Second.\n    evaluator: {kind: command, command: 'true'}\n"
    )
    one, two = load_tasks([path])
    assert (one.id, one.env, two.id, two.evaluator.command) == ("one", {"MODE": "fast"}, "two", "true")


def test_plain_wrong_type_in_a_task_list_names_the_dotted_field(tmp_path):
    path = tmp_path / "tasks.toml"
    path.write_text(
        '[[tasks]]\nid = "a"\ninstruction = "x"\n\n[[tasks]]\nid = "b"\ninstruction = "y"\n'
        '[tasks.evaluator]\nkind = "command"\ncommand = 5\n'
    )
    message = load_error(path)
    assert (
        "tasks.toml" in message and "field 'tasks[1].evaluator.command': expected a string, got 5" in message
    )


def test_plain_evaluator_without_its_command(tmp_path):
    path = tmp_path / "t.toml"
    path.write_text('instruction = "x"\nevaluator = { kind = "command" }\n')
    message = load_error(path)
    assert "t.toml" in message and "field 'evaluator': evaluator 'command' needs a command" in message


def test_plain_missing_and_misspelled_fields(tmp_path):
    path = tmp_path / "tasks.toml"
    path.write_text('[[tasks]]\ninstruction = "x"\nagent_timeout = 5\n')
    message = load_error(path)
    assert "tasks.toml" in message
    assert "field 'tasks[0].id': required" in message
    assert "field 'tasks[0].agent_timeout': unknown field" in message


def test_plain_dockerfile_that_does_not_exist(tmp_path):
    path = tmp_path / "t.toml"
    path.write_text('instruction = "x"\ndockerfile = "nowhere/Dockerfile"\n')
    message = load_error(path)
    assert "t.toml" in message and "field 'dockerfile': no such file" in message


def test_plain_invalid_json_gives_the_line(tmp_path):
    path = tmp_path / "t.json"
    path.write_text('{\n  "instruction": "x",\n  "id": \n}\n')
    message = load_error(path)
    assert "t.json line 4: invalid JSON" in message


def test_plain_invalid_yaml_gives_the_line(tmp_path):
    pytest.importorskip("yaml")
    path = tmp_path / "t.yml"
    path.write_text("instruction: x\nenv: [unclosed\n")
    message = load_error(path)
    assert "t.yml line" in message and "invalid YAML" in message


def test_yaml_without_pyyaml_says_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "yaml", None)  # import yaml now raises ImportError
    path = tmp_path / "t.yaml"
    path.write_text("instruction: x\n")
    message = load_error(path)
    assert "t.yaml" in message and "PyYAML" in message


def test_plain_file_that_is_not_a_table(tmp_path):
    path = tmp_path / "t.json"
    path.write_text("[1, 2]")
    assert "t.json: expected a table of task fields or a 'tasks' list" in load_error(path)


def test_plain_tasks_list_beside_other_keys(tmp_path):
    path = tmp_path / "t.toml"
    path.write_text('image = "x"\n[[tasks]]\nid = "a"\ninstruction = "y"\n')
    assert "t.toml: a file with a 'tasks' list holds nothing else" in load_error(path)


# --- dispatch and ids across sources -------------------------------------------------------------


def test_path_that_does_not_exist(tmp_path):
    assert f"{tmp_path / 'missing.toml'}: no such file or directory" in load_error(tmp_path / "missing.toml")


def test_unknown_extension_lists_the_supported_ones(tmp_path):
    path = tmp_path / "tasks.csv"
    path.write_text("id,instruction\n")
    message = load_error(path)
    assert "tasks.csv" in message and "'.csv'" in message
    assert ".toml, .yaml, .yml, .json" in message and ".jsonl" in message


def test_tasks_from_every_format_in_order(tmp_path):
    harbor = harbor_task(tmp_path / "set", "hello")
    plain = tmp_path / "plain.toml"
    plain.write_text('id = "plain"\ninstruction = "x"\n')
    rows = write_jsonl(tmp_path / "rows.jsonl", swebench_row())
    tasks = load_tasks([str(plain), rows, harbor])
    assert [task.id for task in tasks] == ["plain", "astropy__astropy-12907", "hello"]
    assert all(isinstance(task, Task) for task in tasks)


def test_duplicate_ids_across_sources_name_both(tmp_path):
    harbor = harbor_task(tmp_path, "hello")
    plain = tmp_path / "hello.toml"
    plain.write_text('instruction = "x"\n')
    message = load_error(harbor, plain)
    assert "duplicate task id 'hello'" in message
    assert str(plain) in message and str(harbor.absolute()) in message


def test_duplicate_ids_in_one_plain_file(tmp_path):
    path = tmp_path / "t.toml"
    path.write_text('[[tasks]]\nid = "a"\ninstruction = "x"\n[[tasks]]\nid = "a"\ninstruction = "y"\n')
    message = load_error(path)
    assert "t.toml: duplicate task id 'a': already loaded earlier in the same file" in message


def test_a_harbor_verifier_reaches_the_internet_as_its_environment_allows(tmp_path):
    """Harbor's [agent] network_mode is the agent's alone; the verifier runs in the task's
    environment, and `[verifier] allow_internet` overrides both."""
    cases = {
        "agent-off": ('[agent]\nnetwork_mode = "no-network"\n', False, True),
        "env-off": ('[environment]\nnetwork_mode = "no-network"\n', False, False),
        "legacy-off": ("[environment]\nallow_internet = false\n", False, False),
        "verifier-on": (
            '[environment]\nnetwork_mode = "no-network"\n[verifier]\nallow_internet = true\n',
            False,
            True,
        ),
        "default": ("", True, True),
    }
    for name, (toml, agent, verifier) in cases.items():
        d = harbor_task(tmp_path, name)
        (d / "task.toml").write_text(toml)
        [task] = load_tasks([d])
        assert (task.allow_internet, task.verifier_internet) == (agent, verifier), name
