"""The package's front door (`polar_mitm/__init__.py`): every name it offers resolves to the object
of the module its table names, `help(polar_mitm)` shows each, and `import polar_mitm` loads none
of them, so the command line and a trainer's client stay as light as they were."""

from __future__ import annotations

import ast
import importlib
import pydoc
import subprocess
import sys

import pytest

import polar_mitm


def _fresh(code: str) -> object:
    """What a fresh interpreter prints (a Python literal) after running `code`."""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return ast.literal_eval(out.stdout.strip())


@pytest.mark.slow  # loads every face, the trainers' libraries among them (seconds)
def test_every_public_name_is_its_modules_own_object():
    assert polar_mitm.__all__, "the door names nothing"
    for name in polar_mitm.__all__:
        module = importlib.import_module(polar_mitm.PUBLIC[name])
        assert getattr(polar_mitm, name) is getattr(module, name), name


def test_the_door_names_the_faces_the_docs_promise():
    faces = {"RolloutClient", "AsyncRolloutClient", "TaskRequest", "Task", "load_tasks", "export"}
    faces |= {"iter_trajectories", "PolarRollout", "WeightSync", "agent_loop_class"}
    assert faces <= set(polar_mitm.__all__)


def test_a_name_that_is_not_public_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no_such_name"):
        polar_mitm.no_such_name  # noqa: B018
    assert not hasattr(polar_mitm, "Pipeline")


@pytest.mark.slow
def test_help_names_every_public_name():
    text = pydoc.render_doc(polar_mitm, renderer=pydoc.plaintext)
    missing = [n for n in polar_mitm.__all__ if n not in text]
    assert not missing, missing
    assert set(polar_mitm.__all__) <= set(dir(polar_mitm))


@pytest.mark.slow
def test_importing_the_package_loads_none_of_its_modules():
    assert _fresh(
        "import sys, polar_mitm\nprint(sorted(m for m in sys.modules if m.startswith('polar_mitm')))"
    ) == ["polar_mitm"]


@pytest.mark.slow
def test_the_command_lines_help_loads_none_of_the_doors_modules():
    """`polar-mitm --help` imports the package; the door's faces stay unloaded (it loads 10 of
    the package's modules, as it did before the door had names)."""
    doors = sorted(set(polar_mitm.PUBLIC.values()))
    loaded = _fresh(
        f"import sys, polar_mitm.cli.app\nprint(sorted(m for m in {doors!r} if m in sys.modules))"
    )
    assert loaded == []
