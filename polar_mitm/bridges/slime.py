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
its mask is all 0 and its status ABORTED: never silently dropped.

A sample may have several rows (prefix-merge breaks: a subagent, a compaction). slime takes them
all: a rollout function may give a list of Samples for one sample (slime flattens the nesting,
and counts siblings that share a `rollout_id` once in its loss), so each trained row becomes a
Sample of its own with the sample's reward, the first written into slime's Sample, the others
copies of it (`POLAR_MITM_ROWS` / `args.polar_rows`: "all", the default). slime's own reward
normalization groups rewards by `n_samples_per_prompt` and would then mix groups, so a group
estimator (GRPO, ...) needs `--custom-reward-post-process-path
polar_mitm.bridges.slime.post_process_rewards`, which normalizes within each group over its
samples, each counted once; without it the rollout function refuses to start, saying so. Or
choose one row per sample (`main`, `subagent`, `compaction`, `last`; `bridges.chosen_row`). The
rows left out are counted in the metrics (`polar/rows_dropped`).
"""

from __future__ import annotations

import copy
import os
import statistics
from typing import Any

from polar_mitm.bridges import check_row_choice, chosen_row, rows_by_sample, trained_rows
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


POST_PROCESS = "polar_mitm.bridges.slime.post_process_rewards"
# slime's estimators whose rewards are normalized within a group (slime/ray/rollout.py).
GROUP_ESTIMATORS = frozenset({"grpo", "gspo", "cispo", "reinforce_plus_plus_baseline", "rloo"})


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


def fill_group(slime_group: list[Any], group: Group, gi: int, rows: str = "all") -> list[list[Any]]:
    """Fill each of slime's samples of a group from its polar-mitm rows: with `rows` "all", one
    slime Sample per trained row (the given one, then copies of it), else the one row chosen
    (`bridges.chosen_row`). Returns each sample's filled Samples, in sample order."""
    by_sample = rows_by_sample(group.samples)
    out: list[list[Any]] = []
    for i, target in enumerate(slime_group):
        outcome = group.outcomes[i] if i < len(group.outcomes) else None
        own = by_sample.get(i, [])
        picked: list[Sample | None] = []
        picked += trained_rows(own) if rows == "all" else [chosen_row(own, rows)]
        picked = picked or [None]
        filled = []
        for k, row in enumerate(picked):
            t = target if k == 0 else copy.deepcopy(target)
            status = outcome.status if outcome and outcome.status else "cancelled"
            filled.append(fill(t, row, status, outcome.reward if outcome else None, i, gi))
        out.append(filled)
    return out


def post_process_rewards(args: Any, samples: list[Any]) -> tuple[list[Any], list[Any]]:
    """slime's `--custom-reward-post-process-path` for rows of polar-mitm samples: (raw rewards,
    rewards) per row, normalized as slime does (minus the group's mean; GRPO and GSPO also over
    its standard deviation with `--grpo-std-normalization`) but within each group
    (`group_index`) over its samples (`index`), each counted once however many rows it has."""
    raw = [s.get_reward_value(args) if hasattr(s, "get_reward_value") else s.reward for s in samples]
    if getattr(args, "advantage_estimator", None) not in GROUP_ESTIMATORS or not getattr(
        args, "rewards_normalization", False
    ):
        return raw, raw
    per_sample: dict[Any, dict[Any, float]] = {}
    for s, r in zip(samples, raw, strict=True):
        per_sample.setdefault(s.group_index, {}).setdefault(s.index, float(r))
    scale = getattr(args, "advantage_estimator", None) in ("grpo", "gspo") and getattr(
        args, "grpo_std_normalization", False
    )
    stats = {}
    for g, values in per_sample.items():
        vals = list(values.values())
        std = statistics.stdev(vals) if len(vals) > 1 else 0.0  # torch's std: unbiased
        stats[g] = (statistics.fmean(vals), std + 1e-6 if scale else 1.0)
    return raw, [
        (float(r) - stats[s.group_index][0]) / stats[s.group_index][1]
        for s, r in zip(samples, raw, strict=True)
    ]


def _rows_setting(args: Any) -> str:
    rows = getattr(args, "polar_rows", None) or os.environ.get("POLAR_MITM_ROWS", "all")
    if rows != "all":
        return check_row_choice(rows)
    normalizes = getattr(args, "advantage_estimator", None) in GROUP_ESTIMATORS and getattr(
        args, "rewards_normalization", False
    )
    if normalizes and getattr(args, "custom_reward_post_process_path", None) != POST_PROCESS:
        raise ValueError(
            "polar-mitm gives slime every trained row of a sample (a subagent's, a compaction's), "
            "which slime's own reward normalization would group wrongly: add "
            f"--custom-reward-post-process-path {POST_PROCESS}, or set POLAR_MITM_ROWS=main to "
            "train on one row per sample"
        )
    return rows


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
    rows = _rows_setting(args)
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
    filled = [
        fill_group(g, by_id[tid], gi, rows) for gi, (tid, g) in enumerate(zip(ids, groups, strict=True))
    ]
    samples, metrics = hand_over(groups, filled, sum(len(by_id[t].samples) for t in ids), evaluation)
    try:
        from slime.rollout.base_types import RolloutFnEvalOutput, RolloutFnTrainOutput
    except ImportError:
        return samples
    if evaluation:
        rewards = [s.reward for g in groups for s in g if not s.remove_sample]
        return RolloutFnEvalOutput(data={"polar": {"rewards": rewards, "samples": samples}}, metrics=metrics)
    return RolloutFnTrainOutput(samples=samples, metrics=metrics)


def hand_over(
    groups: list[list[Any]], filled: list[list[list[Any]]], rows: int, evaluation: bool = False
) -> tuple[list[Any], dict[str, float]]:
    """What slime gets of the filled groups (`fill_group`'s, of `groups` whose samples had
    `rows` rows in all), and the rollout's metrics. Where a sample has several Samples (never
    for evaluation, scored per sample), a list per sample: slime flattens it, and counts the
    siblings of one `rollout_id` once in its loss."""
    nested = not evaluation and any(len(one) > 1 for g in filled for one in g)
    samples: list[Any] = filled if nested else groups  # groups: each sample's first row, in place
    if nested:
        for n, one in enumerate(one for g in filled for one in g):
            for t in one:
                t.rollout_id = n
    handed = sum(len(one) if nested else 1 for g in filled for one in g)
    rewards = [one[0].reward for g in filled for one in g if not one[0].remove_sample]
    return samples, {
        "polar/usable": len(rewards) / max(1, sum(len(g) for g in filled)),
        "polar/mean_reward": sum(rewards) / len(rewards) if rewards else 0.0,
        "polar/rows": handed,
        "polar/rows_dropped": rows - handed + _stand_ins(filled),
    }


def _stand_ins(filled: list[list[list[Any]]]) -> int:
    """How many of the filled Samples stand for a sample that had no row (nothing trained)."""
    return sum(1 for g in filled for one in g if one[0].response_length == 0 and not one[0].tokens)
