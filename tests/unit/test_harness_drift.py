"""scripts/harness_drift.py reads every recipe harness's pin from scripts/install.sh: a pin it
cannot find (Claude Code's, once it moved into MAIN_NPM) would make the drift table compare the
newest release with nothing."""

import importlib.util
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


def _drift():
    spec = importlib.util.spec_from_file_location("harness_drift", SCRIPTS / "harness_drift.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, module)  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_every_recipe_harness_has_its_pin_read_from_install_sh():
    rows = _drift().harnesses(SCRIPTS / "install.sh")
    assert rows and {r.name for r in rows if not r.pinned} == set()
    text = (SCRIPTS / "install.sh").read_text()
    by_name = {r.name: r for r in rows}
    assert f'"@anthropic-ai/claude-code@{by_name["claude-code"].pinned}"' in text
    assert by_name["openclaw"].node and by_name["kimi-code"].node  # installed with a Node of their own
    # Harnesses the generic recipe runs are followed too.
    assert by_name["grok-cli"].pinned and by_name["mistral-vibe"].commands == ("vibe",)
