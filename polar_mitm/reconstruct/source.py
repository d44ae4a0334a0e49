"""Where reconstruction reads its turns: the store, filtered as the command line asks.

`read_selected` wraps `store.reader.read_turns` with the filters the store does not apply (side calls,
aborted turns) and counts what it leaves out. Everything else a selection needs (sessions in
order, how many turns, rewards, setting a reward) is asked of `polar_mitm.store.queries`: no SQL
lives here.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from polar_mitm import providers
from polar_mitm.neutral import ProviderError
from polar_mitm.recipes.side_calls import session_suspects
from polar_mitm.reconstruct.stats import ReconstructStats
from polar_mitm.store import queries
from polar_mitm.store.queries import set_reward
from polar_mitm.store.reader import read_turns
from polar_mitm.store.turn import Turn

__all__ = [
    "Selection",
    "count_turns",
    "parse_since",
    "read_selected",
    "session_ids",
    "set_reward",
    "tool_results",
]


@dataclass(frozen=True)
class Selection:
    """Which turns a command works on."""

    session: str | None = None
    task: str | None = None
    since: float | None = None  # unix seconds; turns created at or after
    include_side_calls: bool = False  # turns with a tag (title generation, routers, …)
    include_aborted: bool = False  # turns whose status is not 'ok' (aborted, error)
    rollout: str | None = None  # only the sessions (samples) of this rollout

    def keeps(self, turn: Turn) -> bool:
        return (self.include_side_calls or turn.tag is None) and (self.include_aborted or turn.status == "ok")


def parse_since(value: str) -> float:
    """Unix seconds, or an ISO 8601 date / date-time (local time unless it carries an offset)."""
    try:
        return float(value)
    except ValueError:
        pass
    try:
        return datetime.fromisoformat(value.strip()).timestamp()
    except ValueError:
        raise ValueError(
            f"{value!r} is neither unix seconds nor an ISO date/time (e.g. 2025-06-01 or 2025-06-01T14:30:00Z)"
        ) from None


def session_ids(path: str | Path, sel: Selection) -> list[str]:
    """Sessions with turns in the selection, in the order of their first turn."""
    return queries.session_ids(path, session=sel.session, task=sel.task, since=sel.since, rollout=sel.rollout)


def count_turns(path: str | Path, sel: Selection) -> int:
    """How many turns `read_selected` will read (before the side-call / status filters)."""
    return queries.count_turns(path, session=sel.session, task=sel.task, since=sel.since, rollout=sel.rollout)


def check_session(path: str | Path, session: str) -> None:
    """KeyError, naming the most recent sessions, if the store has no session `session`."""
    if not queries.has_session(path, session):
        raise queries.no_session(path, session)


def read_selected(
    path: str | Path,
    sel: Selection,
    *,
    session: str | None = None,
    stats: ReconstructStats | None = None,
    on_turn: Callable[[], object] | None = None,
    arrays: bool = False,
) -> Iterator[Turn]:
    """The selected turns in creation order (of one session if `session` is given); with
    `arrays`, their token ids and logprobs as numpy arrays (`read_turns`)."""
    for turn in read_turns(
        path,
        session=session or sel.session,
        task=sel.task,
        since=sel.since,
        rollout=sel.rollout,
        arrays=arrays,
    ):
        if on_turn is not None:
            on_turn()
        if stats is not None:
            stats.turns_read += 1
        if not sel.keeps(turn):
            if stats is not None:
                if turn.tag is not None and not sel.include_side_calls:
                    stats.side_calls_excluded += 1
                else:
                    stats.not_ok_excluded += 1
            continue
        if stats is not None:
            stats.turns += 1
            stats.sessions.add(turn.session_id)
            stats.per_request_tokens += len(turn.prompt_ids) + len(turn.output_ids)
            stats.sampled_tokens += len(turn.output_ids)
        yield turn


def tool_results(path: str | Path, turn_ids: list[str]) -> dict[str, set[str]]:
    """The tool call ids whose results each of these turns' requests carries (tool-result
    messages, parsed by the turn's style module); turns whose request carries none, or cannot be
    parsed, are left out. Asked only for the first turns of a session's later conversations
    (`structure`: a continuation carries the result of its conversation's last call)."""
    out: dict[str, set[str]] = {}
    for turn in queries.text_turns_by_id(path, turn_ids):
        module = providers.STYLES.get(turn.style)
        if module is None or not turn.request:
            continue
        try:
            req = module.parse_request(json.loads(turn.request), path=turn.path or "")
        except (ProviderError, ValueError, TypeError, KeyError):
            continue
        ids = {m.tool_call_id for m in req.messages if m.role == "tool" and m.tool_call_id}
        if ids:
            out[turn.id] = ids
    return out


def side_call_suspects(path: str | Path, sessions: Iterable[str]) -> dict[str, list[str]]:
    """Of the given sessions run under the generic recipe (whose rules know no harness), each
    one's untagged turns that look like side calls judged over the whole session once it ended
    (`side_calls.session_suspects`): turn id -> the signs. A session's first call may be its title,
    which the proxy, judging calls as they arrive, could not compare with main calls yet."""
    generic = queries.sessions_of_harness(path, "generic") & set(sessions)
    out: dict[str, list[str]] = {}
    for session in sorted(generic):
        ids, reqs = [], []
        for turn in queries.text_turns(path, session):
            module = providers.STYLES.get(turn.style)
            if module is None or not turn.request or turn.tag is not None:
                continue
            try:
                reqs.append(module.parse_request(json.loads(turn.request), path=turn.path or ""))
            except (ProviderError, ValueError, TypeError, KeyError):
                continue
            ids.append(turn.id)
        for i, signs in session_suspects(reqs):
            out[ids[i]] = signs
    return out
