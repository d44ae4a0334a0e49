"""TRL's `GRPOTrainer` on polar-mitm rollouts (tested with TRL 1.16.0, transformers 5.24, torch 2.14).

How TRL lets a rollout in (read in TRL 1.16.0, `trl/trainer/grpo_trainer.py`): a trainer built
with `rollout_func=f` calls `f(prompts, trainer)` from its generation step, whatever `use_vllm`
is. `prompts` is this process's slice of the batch, every prompt repeated `num_generations` times
in a row (TRL's `RepeatSampler`), and `f` returns one completion per prompt: `prompt_ids`,
`completion_ids` and `logprobs` (lists per completion), plus any other key. TRL takes `env_mask`
as the completion's tool mask (1: a model token, trained; 0: not trained — TRL multiplies it
into the loss mask, the tokens stay in the sequence the model attends to), and hands every other
key to the reward functions as a keyword argument. A reward of None makes a completion
unscorable: TRL leaves it out of its group's baseline and gives it advantage 0.

So a multi-turn row (prefix-merged: the turns the model sampled, with the tool results and
harness messages between them) is one completion whose `env_mask` is our `loss_mask`, and a
failed or cancelled sample is a completion whose mask is all 0 with reward None: never trained,
never counted in the baseline, never silently dropped. TRL takes exactly one completion per
prompt, so a sample with several rows (prefix-merge breaks: subagents, compaction) gives TRL one:
the row chosen by `row` (the main agent's by default, see `bridges.chosen_row`); `polar_rows`
tells how many it had, and the rows left out are logged as TRL's `polar/rows_dropped` metric.

- `PolarRollout`: the `rollout_func`. Each run of identical prompts becomes one task of that many
  samples on the rollout service (`polar-mitm serve`; on one machine, `serve --nodes 1`). A
  prompt is a key of `tasks` (a `Task`, or a path the server can read), or an instruction.
- `polar_reward`: the reward function (the task's own verifier's reward).
- `WeightSync`: a trainer callback that, after each optimizer step, saves the weights, pauses the
  service (`/v1/admin/pause`, in-flight turns drain), has the engine load them with the new
  weight version (`polar_mitm.backends.weights`: SGLang's `/update_weights_from_disk`, vLLM's
  pause, `reload_weights`, prefix-cache reset, `update_weight_version`, resume), and resumes the
  service with that version.
- `PolarGRPOTrainer`: `GRPOTrainer` with the three wired in, and TRL's importance-sampling
  correction against the engine's logprobs (`vllm_importance_sampling_correction`) applied: TRL
  applies it only on its vLLM path, so the subclass marks that path on with a weight-sync hook
  that does nothing (the callback syncs), which also turns on TRL's own train/inference logprob
  difference metrics (`sampling/sampling_logp_difference/*`).

torch, transformers and trl are the `[trl]` extra; `build_fields` needs none of them.
"""

from __future__ import annotations

import functools
import logging
import shutil
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from polar_mitm.backends.weights import EngineWeights, Kind
from polar_mitm.bridges import check_row_choice, chosen_row, rows_by_sample
from polar_mitm.client import Group, RolloutClient, Sample
from polar_mitm.outcomes import trainable
from polar_mitm.tasks.model import EvaluatorSpec, Task

log = logging.getLogger(__name__)

TRL_TESTED = "1.16.0"


def instruction_of(prompt: Any) -> str:
    """A TRL prompt as text: a string, or chat messages (the last user message's content)."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list):
        for m in reversed(prompt):
            if isinstance(m, dict) and m.get("role") == "user":
                content = m.get("content")
                if isinstance(content, list):  # typed content blocks
                    return "".join(b.get("text", "") for b in content if isinstance(b, dict))
                return str(content)
    return str(prompt)


def runs(prompts: Sequence[Any], n: int) -> list[Any]:
    """The distinct prompts of a batch TRL repeated `n` times in a row; refuses any other shape
    (a group must be one task's samples, or the advantages mix tasks)."""
    if n < 1 or len(prompts) % n:
        raise ValueError(f"{len(prompts)} prompts do not split into groups of num_generations={n}")
    firsts = []
    for start in range(0, len(prompts), n):
        chunk = prompts[start : start + n]
        if any(p != chunk[0] for p in chunk[1:]):
            raise ValueError(
                f"prompts {start}..{start + n - 1} differ: TRL hands each prompt num_generations times in a "
                "row, and each run becomes one task's group"
            )
        firsts.append(chunk[0])
    return firsts


def _sample_fields(row: Sample | None, usable: bool, pad_id: int) -> dict[str, Any]:
    if row is None:  # the harness never called the model: one untrained placeholder token
        return {"prompt_ids": [pad_id], "completion_ids": [pad_id], "logprobs": [0.0], "env_mask": [0]}
    return {
        "prompt_ids": row.prompt_ids,
        "completion_ids": row.response_ids,
        "logprobs": [float(x) for x in row.rollout_logprobs],
        "env_mask": list(row.loss_mask) if usable else [0] * row.response_length,
    }


def build_fields(
    groups: Sequence[Group], samples: int, pad_id: int = 0, row: str = "main"
) -> dict[str, list[Any]]:
    """What `rollout_func` returns for these groups, `samples` completions per group in sample
    order, each the sample's row chosen by `row` (`bridges.chosen_row`): TRL's `prompt_ids`,
    `completion_ids`, `logprobs`, `env_mask`, and for the reward functions `polar_reward` (None
    where the sample must not be trained), `polar_status`, `polar_weight_versions`,
    `polar_task_id`, `polar_rows` (how many rows the sample had; all but one are left out)."""
    keys = ("prompt_ids", "completion_ids", "logprobs", "env_mask")
    out: dict[str, list[Any]] = {k: [] for k in keys}
    for extra in ("polar_reward", "polar_status", "polar_weight_versions", "polar_task_id", "polar_rows"):
        out[extra] = []
    check_row_choice(row)
    for group in groups:
        by_sample = rows_by_sample(group.samples)
        for i in range(samples):
            outcome = group.outcomes[i] if i < len(group.outcomes) else None
            status = outcome.status if outcome is not None and outcome.status else "cancelled"
            rows = by_sample.get(i, [])
            chosen = chosen_row(rows, row)
            usable = trainable(status) and chosen is not None and not chosen.remove_sample
            reward = (outcome.reward or 0.0) if usable and outcome is not None else None
            for k, v in _sample_fields(chosen, usable, pad_id).items():
                out[k].append(v)
            out["polar_reward"].append(reward)
            out["polar_status"].append(status)
            out["polar_weight_versions"].append(list(chosen.weight_versions) if chosen is not None else [])
            out["polar_task_id"].append(group.task_id)
            out["polar_rows"].append(len(rows))
    return out


def rows_dropped(fields: Mapping[str, list[Any]]) -> int:
    """How many rows `build_fields` left out (every sample gives TRL one of its rows)."""
    return sum(max(0, n - 1) for n in fields["polar_rows"])


def polar_reward(
    completions: list[Any], polar_reward: list[float | None], **kwargs: Any
) -> list[float | None]:
    """TRL reward function: the reward the task's verifier gave each sample (None: not trainable)."""
    return list(polar_reward)


class PolarRollout:
    """TRL's `rollout_func`, backed by the rollout service.

    `tasks` maps prompts (as the dataset holds them: ids or instructions) to a `Task` or a task
    path the server can read; any other prompt is an instruction scored by `evaluator` (default:
    the harness exited 0). `request` holds more TaskRequest fields for every task (`harness_cmd`,
    `max_staleness`, timeouts, …). `row` is the row of a sample with several that TRL trains on
    (`bridges.ROW_CHOICES`; the main agent's by default); the others are counted in TRL's
    `polar/rows_dropped` metric. After each call `groups` holds the groups it returned and
    `prompts` the prompt of each, in order."""

    def __init__(
        self,
        server: str | RolloutClient = "http://127.0.0.1:8700",
        *,
        harness: str = "claude-code",
        runtime: str = "docker",
        tasks: Mapping[str, Task | str] | None = None,
        evaluator: EvaluatorSpec | dict[str, Any] | None = None,
        request: dict[str, Any] | None = None,
        token: str | None = None,
        poll: float = 1.0,
        timeout: float | None = None,
        row: str = "main",
    ) -> None:
        self.row = check_row_choice(row)
        self.client = server if isinstance(server, RolloutClient) else RolloutClient(server, token=token)
        self.harness, self.runtime = harness, runtime
        self.tasks = dict(tasks or {})
        self.evaluator = EvaluatorSpec.model_validate(evaluator or {"kind": "session_completed"})
        self.request = dict(request or {})
        self.poll, self.timeout = poll, timeout
        self.calls = 0
        self.groups: list[Group] = []
        self.prompts: list[Any] = []

    def task_for(self, prompt: Any, index: int) -> Task | str:
        text = instruction_of(prompt)
        given = self.tasks.get(text)
        if given is not None:
            return given
        return Task(id=f"trl-{self.calls}-{index}", instruction=text, evaluator=self.evaluator)

    def rollout(self, prompts: Sequence[Any], samples: int) -> list[Group]:
        """Submit each distinct prompt as a task of `samples` samples; its groups in prompt order."""
        firsts = runs(prompts, samples)
        tag = uuid.uuid4().hex[:8]
        ids = [
            self.client.submit(
                self.task_for(p, gi),
                samples=samples,
                harness=self.harness,
                runtime=self.runtime,
                task_id=f"trl-{tag}-{self.calls}-{gi}",
                **self.request,
            )
            for gi, p in enumerate(firsts)
        ]
        done = {g.task_id: g for g in self.client.wait(ids, poll=self.poll, timeout=self.timeout)}
        self.calls += 1
        self.prompts = firsts
        self.groups = [done[t] for t in ids]
        return self.groups

    def __call__(self, prompts: list[Any], trainer: Any = None) -> dict[str, list[Any]]:
        samples, pad_id, mode = 1, 0, "train"
        if trainer is not None:
            training = getattr(getattr(trainer, "model", None), "training", True)
            mode = "train" if training else "eval"
            samples = trainer.num_generations if training else trainer.num_generations_eval
            tok = getattr(trainer, "processing_class", None)
            tok = getattr(tok, "tokenizer", tok)
            pad = getattr(tok, "pad_token_id", None)
            pad_id = pad if pad is not None else (getattr(tok, "eos_token_id", None) or 0)
        fields = build_fields(self.rollout(prompts, samples), samples, pad_id, self.row)
        # GRPOTrainer's metrics ({"train": defaultdict(list), "eval": ...}), averaged into its logs.
        metrics = getattr(trainer, "_metrics", None)
        if isinstance(metrics, dict) and mode in metrics:
            metrics[mode]["polar/rows_dropped"].append(float(rows_dropped(fields)))
        return fields


def _trainer_callback_base() -> type:
    try:
        from transformers import TrainerCallback
    except ImportError:
        return object
    return TrainerCallback


class WeightSync(_trainer_callback_base()):  # type: ignore[misc]
    """After each optimizer step: save the weights, pause the service, load them into the engine
    with `weight_version` = the global step (`EngineWeights`: SGLang's or vLLM's way, `engine`
    says which; "auto" asks the engine once), resume with that version. Turns sampled from then on
    record it; `max_staleness` counts from it.

    `client` None: no service (the engine is updated directly, nothing is paused). `keep` saved
    weight directories are kept (the engine may still be reading the newest)."""

    def __init__(
        self,
        engine_url: str,
        save_dir: str | Path,
        client: RolloutClient | None = None,
        *,
        engine: Kind = "auto",
        api_key: str | None = None,
        pause_timeout: float = 120.0,
        keep: int = 2,
        every: int = 1,
    ) -> None:
        self.engine_url = engine_url.rstrip("/")
        self.save_dir = Path(save_dir)
        self.client = client
        self.engine = EngineWeights(self.engine_url, engine, api_key=api_key, timeout=pause_timeout)
        self.pause_timeout = pause_timeout
        self.keep, self.every = keep, every
        self.pushed: list[dict[str, Any]] = []  # what each push did: step, version, path, drained

    def push(self, model: Any, version: str) -> dict[str, Any]:
        """Save `model` and make the engine serve it as `version`."""
        path = self.save_dir / f"weights-{version}"
        getattr(model, "module", model).save_pretrained(path)
        record: dict[str, Any] = {"version": version, "path": str(path), "drained": None}
        if self.client is not None:
            record["drained"] = self.client.pause(self.pause_timeout).get("drained")
            if not record["drained"]:
                log.warning(
                    "weight sync: the service did not drain in %s s; updating anyway", self.pause_timeout
                )
        resumed_as: str | None = None
        try:
            record.update(self.engine.load(str(path), version))
            resumed_as = version
        finally:
            if self.client is not None:  # resume even after a failed update, on the old version
                self.client.resume(weight_version=resumed_as)
        self.pushed.append(record)
        for old in self.pushed[: -self.keep] if self.keep > 0 else []:
            shutil.rmtree(old["path"], ignore_errors=True)
        return record

    def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> Any:
        if model is None or not state.is_world_process_zero or state.global_step % self.every:
            return control
        self.push(model, str(state.global_step))
        self.pushed[-1]["step"] = state.global_step
        return control


class _NoVLLMSync:
    """Stands where TRL keeps its vLLM client: TRL calls `sync_weights()` before a rollout when
    the step changed; `WeightSync` has synced already."""

    def sync_weights(self) -> None:
        return None


@functools.cache
def polar_grpo_trainer_class() -> type:
    """`PolarGRPOTrainer` (imports trl)."""
    from trl import GRPOTrainer

    class PolarGRPOTrainer(GRPOTrainer):  # type: ignore[misc, valid-type]
        """`GRPOTrainer(rollout_func=rollout, reward_funcs=polar_reward)`, with `weight_sync` added
        as a callback and, unless `importance_sampling=False`, TRL's importance-sampling
        correction against the engine's logprobs (`args.vllm_importance_sampling_*` configure it)."""

        # GRPOTrainer's own (typed by trl where it is installed; said here for a checkout without it).
        use_vllm: bool

        def __init__(
            self,
            *args: Any,
            rollout: PolarRollout,
            weight_sync: WeightSync | None = None,
            importance_sampling: bool = True,
            reward_funcs: Any = None,
            **kwargs: Any,
        ) -> None:
            # *args are GRPOTrainer's model and args, never these two.
            super().__init__(*args, reward_funcs=reward_funcs or polar_reward, rollout_func=rollout, **kwargs)  # type: ignore[misc]
            self.polar_rollout = rollout
            if getattr(self.args, "bf16", False) or getattr(self.args, "fp16", False):
                # TRL's GRPOConfig defaults to bf16 autocast, also on CPU: the trainer's logprobs are
                # then half precision while the engine's are the engine's own dtype, and TRL's
                # sampling_logp_difference reads that gap (0.02-0.09 on a float32 engine).
                log.warning(
                    "the trainer computes logprobs under %s autocast; if the engine samples in another "
                    "dtype, TRL's importance ratio and sampling_logp_difference include the precision "
                    "gap (set bf16=False/fp16=False in GRPOConfig to train in the model's dtype)",
                    "bf16" if self.args.bf16 else "fp16",
                )
            if weight_sync is not None:
                self.add_callback(weight_sync)
            if importance_sampling and self.vllm_importance_sampling_correction and not self.use_vllm:
                # TRL 1.16 applies the correction where `use_vllm` is set; nothing else on the
                # rollout_func path reads it but the pre-rollout sync, which `_NoVLLMSync` skips.
                self.use_vllm = True
                self.vllm_generation = _NoVLLMSync()  # type: ignore[assignment]  # a stand-in, see _NoVLLMSync
                self._last_loaded_step = -1

    return PolarGRPOTrainer


def __getattr__(name: str) -> Any:  # `from polar_mitm.bridges.trl import PolarGRPOTrainer`
    if name == "PolarGRPOTrainer":
        return polar_grpo_trainer_class()
    raise AttributeError(name)
