"""Real trainers on polar-mitm rollouts: the HF engine (`fake-backend --mode hf`), the
train/inference agreement check, TRL's real `GRPOTrainer` through `polar_mitm.bridges.trl` (real
Claude Code through the proxy), verl's own `AgentLoopOutput`, and slime's `Sample` fields.

torch, transformers and trl are extras (`[hf]`, `[trl]`): without them these tests skip, saying so."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from polar_mitm.api import SampleView
from polar_mitm.bridges import rows_by_sample
from polar_mitm.bridges.trl import PolarRollout, build_fields, instruction_of, runs
from polar_mitm.client import Group, Sample
from polar_mitm.tasks.model import Task
from tests.support.harness import CLAUDE_SUBAGENT_SCRIPT

NEEDS_TORCH = "the [hf] extra (torch, transformers) is not installed: pip install 'polar-mitm[hf]'"
NEEDS_TRL = "the [trl] extra (trl) is not installed: pip install 'polar-mitm[trl]'"
# Claude Code with a one-line system prompt and only its Bash tool: ~900 prompt tokens, not ~20k,
# so a tiny model on CPU trains on whole rows in seconds.
CLAUDE = ["claude", "-p", "{instruction}", "--system-prompt", "You are a terse coding agent.",
          "--tools", "Bash", "--allowedTools", "Bash"]  # fmt: skip
# The same with its Agent tool too: the main agent can start a subagent.
CLAUDE_AGENT = ["claude", "-p", "{instruction}", "--system-prompt", "You are a terse coding agent.",
                "--tools", "Agent,Bash", "--allowedTools", "Agent,Bash"]  # fmt: skip


@pytest.fixture(scope="session")
def tiny_lm(qwen_tokenizer_dir, tmp_path_factory) -> Path:
    """A tiny Qwen2 causal LM over the Qwen tokenizer's 151k ids, built once per run."""
    pytest.importorskip("torch", reason=NEEDS_TORCH)
    pytest.importorskip("transformers", reason=NEEDS_TORCH)
    from polar_mitm.fake.hf import tiny_causal_lm

    return tiny_causal_lm(qwen_tokenizer_dir, tmp_path_factory.mktemp("tiny-lm"))


def _row(index: int, prompt: list[int], response: list[int], mask: list[int]) -> dict:
    return {
        "sample_index": index, "trajectory_id": f"t{index}", "session_id": f"s{index}", "task_id": "g",
        "prompt_ids": prompt, "response_ids": response, "loss_mask": mask,
        "response_logprobs": [-0.5 if m else 0.0 for m in mask], "reward": 1.0, "status": "completed",
        "metadata": json.dumps({"weight_versions": ["3"]}),
    }  # fmt: skip


# --- the bridge's shape (pure) -----------------------------------------------------------------


def test_runs_split_trl_batches_into_groups_and_refuse_mixed_ones():
    assert runs(["a", "a", "b", "b"], 2) == ["a", "b"]
    assert (
        instruction_of([{"role": "system", "content": "x"}, {"role": "user", "content": "do it"}]) == "do it"
    )
    with pytest.raises(ValueError, match="differ"):
        runs(["a", "b", "b", "b"], 2)
    with pytest.raises(ValueError, match="groups of num_generations=2"):
        runs(["a", "a", "b"], 2)


def test_build_fields_keeps_tool_results_untrained_and_failed_samples_out():
    multi = _row(0, [1, 2, 3], [4, 5, 9, 9, 6, 7], [1, 1, 0, 0, 1, 1])  # a tool result between two turns
    failed = _row(1, [1, 2, 3], [4, 8], [1, 1]) | {"status": "failed"}
    group = Group(
        task_id="g",
        state="finished",
        samples=[Sample.from_row(multi), Sample.from_row(failed)],
        outcomes=[SampleView(index=0, state="finished", status="completed", reward=1.0), SampleView(index=1, state="finished", status="failed", reward=0.0),
                  SampleView(index=2, state="finished", status="cancelled")],
    )  # fmt: skip
    f = build_fields([group], 3, pad_id=151643)
    assert f["prompt_ids"] == [[1, 2, 3], [1, 2, 3], [151643]]
    assert f["completion_ids"] == [[4, 5, 9, 9, 6, 7], [4, 8], [151643]]
    assert f["env_mask"] == [[1, 1, 0, 0, 1, 1], [0, 0], [0]]  # failed and empty samples: nothing trained
    assert f["logprobs"][0] == [-0.5, -0.5, 0.0, 0.0, -0.5, -0.5]
    assert f["polar_reward"] == [1.0, None, None]  # None: TRL leaves it out of the group's baseline
    assert f["polar_status"] == ["completed", "failed", "cancelled"]
    assert f["polar_weight_versions"] == [["3"], ["3"], []] and f["polar_rows"] == [1, 1, 0]


def _subagent_group() -> Group:
    """Sample 0: a main row, then a subagent's (a row of its own, as prefix-merge breaks it off);
    sample 1: one main row, reward 0; sample 2: no row (the harness never called the model)."""
    main = _row(0, [1, 2, 3], [4, 5], [1, 1])
    sub = _row(0, [7, 8], [9, 9, 9], [1, 0, 1]) | {"trajectory_id": "t0-sub", "role": "subagent"}
    other = _row(1, [1, 2, 3], [6], [1]) | {"reward": 0.0}
    return Group(
        task_id="g",
        state="finished",
        samples=[Sample.from_row(main), Sample.from_row(sub), Sample.from_row(other)],
        outcomes=[SampleView(index=0, state="finished", status="completed", reward=1.0),
                  SampleView(index=1, state="finished", status="completed", reward=0.0),
                  SampleView(index=2, state="finished", status="cancelled")],
    )  # fmt: skip


def test_trl_gets_the_main_row_of_a_sample_with_a_subagent_and_counts_the_other():
    """TRL takes one completion per prompt: the main agent's row, not whatever came last."""
    from polar_mitm.bridges.trl import rows_dropped

    f = build_fields([_subagent_group()], 3)
    assert f["completion_ids"][0] == [4, 5] and f["polar_rows"] == [2, 1, 0]
    assert rows_dropped(f) == 1
    last = build_fields([_subagent_group()], 3, row="last")
    assert last["completion_ids"][0] == [9, 9, 9] and last["env_mask"][0] == [1, 0, 1]
    assert build_fields([_subagent_group()], 3, row="subagent")["completion_ids"][1] == [6]  # none: its last
    with pytest.raises(ValueError, match="choose one of main, subagent, compaction, last"):
        build_fields([_subagent_group()], 3, row="first")


def test_slime_gets_every_trained_row_of_a_sample_with_its_reward():
    from polar_mitm.bridges.slime import fill_group, hand_over

    class Target:
        metadata: dict

        def __init__(self):
            self.metadata = {}

    group = _subagent_group()
    targets = [Target() for _ in range(3)]
    filled = fill_group(targets, group, 0)
    assert [len(one) for one in filled] == [2, 1, 1] and filled[0][0] is targets[0]
    (main, sub), (other,), (empty,) = filled
    assert (main.tokens, sub.tokens) == ([1, 2, 3, 4, 5], [7, 8, 9, 9, 9]) and sub.loss_mask == [1, 0, 1]
    assert main.reward == sub.reward == 1.0 and other.reward == 0.0 and (main.index, sub.index) == (0, 0)
    assert empty.remove_sample and empty.tokens == []
    samples, metrics = hand_over([targets], [filled], rows=3)
    assert samples == [filled]  # a list per sample: slime flattens it
    assert main.rollout_id == sub.rollout_id != other.rollout_id != empty.rollout_id
    assert metrics["polar/rows"] == 4 and metrics["polar/rows_dropped"] == 0
    # One row per sample, when chosen: the main row, the subagent's counted as dropped.
    one = fill_group([Target() for _ in range(3)], group, 0, rows="main")
    assert [t.tokens for [t] in one][:2] == [[1, 2, 3, 4, 5], [1, 2, 3, 6]]
    samples, metrics = hand_over([[t for [t] in one]], [one], rows=3)
    assert samples == [[t for [t] in one]] and metrics["polar/rows_dropped"] == 1


def test_slime_rewards_are_normalized_per_sample_not_per_row():
    """A sample of two rows counts once in its group's baseline: rewards 1 (two rows) and 0
    have mean 0.5, where slime's own row-wise mean would say 2/3."""
    from polar_mitm.bridges.slime import POST_PROCESS, _rows_setting, post_process_rewards

    rows = [SimpleNamespace(group_index=0, index=i, reward=r) for i, r in [(0, 1.0), (0, 1.0), (1, 0.0)]]
    rows.append(SimpleNamespace(group_index=1, index=0, reward=1.0))
    args = SimpleNamespace(
        advantage_estimator="grpo", rewards_normalization=True, grpo_std_normalization=False
    )
    raw, rewards = post_process_rewards(args, rows)
    assert raw == [1.0, 1.0, 0.0, 1.0] and rewards == [0.5, 0.5, -0.5, 0.0]
    args.grpo_std_normalization = True
    _, scaled = post_process_rewards(args, rows)
    assert scaled[:3] == pytest.approx([0.5 / 0.70710778, 0.5 / 0.70710778, -0.5 / 0.70710778])
    assert post_process_rewards(SimpleNamespace(advantage_estimator="ppo"), rows)[1] == raw
    # Every row to slime with its row-wise normalization: refused, with the way out.
    with pytest.raises(ValueError, match="custom-reward-post-process-path polar_mitm.bridges.slime"):
        _rows_setting(SimpleNamespace(advantage_estimator="grpo", rewards_normalization=True))
    ok = SimpleNamespace(advantage_estimator="grpo", rewards_normalization=True,
                         custom_reward_post_process_path=POST_PROCESS)  # fmt: skip
    assert _rows_setting(ok) == "all"
    assert (
        _rows_setting(
            SimpleNamespace(advantage_estimator="grpo", rewards_normalization=True, polar_rows="main")
        )
        == "main"
    )


def test_verl_gets_the_chosen_row():
    from polar_mitm.bridges import chosen_row, trained_rows

    rows = _subagent_group().samples[:2]
    assert chosen_row(rows).role == "main" and chosen_row(rows, "last").role == "subagent"
    assert chosen_row([], "main") is None
    assert trained_rows(rows) == rows


# --- the HF engine --------------------------------------------------------------------------------


@pytest.mark.slow
async def test_hf_engine_reports_its_models_own_logprobs_and_loads_new_weights(
    tiny_lm, qwen_tokenizer_dir, tmp_path
):
    import torch

    from polar_mitm.fake import FakeBackendConfig, start_fake_backend
    from polar_mitm.fake.hf import load_causal_lm
    from polar_mitm.reconstruct.agreement import check

    runner, url = await start_fake_backend(
        FakeBackendConfig(tokenizer_path=str(qwen_tokenizer_dir), mode="hf", model_dir=str(tiny_lm))
    )
    prompt = list(range(3000, 3300))
    body = {
        "input_ids": prompt,
        "sampling_params": {"ignore_eos": True, "max_new_tokens": 8},
        "return_logprob": True,
    }

    async def sample() -> dict:
        out = (await http.post("/generate", json=body)).json()
        return {"trajectory_id": "r", "prompt_ids": prompt, "response_ids": out["output_ids"],
                "loss_mask": [1] * len(out["output_ids"]),
                "response_logprobs": [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]],
                "version": out["meta_info"]["weight_version"]}  # fmt: skip

    try:
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            rows = [await sample() for _ in range(2)]
            assert rows[0]["response_ids"] != rows[1]["response_ids"]  # sampled, not scripted
            model = load_causal_lm(tiny_lm)
            report = check(model, rows, tolerance=1e-5)
            assert report.tokens >= 12 and report.max_abs <= 1e-5

            # New weights: the trainer's save, loaded in place, served as the version named.
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(torch.randn_like(p) * 0.05)
            model.save_pretrained(tmp_path / "w1")
            r = await http.post(
                "/update_weights_from_disk", json={"model_path": str(tmp_path / "w1"), "weight_version": "1"}
            )
            assert r.status_code == 200 and r.json() == {
                "success": True, "message": "Succeeded to update model weights.", "num_paused_requests": 0
            }  # fmt: skip
            assert (await http.get("/model_info")).json()["weight_version"] == "1"
            row = await sample()
            assert row["version"] == "1"
            assert check(model, [row], tolerance=1e-5).max_abs <= 1e-5  # sampled by the new weights
            assert check(load_causal_lm(tiny_lm), [row], strict=False, tolerance=1e-5).max_abs > 1e-3

            r = await http.post("/update_weights_from_disk", json={"model_path": str(tmp_path / "nothing")})
            assert r.status_code == 400 and r.json()["success"] is False
            assert (await http.get("/model_info")).json()["weight_version"] == "1"
            r = await http.post("/update_weights_from_disk", json={"load_format": "auto"})
            assert r.status_code == 400 and "model_path" in r.json()["message"]
    finally:
        await runner.cleanup()


@pytest.mark.slow
async def test_weight_sync_reloads_the_vllm_hf_engine_the_way_vllm_takes_weights(
    tiny_lm, qwen_tokenizer_dir, tmp_path
):
    """`WeightSync` without a service against the fake in vLLM's API (`--mode hf`): it finds the
    engine is vLLM, drives vLLM's reload (pause, collective_rpc reload_weights,
    reset_prefix_cache, update_weight_version, resume), and the next completion is sampled by the
    saved weights under the new version."""
    import torch

    from polar_mitm.bridges.trl import WeightSync
    from polar_mitm.fake import STATE, FakeBackendConfig, start_fake_backend
    from polar_mitm.fake.hf import load_causal_lm
    from polar_mitm.reconstruct.agreement import check

    runner, url = await start_fake_backend(
        FakeBackendConfig(
            tokenizer_path=str(qwen_tokenizer_dir), mode="hf", model_dir=str(tiny_lm), api="vllm"
        )
    )
    prompt = list(range(3000, 3300))
    body = {"prompt": prompt, "max_tokens": 8, "logprobs": 0, "return_token_ids": True}

    async def sample() -> dict:
        choice = (await http.post("/v1/completions", json=body)).json()["choices"][0]
        return {"trajectory_id": "r", "prompt_ids": prompt, "response_ids": choice["token_ids"],
                "loss_mask": [1] * len(choice["token_ids"]),
                "response_logprobs": choice["logprobs"]["token_logprobs"]}  # fmt: skip

    try:
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            model = load_causal_lm(tiny_lm)
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(torch.randn_like(p) * 0.05)
            sync = WeightSync(url, tmp_path / "weights")
            record = await asyncio.to_thread(sync.push, model, "1")  # synchronous, as in a trainer
            assert record["kind"] == "vllm" and record["drained"] is None
            paths = [q["path"] for q in runner.app[STATE].requests][-5:]
            assert paths == [
                "/pause",
                "/collective_rpc",
                "/reset_prefix_cache",
                "/update_weight_version",
                "/resume",
            ]
            assert (await http.get("/weight_info")).json() == {"weight_version": "1"}
            assert (await http.get("/is_paused")).json() == {"is_paused": False}
            row = await sample()
            assert check(model, [row], tolerance=1e-5).max_abs <= 1e-5  # sampled by the new weights
            assert check(load_causal_lm(tiny_lm), [row], strict=False, tolerance=1e-5).max_abs > 1e-3
    finally:
        await runner.cleanup()


# --- the agreement check ---------------------------------------------------------------------------


@pytest.mark.slow
async def test_check_logprobs_fails_loudly_on_an_off_by_one(tiny_lm, qwen_tokenizer_dir, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    from click.testing import CliRunner

    from polar_mitm.cli import main
    from polar_mitm.fake import FakeBackendConfig, start_fake_backend

    runner, url = await start_fake_backend(
        FakeBackendConfig(tokenizer_path=str(qwen_tokenizer_dir), mode="hf", model_dir=str(tiny_lm))
    )
    try:
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            prompt = list(range(5000, 5200))
            out = (await http.post("/generate", json={"input_ids": prompt, "return_logprob": True,
                   "sampling_params": {"ignore_eos": True, "max_new_tokens": 10}})).json()  # fmt: skip
    finally:
        await runner.cleanup()
    lps = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
    good = {"trajectory_id": "good", "prompt_ids": prompt, "response_ids": out["output_ids"],
            "loss_mask": [1] * 10, "response_logprobs": lps}  # fmt: skip
    # The export bug an off-by-one makes: each token carries the logprob of the one before it.
    shifted = good | {"trajectory_id": "shifted", "response_logprobs": [0.0, *lps[:-1]]}
    cli = CliRunner()
    for name, rows in (("good", [good]), ("shifted", [good, shifted])):
        pq.write_table(pa.Table.from_pylist(rows), tmp_path / f"{name}.parquet")
    ok = cli.invoke(main, ["check-logprobs", "--model", str(tiny_lm), "--parquet", str(tmp_path / "good.parquet"),
                           "--tolerance", "1e-5", "--json"])  # fmt: skip
    assert ok.exit_code == 0, ok.output
    report = json.loads(ok.stdout)
    assert report["tokens"] == 10 and report["max_abs"] <= 1e-5 and report["over"] == 0.0
    bad = cli.invoke(
        main, ["check-logprobs", "--model", str(tiny_lm), "--parquet", str(tmp_path / "shifted.parquet")]
    )
    assert bad.exit_code == 2
    assert "MISALIGNED" in bad.stderr and "row shifted" in bad.stderr and "shifted by -1" in bad.stderr


# --- verl's own types, slime's fields ---------------------------------------------------------------


@pytest.mark.slow
async def test_verl_bridge_returns_verls_own_agent_loop_output_from_a_real_group(service):
    """verl 0.9.1 installed (--no-deps, as scripts/install.sh does): its AgentLoopOutput, and the
    loop in its own registry."""
    agent_loop = pytest.importorskip(
        "verl.experimental.agent_loop.agent_loop",
        reason="verl is not installed (scripts/install.sh installs its types)",
    )
    from polar_mitm.bridges.verl import PolarAgentLoop, agent_loop_class
    from tests.support.service import harness

    cls = agent_loop_class()
    assert issubclass(cls, agent_loop.AgentLoopBase)
    assert agent_loop._agent_loop_registry["polar"] == {"_target_": f"{cls.__module__}.{cls.__qualname__}"}
    svc = await service(nodes=1)
    loop = PolarAgentLoop()  # verl builds its subclass with its own config; the run is the same
    loop.server, loop.runtime, loop.poll, loop.request = svc.url, "local", 0.2, {"harness_cmd": harness()}
    out = await loop.run({}, raw_prompt=[{"role": "user", "content": "pass"}],
                         extra_info={"polar_evaluator": {"kind": "command", "command": "grep -q pass out.txt"}})  # fmt: skip
    assert isinstance(out, agent_loop.AgentLoopOutput)
    assert (
        out.reward_score == 1.0
        and out.num_turns == 1
        and isinstance(out.metrics, agent_loop.AgentLoopMetrics)
    )
    assert (
        len(out.response_ids)
        == len(out.response_mask)
        == len(out.response_logprobs)
        > 0
        < len(out.prompt_ids)
    )
    assert out.extra_fields == {
        "polar_status": "completed",
        "polar_removed": False,
        "polar_weight_versions": ["0"],
        "polar_rows": 1,
        "polar_rows_dropped": 0,
    }
    batch = out.as_dict()  # what verl's worker makes of it
    assert batch["responses"].tolist() == out.response_ids and batch["rollout_log_probs"].shape[0] == len(
        out.response_ids
    )


def test_slime_bridge_writes_the_fields_slimes_sample_has():
    """slime is not on PyPI: the fields `bridges.slime.fill` writes, checked against
    `slime/utils/types.py` of THUDM/slime (see the commit named in bridges/slime.py)."""
    from polar_mitm.bridges.slime import SLIME_SAMPLE_FIELDS, fill

    class Target:
        pass

    row = Sample.from_row(_row(0, [1, 2], [3, 4], [1, 1]))
    t = fill(Target(), row, "completed", 1.0, 0, 0)
    written = set(vars(t))
    assert written <= SLIME_SAMPLE_FIELDS, written - SLIME_SAMPLE_FIELDS


# --- TRL's GRPOTrainer, real Claude Code -----------------------------------------------------------


@pytest.mark.e2e
@pytest.mark.slow
async def test_trl_grpo_trainer_takes_two_steps_on_claude_code_groups_and_masks_what_it_must(
    service,
    tiny_lm,
    qwen_tokenizer_dir,
    tmp_path,
):
    """Two tasks × 2 samples of real Claude Code (scripted engine: a Bash tool call, its result,
    a final answer): one group with rewards 1 and 0, one whose verifier breaks (failed samples).
    TRL's GRPOTrainer takes 2 optimizer steps: finite loss, changed weights. Then, on the same
    batch: tool-result tokens and failed samples get no gradient, and perturbing a failed
    sample's tokens leaves loss and gradients as they were."""
    pytest.importorskip("trl", reason=NEEDS_TRL)
    if shutil.which("claude") is None:
        pytest.skip("claude is not installed (npm i -g @anthropic-ai/claude-code)")
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig

    from polar_mitm.bridges.trl import PolarGRPOTrainer

    svc = await service(nodes=1)
    first = tmp_path / "first"
    tasks = {
        "mixed": {"id": "mixed", "instruction": "run: echo 42 > answer.txt",
                  "evaluator": {"kind": "command", "command": f"mkdir {first} 2>/dev/null"}},  # the first scored wins
        "broken": {"id": "broken", "instruction": "run: echo 41 > answer.txt",
                   "evaluator": {"kind": "command", "command": "true", "reward_file": "."}},  # cannot run
    }  # fmt: skip
    rollout = PolarRollout(
        svc.url, harness="claude-code", runtime="local", poll=0.3, timeout=240,
        tasks={k: Task.model_validate(v) for k, v in tasks.items()}, request={"harness_cmd": CLAUDE},
    )  # fmt: skip
    model = AutoModelForCausalLM.from_pretrained(str(tiny_lm), dtype=torch.float32)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    args = GRPOConfig(
        output_dir=str(tmp_path / "trl"), use_cpu=True, report_to=[], max_steps=2, learning_rate=0.05,
        per_device_train_batch_size=2, num_generations=2, steps_per_generation=2, logging_steps=1,
        save_strategy="no", seed=0, dataloader_num_workers=0,
    )  # fmt: skip
    trainer = PolarGRPOTrainer(
        model=model, args=args, train_dataset=Dataset.from_dict({"prompt": ["mixed", "broken"]}),
        processing_class=AutoTokenizer.from_pretrained(str(qwen_tokenizer_dir)), rollout=rollout,
        importance_sampling=False,  # the scripted engine's logprobs are not this model's
    )  # fmt: skip
    result = await asyncio.to_thread(trainer.train)
    assert result.global_step == 2 and torch.isfinite(torch.tensor(result.training_loss))
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))
    assert any(not torch.equal(before[n], p) for n, p in model.named_parameters()), "no weight changed"

    # What the rollout handed TRL: one call, both groups, Claude Code's two turns merged.
    assert rollout.calls == 1 and sorted(rollout.prompts) == ["broken", "mixed"]
    fields = build_fields(rollout.groups, 2, trainer.processing_class.pad_token_id)
    statuses = fields["polar_status"]
    rewards = fields["polar_reward"]
    assert sorted(r for r in rewards if r is not None) == [0.0, 1.0]
    assert statuses.count("failed") == 2 and rewards.count(None) == 2
    multi = [m for m, s in zip(fields["env_mask"], statuses, strict=True) if s == "completed"]
    for m in multi:  # a trained turn, a masked tool result, a trained final answer
        assert m[0] == 1 and 0 in m and m[-1] == 1
    for m, s in zip(fields["env_mask"], statuses, strict=True):
        assert s == "completed" or not any(m)

    # The same batch again, without a new rollout: gradients at the per-token logprobs.
    prompts = [p for p in rollout.prompts for _ in range(2)]
    replay = build_fields(rollout.groups, 2, trainer.processing_class.pad_token_id)
    trainer.rollout_func = lambda prompts, tr: replay
    trainer.model.train()
    inputs = trainer._generate_and_score_completions([{"prompt": p} for p in prompts])
    captured = {}
    own = trainer._get_per_token_logps_and_entropies

    def spy(*a, **kw):
        logps, entropies, aux = own(*a, **kw)
        logps.retain_grad()
        captured["logps"] = logps
        return logps, entropies, aux

    trainer._get_per_token_logps_and_entropies = spy

    def loss_and_grads(batch):
        trainer.model.zero_grad()
        loss = trainer.compute_loss(trainer.model, batch)
        loss.backward()
        return (
            loss.detach(),
            captured["logps"].grad.clone(),
            [p.grad.clone() for p in trainer.model.parameters()],
        )

    loss, g, grads = loss_and_grads(inputs)
    mask = inputs["completion_mask"] * inputs["tool_mask"]
    assert torch.isfinite(loss) and (inputs["advantages"] != 0).any()
    assert (g[mask == 0] == 0).all(), "a masked token (tool result, failed sample, padding) got a gradient"
    assert (g[mask == 1] != 0).any()
    tool_result = (inputs["completion_mask"] == 1) & (inputs["tool_mask"] == 0)
    assert tool_result.any() and (g[tool_result] == 0).all()

    # A failed sample's tokens, replaced by others: same loss, same gradients.
    failed = [i for i, s in enumerate(replay["polar_status"]) if s == "failed"]
    perturbed = dict(inputs)
    ids = inputs["completion_ids"].clone()
    for i in failed:
        n = int(inputs["completion_mask"][i].sum())
        ids[i, :n] = torch.randint(1000, 100000, (n,))
    perturbed["completion_ids"] = ids
    loss2, _, grads2 = loss_and_grads(perturbed)
    assert torch.equal(loss, loss2)
    assert all(torch.allclose(a, b, atol=0, rtol=0) for a, b in zip(grads, grads2, strict=True))


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.timeout(1200)  # 214 s on a quiet 2-core machine; a TRL step slows a lot under load
async def test_trl_grpo_step_on_claude_code_with_a_subagent_trains_the_main_row_and_counts_the_other(
    service,
    tiny_lm,
    qwen_tokenizer_dir,
    tmp_path,
):
    """One task x 2 samples of real Claude Code calling its `Agent` tool (scripted engine: the
    main agent starts a subagent, the subagent reports, the main agent ends): each sample has a
    `main` row and a `subagent` row (prefix-merge breaks at the subagent's own conversation). TRL
    takes one completion per prompt, so the bridge hands it each sample's main row: one
    GRPOTrainer step trains on it (finite loss, changed weights), and the two subagent rows are
    TRL's logged `polar/rows_dropped`."""
    pytest.importorskip("trl", reason=NEEDS_TRL)
    if shutil.which("claude") is None:
        pytest.skip("claude is not installed (npm i -g @anthropic-ai/claude-code)")
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig

    from polar_mitm.bridges.trl import PolarGRPOTrainer

    svc = await service(nodes=1, backend={"script": CLAUDE_SUBAGENT_SCRIPT})
    first = tmp_path / "first"
    task = Task.model_validate(
        {"id": "spawn", "instruction": "Begin the check with a subagent",
         "evaluator": {"kind": "command", "command": f"mkdir {first} 2>/dev/null"}}  # the first scored wins
    )  # fmt: skip
    rollout = PolarRollout(
        svc.url, harness="claude-code", runtime="local", poll=0.3, timeout=240,
        tasks={"spawn": task}, request={"harness_cmd": CLAUDE_AGENT},
    )  # fmt: skip
    model = AutoModelForCausalLM.from_pretrained(str(tiny_lm), dtype=torch.float32)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    args = GRPOConfig(
        output_dir=str(tmp_path / "trl"), use_cpu=True, report_to=[], max_steps=1, learning_rate=0.05,
        per_device_train_batch_size=2, num_generations=2, steps_per_generation=1, logging_steps=1,
        save_strategy="no", seed=0, dataloader_num_workers=0,
        # ~700 completion tokens x 151k logits a sample: no recomputed forward (TRL's default), and
        # float32 (bf16 matmuls on a CPU without bf16 units are several times slower).
        activation_checkpointing=False, bf16=False,
    )  # fmt: skip
    tokenizer = AutoTokenizer.from_pretrained(str(qwen_tokenizer_dir))
    trainer = PolarGRPOTrainer(
        model=model, args=args, train_dataset=Dataset.from_dict({"prompt": ["spawn"]}),
        processing_class=tokenizer, rollout=rollout,
        importance_sampling=False,  # the scripted engine's logprobs are not this model's
    )  # fmt: skip
    result = await asyncio.to_thread(trainer.train)
    assert result.global_step == 1 and torch.isfinite(torch.tensor(result.training_loss))
    [logged] = [h for h in trainer.state.log_history if "loss" in h]
    assert torch.isfinite(torch.tensor(logged["loss"]))
    assert any(not torch.equal(before[n], p) for n, p in model.named_parameters()), "no weight changed"

    # Each sample: a main row and the subagent's, started by the main agent's Agent call.
    [group] = rollout.groups
    by_sample = rows_by_sample(group.samples)
    assert sorted(by_sample) == [0, 1]
    mains, subs = {}, {}
    for i, rows in by_sample.items():
        assert sorted(r.role for r in rows) == ["main", "subagent"], [(r.role, r.num_turns) for r in rows]
        [mains[i]] = [r for r in rows if r.role == "main"]
        [subs[i]] = [r for r in rows if r.role == "subagent"]
        assert subs[i].metadata["spawned_by_tool"] == "Agent"
        assert mains[i].num_turns >= 2 and subs[i].num_turns >= 1
    # What TRL got (the same groups, handed again): each sample's main row, the subagent's counted.
    fields = build_fields(rollout.groups, 2, tokenizer.pad_token_id)
    assert fields["polar_rows"] == [2, 2] and logged["polar/rows_dropped"] == 2.0
    assert sorted(fields["polar_reward"]) == [0.0, 1.0]
    for i in (0, 1):
        assert fields["prompt_ids"][i] == mains[i].prompt_ids
        assert fields["completion_ids"][i] == mains[i].response_ids != subs[i].response_ids
        assert fields["env_mask"][i] == mains[i].loss_mask and 1 in fields["env_mask"][i]
        assert 0 in fields["env_mask"][i]  # the Agent call's result: in the sequence, not trained
