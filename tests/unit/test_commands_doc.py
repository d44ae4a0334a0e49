"""docs/commands.md's reference part is what the commands' --help prints: a changed option or
help text fails here until `python scripts/gen_commands_doc.py` writes the file again."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gen_commands_doc.py"


def _generator():
    spec = importlib.util.spec_from_file_location("gen_commands_doc", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_the_checked_in_commands_doc_is_what_the_generator_writes():
    """In a fresh process: click keeps the help option a command was first shown with, so a test
    that ran a command on its own before would change what --help prints here."""
    assert _generator().DOC.read_text().count(_generator().MARKER) == 1
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--check"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr


def test_the_reference_has_a_heading_and_the_help_of_every_command():
    gen = _generator()
    text = gen.render("# Hand-written\n")
    assert text.startswith("# Hand-written\n\n" + gen.MARKER)
    for name in ("run", "proxy", "export", "rollout", "serve", "view", "tokenizer build", "fake-backend"):
        assert f"### `polar-mitm {name}`\n\n```\nUsage: polar-mitm {name} [OPTIONS]" in text, name
