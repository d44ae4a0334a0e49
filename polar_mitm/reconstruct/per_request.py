"""The per-request strategy: one row per generation, exactly as the engine saw it.

`prompt_ids` is what the engine received, `response_ids` what it sampled (the stop token
included), `loss_mask` is all 1 and `response_logprobs` are the engine's. Nothing is merged, so
a session of n turns costs its context n times over; `prefix_merge` is the compact alternative.

Each row's `role` and `parent_id` come from the same pass as prefix-merge's
(`SessionMerger.turn_links`, `structure.link`): a turn's role is its conversation's, and its
parent is the turn it came from (a subagent's spawning turn, a compaction's summarized turn),
which is a row of its own here. So the turns of a session are held until its last one is read;
feed one session at a time (what `export.iter_trajectories` does).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import numpy as np

from polar_mitm.reconstruct.prefix_merge import SessionMerger, ToolCallsOf, ToolResultsOf, shifted_span
from polar_mitm.reconstruct.stats import ReconstructStats
from polar_mitm.reconstruct.structure import Link
from polar_mitm.reconstruct.trajectory import (
    LOGPROB_DTYPE,
    MASK_DTYPE,
    TOOL_PARSE_POLICIES,
    Trajectory,
    finish_reason_of,
    output_arrays,
    token_array,
)
from polar_mitm.reconstruct.trajectory import tool_parse_failures as tool_parse_failures_of
from polar_mitm.store.turn import Turn
from polar_mitm.strategies import Strategy

STRATEGY = Strategy.PER_REQUEST.value


def per_request(
    turns: Iterable[Turn],
    *,
    rewards: Mapping[str, float | None] | None = None,
    stats: ReconstructStats | None = None,
    tool_calls: ToolCallsOf | None = None,
    tool_results: ToolResultsOf | None = None,
    tool_parse_failures: str = "keep",
) -> Iterator[Trajectory]:
    """One `Trajectory` per turn, in the order given. `rewards` maps session id → reward;
    `tool_calls` and `tool_results` are the store's evidence for the structure (as for
    `prefix_merge`; without them no subagent or continuation is recognized). A turn whose tool
    calls did not all parse has its failures in the metadata, and with `tool_parse_failures`
    "mask" its sampled tokens untrained (`TOOL_PARSE_POLICIES`; "zero" is the export's).

    A turn's ids and logprobs may be lists or numpy arrays (`read_turns(arrays=True)`, which the
    export uses: no Python int per token); the rows hold the same values either way."""
    if tool_parse_failures not in TOOL_PARSE_POLICIES:
        raise ValueError(
            f"unknown tool-parse policy {tool_parse_failures!r}; choose one of {', '.join(TOOL_PARSE_POLICIES)}"
        )
    rewards = rewards or {}
    turns = list(turns)
    links = turn_links(turns, tool_calls=tool_calls, tool_results=tool_results, stats=stats)
    for turn in turns:
        output, logprobs, fits = output_arrays(turn.output_ids, turn.output_logprobs)
        if stats is not None and not fits:
            stats.mismatches["logprob_length"] += 1
        meta: dict[str, Any] = {
            "strategy": STRATEGY,
            "seq": turn.seq,
            "created_at": turn.created_at,
            "weight_versions": [turn.weight_version] if turn.weight_version else [],
            "models": [turn.model] if turn.model else [],
            "styles": [turn.style],
            "tags": [turn.tag] if turn.tag else [],
            "status": turn.status,
            "prompt_ref": turn.prompt_ref,
            "prompt_ref_len": turn.prompt_ref_len,
        }
        # A tagged turn is a side call whatever conversation its prompt extends (the recipe says so).
        found = Link("side") if turn.tag else links[turn.id]
        meta.update(found.meta())
        mask = np.ones(len(output), dtype=MASK_DTYPE)
        parsed, failures = tool_parse_failures_of(turn.tool_parse)
        if failures:
            at = len(turn.prompt_ids)
            meta["tool_parse_failures"] = [
                {"turn_id": turn.id, **f, "row_span": shifted_span(f.get("span"), at)} for f in failures
            ]
            if tool_parse_failures == "mask":
                mask[:] = 0
                logprobs = np.zeros(len(output), dtype=LOGPROB_DTYPE)
        yield Trajectory(
            trajectory_id=turn.id,
            session_id=turn.session_id,
            task_id=turn.task_id,
            prompt_ids=token_array(turn.prompt_ids),
            response_ids=output,
            loss_mask=mask,
            response_logprobs=logprobs,
            turn_ids=[turn.id],
            finish_reason=finish_reason_of(turn.finish_reason, turn.status),
            reward=rewards.get(turn.session_id),
            meta=meta,
            role=found.role,
            parent_id=found.parent_turn,
            tool_parse=(failures[0].get("kind") if failures else "ok") if parsed else None,
        )


def turn_links(
    turns: list[Turn],
    *,
    tool_calls: ToolCallsOf | None = None,
    tool_results: ToolResultsOf | None = None,
    stats: ReconstructStats | None = None,
) -> dict[str, Link]:
    """Every turn's role and origin, by turn id, session by session (the prefix tree is built
    to find the conversations; its own counters are not this export's and are left out)."""
    sessions: dict[str, SessionMerger] = {}
    for turn in turns:
        merger = sessions.get(turn.session_id)
        if merger is None:
            merger = sessions[turn.session_id] = SessionMerger(
                turn.session_id, stats=ReconstructStats(), tool_calls=tool_calls, tool_results=tool_results
            )
        merger.add(turn)
    links: dict[str, Link] = {}
    for merger in sessions.values():
        links.update(merger.turn_links(stats=stats if stats is not None else ReconstructStats()))
    return links
