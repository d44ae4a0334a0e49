"""The closed loop end to end on CPU (examples/closed_loop.py): two rollouts of real Claude Code,
TRL's GRPOTrainer stepping on each, one weight update between them, the versions each turn
recorded, and the train/inference agreement of each rollout with the weights that sampled it. On
the HF engine (the fake, started by the example), and on real SGLang and real vLLM (the session's
engines, `sglang_server` / `vllm_server`: TRL's weights pushed into them by `WeightSync`, put
back after)."""

from __future__ import annotations

import contextlib
import runpy
import shutil
from pathlib import Path

import pytest

from polar_mitm.backends.weights import EngineWeights

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "closed_loop.py"


def run_loop(tmp_path: Path, tokenizer: Path, monkeypatch, *engine: str) -> dict:
    pytest.importorskip("trl", reason="the [trl] extra (torch, transformers, trl) is not installed")
    if shutil.which("claude") is None:
        pytest.skip("claude is not installed (npm i -g @anthropic-ai/claude-code)")
    monkeypatch.delenv("POLAR_MITM_SERVICE_TOKEN", raising=False)
    argv = ["--work", str(tmp_path / "loop"), "--tokenizer", str(tokenizer), "--samples", "2", "--steps", "2"]
    return runpy.run_path(str(EXAMPLE))["main"]([*argv, *engine])


def check_report(report: dict, initial: str | None) -> None:
    assert report["rollouts"] == 2 and report["weights_changed"]
    assert report["initial_version"] == initial
    assert [p["version"] for p in report["pushed"]] == ["1", "2"] and all(
        p["drained"] for p in report["pushed"]
    )
    first, second = report["turn_versions"]
    assert first and all(v == [initial] for v in first), first  # every turn of rollout 1: the initial weights
    assert second and all(v == ["1"] for v in second), second  # rollout 2: the weights step 1 saved
    for rewards in report["rewards"]:  # per row: the first sample scored passes, a gradient every step
        assert 0.0 in rewards and 1.0 in rewards
    assert len(report["losses"]) == 2 and all(abs(x) < 1e6 for x in report["losses"])
    a = report["agreement_first_rollout"]
    assert a["tokens"] > 0 and a["max_abs"] <= 1e-4 and a["over"] == 0.0, a
    b = report["agreement_second_rollout"]
    assert b["tokens"] > 0 and b["max_abs"] <= 1e-4, b
    # TRL's own figure (its importance-sampling path, over its padded batch) agrees too when the
    # trainer runs in the engine's dtype (the example sets bf16=False; TRL's default bf16 autocast
    # reads 0.02-0.09 here).
    diffs = report["trl_logp_difference_max"]
    assert diffs and all(d is not None and d <= 1e-4 for d in diffs), diffs


def test_closed_loop_trains_updates_the_engine_and_the_next_rollout_carries_the_new_version(
    tmp_path, qwen_tokenizer_dir, monkeypatch
):
    check_report(run_loop(tmp_path, qwen_tokenizer_dir, monkeypatch), "0")


@pytest.mark.engines
@pytest.mark.timeout(1500)  # the session's engine may start here (30-80 s, minutes under load)
@pytest.mark.parametrize(
    "kind", [pytest.param(k, marks=pytest.mark.engines(k)) for k in ("sglang", "vllm")]
)  # the mark names the engine this test asks for (tests/conftest.py runs and stops it with its own)
def test_closed_loop_on_a_real_engine_pushes_trls_weights_into_it(
    kind, request, tmp_path, qwen_tokenizer_dir, monkeypatch
):
    """SGLang takes them by `/update_weights_from_disk`, vLLM by its reload path; the next
    rollout's turns carry the step's version (SGLang's replies, vLLM's `/weight_info`) and agree
    with the weights that sampled them within 1e-4 (float32)."""
    pytest.importorskip("trl", reason="the [trl] extra (torch, transformers, trl) is not installed")
    server = request.getfixturevalue(f"{kind}_server")
    model_dir = request.getfixturevalue(f"{kind}_model_dir")
    weights = EngineWeights(server.url, kind)
    initial = weights.version()
    with contextlib.ExitStack() as after:  # the session's engine gets its own weights back
        after.callback(weights.load, str(model_dir), initial or "default")
        report = run_loop(
            tmp_path, qwen_tokenizer_dir, monkeypatch, "--engine", kind, "--engine-url", server.url,
            "--model", str(model_dir),
        )  # fmt: skip
    assert report["engine"] == kind
    check_report(report, initial)
