"""A verl agent loop backed by the polar-mitm rollout service.

verl calls an agent loop once per sample (its GRPO groups come from rolling a prompt n times);
`PolarAgentLoop.run` submits a one-sample task to the service and returns verl's
`AgentLoopOutput` fields: `prompt_ids`, `response_ids`, `response_mask`, `response_logprobs`,
`reward_score`, `num_turns`, `metrics`, `extra_fields`. The task comes from the dataset row's
`extra_info["polar_task"]` (a Task dict or a path the service can read), else from its raw prompt.
Configure with `POLAR_MITM_SERVER`, `POLAR_MITM_HARNESS`, `POLAR_MITM_RUNTIME`.

With verl installed, register it in verl's agent-loop registry (`agent_name: polar`); without it,
`run` returns a plain object with the same fields, so the loop can be tried and tested anywhere.
A failed or cancelled sample comes back with an all-zero response_mask and reward 0, and
`extra_fields["polar_removed"] = True` (`polar_status`, `polar_weight_versions` beside it; without
verl they are in `metrics` too). Checked against verl 0.9.1's
`verl/experimental/agent_loop/agent_loop.py`: there `metrics` is an `AgentLoopMetrics` model
(timings), so our fields go in `extra_fields`, which verl carries through to the batch.

verl takes exactly one AgentLoopOutput per sample (its batch has one row per sample), so a sample
with several rows (a subagent, a compaction) gives verl the row `row` chooses (the main agent's by
default, `bridges.chosen_row`); `extra_fields` counts its rows (`polar_rows`) and those left out
(`polar_rows_dropped`).
"""

from __future__ import annotations

import functools
import os
import uuid
from dataclasses import dataclass, field
from typing import Any

from polar_mitm.bridges import check_row_choice, chosen_row
from polar_mitm.client import AsyncRolloutClient
from polar_mitm.outcomes import trainable
from polar_mitm.tasks.model import EvaluatorSpec, Task


@dataclass
class PolarLoopOutput:
    """verl's AgentLoopOutput fields, for use without verl installed."""

    prompt_ids: list[int]
    response_ids: list[int]
    response_mask: list[int]
    response_logprobs: list[float] | None = None
    multi_modal_data: dict[str, Any] = field(default_factory=dict)
    reward_score: float | None = None
    num_turns: int = 0
    metrics: dict[str, Any] = field(default_factory=dict)
    extra_fields: dict[str, Any] = field(default_factory=dict)


def _task(kwargs: dict[str, Any]) -> Task | str:
    extra = kwargs.get("extra_info") or {}
    given = extra.get("polar_task")
    if isinstance(given, str):
        return given
    if isinstance(given, dict):
        return Task.model_validate(given)
    raw = kwargs.get("raw_prompt")
    if isinstance(raw, list):  # chat messages: the last user message is the instruction
        raw = next(
            (m.get("content") for m in reversed(raw) if isinstance(m, dict) and m.get("role") == "user"), raw
        )
    evaluator = extra.get("polar_evaluator") or {"kind": "session_completed"}
    return Task(
        id=f"verl-{uuid.uuid4().hex[:12]}",
        instruction=str(raw),
        evaluator=EvaluatorSpec.model_validate(evaluator),
    )


class PolarAgentLoop:
    """The loop's logic; `agent_loop_class()` gives verl's subclass when verl is installed."""

    server = os.environ.get("POLAR_MITM_SERVER", "http://127.0.0.1:8700")
    token = os.environ.get("POLAR_MITM_SERVICE_TOKEN")
    harness = os.environ.get("POLAR_MITM_HARNESS", "claude-code")
    runtime = os.environ.get("POLAR_MITM_RUNTIME", "docker")
    poll = 1.0
    request: dict[str, Any] = {}  # more TaskRequest fields for every sample (priority, timeouts, …)
    row = os.environ.get("POLAR_MITM_ROW", "main")  # which row of a sample with several (ROW_CHOICES)

    async def run(self, sampling_params: dict[str, Any] | None = None, **kwargs: Any) -> Any:
        async with AsyncRolloutClient(self.server, token=self.token) as client:
            tid = await client.submit(
                _task(kwargs),
                samples=1,
                harness=self.harness,
                runtime=self.runtime,
                task_id=f"verl-{uuid.uuid4().hex}",
                **self.request,
            )
            group = [g async for g in client.wait([tid], poll=self.poll)][0]
        outcome = group.outcomes[0] if group.outcomes else None
        row = chosen_row(group.samples, check_row_choice(self.row))
        usable = (
            outcome is not None and trainable(outcome.status) and row is not None and not row.remove_sample
        )
        polar = {"polar_status": outcome.status if outcome else "cancelled", "polar_removed": not usable}
        out_cls = _output_class()
        # verl's `metrics` is its AgentLoopMetrics (timings): our fields ride in extra_fields.
        metrics: dict[str, Any] = dict(polar) if out_cls is PolarLoopOutput else {}
        extra = polar | {
            "polar_weight_versions": list(row.weight_versions) if row is not None else [],
            "polar_rows": len(group.samples),
            "polar_rows_dropped": max(0, len(group.samples) - 1),
        }
        if row is None:
            return out_cls(
                prompt_ids=[],
                response_ids=[],
                response_mask=[],
                response_logprobs=[],
                reward_score=0.0,
                num_turns=0,
                metrics=metrics,
                extra_fields=extra,
            )
        return out_cls(
            prompt_ids=row.prompt_ids,
            response_ids=row.response_ids,
            response_mask=row.loss_mask if usable else [0] * row.response_length,
            response_logprobs=row.rollout_logprobs,
            reward_score=(outcome.reward or 0.0) if usable and outcome else 0.0,
            num_turns=row.num_turns,
            metrics=metrics,
            extra_fields=extra,
        )


def _output_class() -> Any:
    try:
        from verl.experimental.agent_loop.agent_loop import AgentLoopOutput
    except ImportError:
        return PolarLoopOutput
    return AgentLoopOutput


@functools.cache
def agent_loop_class() -> type:
    """verl's registered subclass (`agent_name: polar`) when verl is installed, else PolarAgentLoop."""
    try:
        from verl.experimental.agent_loop.agent_loop import AgentLoopBase, register
    except ImportError:
        return PolarAgentLoop

    @register("polar")
    class VerlPolarAgentLoop(AgentLoopBase, PolarAgentLoop):  # type: ignore[misc, valid-type]
        async def run(self, sampling_params, **kwargs):  # type: ignore[override]
            return await PolarAgentLoop.run(self, sampling_params, **kwargs)

    return VerlPolarAgentLoop
