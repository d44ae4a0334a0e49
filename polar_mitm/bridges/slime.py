"""A slime rollout function backed by the polar-mitm rollout service.

Point slime at it with `--rollout-function-path polar_mitm.bridges.slime.generate_rollout` and
tell it where the service is (`POLAR_MITM_SERVER`, optional `POLAR_MITM_SERVICE_TOKEN`) and which
harness runs the tasks (`POLAR_MITM_HARNESS`, default claude-code; `POLAR_MITM_RUNTIME`, default
docker). Each group slime's data source hands out becomes one task of `len(group)` samples: the
task is `sample.metadata["polar_task"]` (a Task dict, or a path the service can read) when
present, else an instruction-only task from `sample.prompt`, scored by `polar_evaluator` in the
metadata (default: the harness exited 0).

Every sample of the group is filled in place with slime's fields: `tokens` (prompt + response),
`response_length`, `loss_mask`, `rollout_log_probs`, `reward`, `status`, `weight_versions`,
`index`, `group_index`. A sample that failed or was cancelled is flagged (`remove_sample = True`),
its mask is all 0 and its status ABORTED: never silently dropped. When a sample produced several
rows (prefix-merge breaks), the last one is used.
"""

from __future__ import annotations

import os
from typing import Any

from polar_mitm.client import Group, RolloutClient, Sample
from polar_mitm.outcomes import trainable
from polar_mitm.tasks.model import EvaluatorSpec, Task

# slime's `Sample` (a dataclass in `slime/utils/types.py`), checked against THUDM/slime at commit
# 624b824a898ab0ec1fcb4d373004c7f3852bf515 (2026-08-21): the fields `fill` writes all exist there,
# with these names; `Sample.Status` has COMPLETED and ABORTED; `RolloutFnTrainOutput(samples,
# metrics)` and `RolloutFnEvalOutput(data, metrics)` are in `slime/rollout/base_types.py`.
SLIME_SAMPLE_FIELDS = frozenset(
    {
        "group_index", "index", "rollout_id", "prompt", "tokens", "multimodal_inputs",
        "multimodal_train_inputs", "multimodal_train_input_id", "apply_chat_template_kwargs", "response",
        "response_length", "label", "reward", "loss_mask", "weight_versions", "rollout_log_probs",
        "rollout_top_p_token_ids", "rollout_top_p_token_offsets", "rollout_routed_experts", "remove_sample",
        "teacher_log_probs", "status", "metadata", "generate_function_path", "custom_rm_path",
        "train_metadata", "session_id", "non_generation_time",
    }
)  # fmt: skip


def _status(sample: Any, name: str) -> Any:
    status_enum = getattr(type(sample), "Status", None)
    return getattr(status_enum, name, name.lower()) if status_enum is not None else name.lower()


def task_for(group: list[Any], rollout_id: int, gi: int) -> Task | str:
    first = group[0]
    meta = getattr(first, "metadata", None) or {}
    given = meta.get("polar_task")
    if isinstance(given, str):
        return given
    if isinstance(given, dict):
        return Task.model_validate(given)
    evaluator = meta.get("polar_evaluator") or {"kind": "session_completed"}
    prompt = first.prompt if isinstance(first.prompt, str) else str(first.prompt)
    return Task(
        id=f"slime-{rollout_id}-{gi}", instruction=prompt, evaluator=EvaluatorSpec.model_validate(evaluator)
    )


def fill(
    target: Any, row: Sample | None, outcome_status: str, reward: float | None, index: int, gi: int
) -> Any:
    """Write one polar-mitm sample into a slime Sample (or any object with those attributes)."""
    target.index = index
    target.group_index = gi
    usable = trainable(outcome_status) and row is not None and not row.remove_sample
    if row is not None:
        target.tokens = row.tokens
        target.response_length = row.response_length
        target.loss_mask = row.loss_mask if usable else [0] * row.response_length
        target.rollout_log_probs = row.rollout_logprobs
        target.weight_versions = row.weight_versions
    else:  # the harness never called the model: nothing to train on
        target.tokens, target.response_length, target.loss_mask, target.rollout_log_probs = [], 0, [], []
        target.weight_versions = []
    target.reward = (reward or 0.0) if usable else 0.0
    target.status = _status(target, "COMPLETED" if usable else "ABORTED")
    target.remove_sample = not usable
    meta = getattr(target, "metadata", None)
    if isinstance(meta, dict):
        meta["polar_status"] = outcome_status
    return target


def fill_group(slime_group: list[Any], group: Group, gi: int) -> list[Any]:
    last_row: dict[int, Sample] = {}
    for row in group.samples:
        last_row[row.index] = row
    for i, target in enumerate(slime_group):
        outcome = group.outcomes[i] if i < len(group.outcomes) else None
        fill(
            target,
            last_row.get(i),
            outcome.status if outcome and outcome.status else "cancelled",
            outcome.reward if outcome else None,
            i,
            gi,
        )
    return slime_group


def generate_rollout(args: Any, rollout_id: int, data_source: Any, evaluation: bool = False) -> Any:
    """slime's rollout-function contract: groups of samples, filled, for this rollout step."""
    n_groups = getattr(args, "rollout_batch_size", None) or 1
    groups: list[list[Any]] = data_source.get_samples(n_groups)
    server = getattr(args, "polar_server", None) or os.environ.get(
        "POLAR_MITM_SERVER", "http://127.0.0.1:8700"
    )
    token = getattr(args, "polar_token", None) or os.environ.get("POLAR_MITM_SERVICE_TOKEN")
    harness = getattr(args, "polar_harness", None) or os.environ.get("POLAR_MITM_HARNESS", "claude-code")
    runtime = getattr(args, "polar_runtime", None) or os.environ.get("POLAR_MITM_RUNTIME", "docker")
    extra = getattr(args, "polar_request", None) or {}
    with RolloutClient(server, token=token) as client:
        ids = [
            client.submit(
                task_for(g, rollout_id, gi),
                samples=len(g),
                harness=harness,
                runtime=runtime,
                task_id=f"slime-{rollout_id}-{gi}-{os.getpid()}",
                **extra,
            )
            for gi, g in enumerate(groups)
        ]
        by_id = {g.task_id: g for g in client.wait(ids, poll=getattr(args, "polar_poll", 1.0))}
    for gi, (tid, g) in enumerate(zip(ids, groups, strict=True)):
        fill_group(g, by_id[tid], gi)
    rewards = [s.reward for g in groups for s in g if not s.remove_sample]
    metrics = {
        "polar/usable": len(rewards) / max(1, sum(len(g) for g in groups)),
        "polar/mean_reward": sum(rewards) / len(rewards) if rewards else 0.0,
    }
    try:
        from slime.rollout.base_types import RolloutFnEvalOutput, RolloutFnTrainOutput
    except ImportError:
        return groups
    if evaluation:
        return RolloutFnEvalOutput(data={"polar": {"rewards": rewards, "samples": groups}}, metrics=metrics)
    return RolloutFnTrainOutput(samples=groups, metrics=metrics)
