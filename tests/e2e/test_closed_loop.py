"""The closed loop end to end on CPU (examples/closed_loop.py): two rollouts of real Claude Code
against the HF engine, TRL's GRPOTrainer stepping on each, one weight update between them, the
versions each turn recorded, and the train/inference agreement of the first rollout."""

from __future__ import annotations

import runpy
import shutil
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "closed_loop.py"


def test_closed_loop_trains_updates_the_engine_and_the_next_rollout_carries_the_new_version(
    tmp_path, qwen_tokenizer_dir, monkeypatch
):
    pytest.importorskip("trl", reason="the [trl] extra (torch, transformers, trl) is not installed")
    if shutil.which("claude") is None:
        pytest.skip("claude is not installed (npm i -g @anthropic-ai/claude-code)")
    monkeypatch.delenv("POLAR_MITM_SERVICE_TOKEN", raising=False)
    report = runpy.run_path(str(EXAMPLE))["main"](
        [
            "--work",
            str(tmp_path / "loop"),
            "--tokenizer",
            str(qwen_tokenizer_dir),
            "--samples",
            "2",
            "--steps",
            "2",
        ]
    )
    assert report["rollouts"] == 2 and report["weights_changed"]
    assert [p["version"] for p in report["pushed"]] == ["1", "2"] and all(
        p["drained"] for p in report["pushed"]
    )
    first, second = report["turn_versions"]
    assert first and all(v == ["0"] for v in first), first  # every turn of rollout 1: the initial weights
    assert second and all(v == ["1"] for v in second), second  # rollout 2: the weights step 1 saved
    for rewards in report["rewards"]:  # per row: the first sample scored passes, a gradient every step
        assert 0.0 in rewards and 1.0 in rewards
    assert len(report["losses"]) == 2 and all(abs(x) < 1e6 for x in report["losses"])
    a = report["agreement_first_rollout"]
    assert a["tokens"] > 0 and a["max_abs"] <= 1e-4 and a["over"] == 0.0, a
    assert report["agreement_second_rollout"]["max_abs"] <= 1e-4
    # TRL's own figure (its importance-sampling path, over its padded batch) agrees too when the
    # trainer runs in the engine's dtype (the example sets bf16=False; TRL's default bf16 autocast
    # reads 0.02-0.09 here).
    diffs = report["trl_logp_difference_max"]
    assert diffs and all(d is not None and d <= 1e-4 for d in diffs), diffs
