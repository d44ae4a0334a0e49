"""Rollout groups on export rows: which group and sample a row came from, its reward, its GRPO
advantage, and masking for samples that must not be trained.

Rules:
- A row's session is one sample attempt (`samples` table). The row gets `group_id`,
  `sample_index`, `status`, `reward` and `reward_detail` from it.
- Samples that are not trainable (`failed`, `cancelled`, `retried`) keep their rows, masked:
  `loss_mask` all 0, reward 0.0, `metadata.masked` = the cause. Nothing is silently dropped.
- `advantage` (with `--group-normalize`) is computed per group over its trainable samples (one
  reward per sample, whatever number of rows the sample produced):
  `std`: (r − mean) / std (0.0 when every reward is equal: no signal);
  `loo` (leave-one-out, RLOO): r − mean of the other samples' rewards (0.0 for a lone sample).
  Masked samples get 0.0; rows outside any rollout get null.

Pure: `advantages` works on plain numbers; `annotate` on one row.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping

import numpy as np

from polar_mitm.reconstruct.trajectory import Trajectory
from polar_mitm.store.rollouts import SampleInfo
from polar_mitm.strategies import Normalize, choices


def advantages[K](rewards: Mapping[K, float], mode: Normalize) -> dict[K, float]:
    """Key (sample) → advantage within one group."""
    keys = list(rewards)
    r = np.array([rewards[k] for k in keys], dtype=np.float64)
    n = len(r)
    if n == 0:
        return {}
    if mode == Normalize.STD:
        std = float(r.std())
        adv = (r - r.mean()) / std if std > 1e-12 else np.zeros(n)
    elif mode == Normalize.LOO:
        adv = r - (r.sum() - r) / (n - 1) if n > 1 else np.zeros(n)
    else:
        raise ValueError(f"unknown normalization {mode!r}; choose one of {', '.join(choices(Normalize))}")
    return {k: float(a) for k, a in zip(keys, adv, strict=True)}


def group_advantages(samples: Mapping[str, SampleInfo], mode: Normalize) -> dict[str, float]:
    """Session id → advantage for every sample of every group (0.0 for masked ones)."""
    by_group: dict[str, dict[str, float]] = {}
    for s in samples.values():
        if s.trainable:
            by_group.setdefault(s.group_id, {})[s.session_id] = s.reward or 0.0
    out = {sid: 0.0 for sid in samples}
    for rewards in by_group.values():
        out.update(advantages(rewards, mode))
    return out


def annotate(row: Trajectory, sample: SampleInfo | None, advantage: float | None) -> Trajectory:
    """Put a row's sample fields on it, masking it when its sample is not trainable."""
    if sample is None:
        return row
    row.group_id = sample.group_id
    row.sample_index = sample.sample_index
    row.status = sample.status
    row.reward_detail = sample.reward_detail
    row.advantage = advantage
    row.meta["rollout"] = sample.rollout_id
    row.meta["attempt"] = sample.attempt
    step = step_of_turns(sample.reward_detail, row.turn_ids)
    if step is not None:
        row.meta["step"] = step
    if sample.trainable:
        row.reward = sample.reward
    else:
        row.loss_mask = np.zeros_like(row.loss_mask)
        row.reward = 0.0
        row.meta["masked"] = sample.cause or sample.status
    return row


def step_of_turns(reward_detail: str | None, turn_ids: list[str]) -> str | None:
    """The step of a multi-step sample (its reward_detail's `steps`, each with its `turn_ids`:
    rollout/steps.py) whose harness made a row's first turn, or None: not a multi-step sample,
    or no turn of the row is a step's."""
    if not reward_detail or '"steps"' not in reward_detail:
        return None
    steps = _steps_of(reward_detail)
    return next((steps[t] for t in turn_ids if t in steps), None)


@functools.lru_cache(maxsize=64)  # every row of a sample reads the same detail
def _steps_of(reward_detail: str) -> dict[str, str]:
    try:
        steps = json.loads(reward_detail).get("steps")
    except (ValueError, AttributeError):
        return {}
    if not isinstance(steps, list):
        return {}
    return {t: s["name"] for s in steps if isinstance(s, dict) for t in s.get("turn_ids") or ()}
