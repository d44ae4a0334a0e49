"""The viewer's pages, as pure functions from what the store (or the service) says to HTML.

`server` reads the data and picks the page; nothing here does I/O. Each page is a stable URL:
/sessions, /session/ID, /rollouts, /group/ID, /plots and /live; the pages that show tokens,
/trajectory/ID and /turn/ID, are `token_pages`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from polar_mitm.reconstruct.report import STAGE_COLUMNS, TaskReport
from polar_mitm.reconstruct.trajectory import Trajectory
from polar_mitm.store.queries import SessionListing, ToolParseRate, TurnFacts
from polar_mitm.store.rollouts import SampleInfo
from polar_mitm.view import plots
from polar_mitm.view.html import (
    Html,
    Row,
    esc,
    facts,
    join,
    json_block,
    layout,
    link,
    num,
    path,
    pct,
    pretty,
    problem,
    table,
    tag,
    when,
)
from polar_mitm.view.token_pages import nondefault, strategy_switch

PAGE_SESSIONS = 200
STATUSES = ("ok", "failed", "running", "completed", "agent_timeout", "cancelled", "retried")


# --- sessions -----------------------------------------------------------------------------------


def sessions(
    listings: Sequence[SessionListing],
    *,
    facets: dict[str, list[str]],
    filters: dict[str, str],
    offset: int,
    more: bool,
    db: str,
    tool_parse: Sequence[ToolParseRate] = (),
) -> Html:
    rows = [
        Row(
            [
                link(path("session", s.id), s.id),
                s.task_id or "-",
                s.harness or "-",
                when(s.created_at),
                num(s.turns),
                num(s.prompt_tokens + s.output_tokens),
                num(s.output_tokens),
                "-" if s.reward is None else f"{s.reward:g}",
                tag("span", s.status, class_=f"status {s.status}"),
            ]
        )
        for s in listings
    ]
    headers = ["session", "task", "harness", "created", "turns", "tokens", "sampled", "reward", "status"]
    pager = []
    q = {k: v for k, v in filters.items() if v}
    if offset:
        pager.append(
            link(path("sessions", **q, offset=max(0, offset - len(listings) or 0) or None), "← newer")
        )
    if more:
        pager.append(link(path("sessions", **q, offset=offset + len(listings)), "older →"))
    body = Html(
        _session_filters(facets, filters)
        + tag("p", f"store {db} · {len(listings)} sessions shown", class_="muted")
        + table(headers, rows, class_="grid sessions", empty="no session matches")
        + tag("p", join(pager, " "), class_="pager")
        + tool_parse_rates(tool_parse)
    )
    return layout("Sessions", body, active="sessions")


def _session_filters(facets: dict[str, list[str]], filters: dict[str, str]) -> Html:
    """The sessions page's filter form (id search, task, harness, status, since)."""

    def select(name: str, options: Sequence[str]) -> Html:
        opts = [tag("option", "any", value="")] + [
            tag("option", o, value=o, selected=filters.get(name) == o) for o in options
        ]
        return tag("label", Html(esc(name) + tag("select", join(opts), name=name)))

    def text(label: str, name: str, placeholder: str) -> Html:
        field = tag("input", "", name=name, value=filters.get(name, ""), placeholder=placeholder)
        return tag("label", Html(label + " " + field))

    return tag(
        "form",
        join(
            [
                text("id", "q", "search"),
                select("task", facets["task"]),
                select("harness", facets["harness"]),
                select("status", STATUSES),
                text("since", "since", "2025-06-01"),
                tag("button", "filter", type="submit"),
            ]
        ),
        method="get",
        action="/sessions",
        class_="filters",
    )


def tool_parse_rates(rates: Sequence[ToolParseRate]) -> Html:
    """How the proxy's tool parser fared, per harness and parser (what `stats` says): turns it
    read, turns with a call that failed to parse, and the failures by kind. Nothing when no
    turn was read by a tool parser."""
    if not rates:
        return Html("")
    rows = [
        Row(
            [
                r.harness or "-",
                r.parser,
                num(r.turns),
                num(r.failed_turns),
                f"{r.failed_turns / r.turns:.1%}" if r.turns else "-",
                ", ".join(f"{k} {v}" for k, v in sorted(r.failures.items())) or "-",
            ]
        )
        for r in rates
    ]
    headers = ["harness", "tool parser", "turns", "failed", "failure rate", "failures by kind"]
    return Html(tag("h2", "Tool-call parse") + table(headers, rows, class_="grid tool-parse"))


# --- one session --------------------------------------------------------------------------------


def _rows_tree(rows: Sequence[Trajectory], strategy: str, query: dict[str, Any]) -> Html:
    """The session's rows as a tree: each row under the row it came from (`parent_id`)."""
    ids = {r.trajectory_id for r in rows}
    children: dict[str | None, list[Trajectory]] = {}
    for r in rows:
        parent = r.parent_id if r.parent_id in ids else None
        children.setdefault(parent, []).append(r)

    def item(r: Trajectory) -> Html:
        label = link(
            path("trajectory", r.trajectory_id, strategy=nondefault(strategy), **query), r.trajectory_id
        )
        line = Html(
            tag("span", r.role, class_=f"role {r.role}")
            + " "
            + label
            + tag(
                "span",
                f" {r.num_turns} turns · {r.num_tokens:,} tokens · {r.num_trained:,} trained · "
                f"reward {'-' if r.reward is None else f'{r.reward:g}'} · {r.finish_reason}",
                class_="muted",
            )
        )
        kids = children.get(r.trajectory_id, [])
        sub = tag("ul", join(item(k) for k in kids)) if kids else ""
        return tag("li", Html(line + sub))

    return tag("ul", join(item(r) for r in children.get(None, [])), class_="tree")


def session(
    record: dict[str, Any],
    rows: Sequence[Trajectory],
    turns: Sequence[TurnFacts],
    *,
    strategy: str,
    query: dict[str, Any],
) -> Html:
    command = record.get("command")
    try:
        command = " ".join(json.loads(command)) if command else "-"
    except (ValueError, TypeError):
        pass
    head = facts(
        [
            ("task", record.get("task_id") or "-"),
            ("harness", record.get("harness") or "-"),
            ("mode", record.get("mode")),
            ("command", tag("code", command)),
            ("created", when(record.get("created_at"))),
            ("ended", when(record.get("ended_at"))),
            ("exit code", "-" if record.get("exit_code") is None else record["exit_code"]),
            ("reward", "-" if record.get("reward") is None else record["reward"]),
            ("metadata", tag("code", record.get("metadata") or "{}")),
        ]
    )
    turn_rows = [
        Row(
            [
                link(path("turn", t.id), t.id),
                t.style,
                t.tag or "",
                t.status,
                t.finish_reason or "-",
                num(t.prompt_len),
                num(t.output_len),
                t.weight_version or "-",
                "-" if t.latency_ms is None else f"{t.latency_ms:.0f} ms",
            ],
            css="side" if t.tag else None,
        )
        for t in turns
    ]
    body = Html(
        head
        + tag("h2", "Rows")
        + strategy_switch(("session", record["id"]), strategy)
        + _selection_switch(("session", record["id"]), strategy, query)
        + (
            _rows_tree(rows, strategy, query)
            if rows
            else tag("p", "no rows (side calls and aborted turns are left out, as export does)")
        )
        + tag("h2", "Turns")
        + table(
            ["turn", "style", "tag", "status", "finish", "prompt", "sampled", "weights", "latency"], turn_rows
        )
    )
    return layout(f"Session {record['id']}", body, active="sessions")


def _selection_switch(base: tuple[str, ...], strategy: str, query: dict[str, Any]) -> Html:
    """Links that add or drop side calls and aborted turns (export leaves both out by default)."""
    side, aborted = bool(query.get("side")), bool(query.get("aborted"))
    s = nondefault(strategy)
    toggle_side = path(*base, strategy=s, side=None if side else "1", aborted=query.get("aborted"))
    toggle_aborted = path(*base, strategy=s, side=query.get("side"), aborted=None if aborted else "1")
    return tag(
        "p",
        join(
            [
                "side calls " + ("included " if side else "left out, as export does "),
                link(toggle_side, "drop them" if side else "include them"),
                " · aborted turns " + ("included " if aborted else "left out, as export does "),
                link(toggle_aborted, "drop them" if aborted else "include them"),
            ]
        ),
        class_="switch muted",
    )


# --- rollouts and groups ------------------------------------------------------------------------


def _report_rows(reports: Sequence[TaskReport]) -> list[Row]:
    return [
        Row(
            [
                r.task_id,
                r.samples,
                r.usable,
                num(r.mean_reward),
                pct(r.pass_at_1),
                f"{pct(r.pass_at_k)} (k={r.k})",
                f"{r.groups_all_equal}/{r.groups}",
                ", ".join(f"{k} {v}" for k, v in sorted(r.failures.items())) or "-",
                *[num(r.stage_mean(s)) for s in STAGE_COLUMNS],
            ],
            css="nosignal" if r.groups and r.groups_all_equal == r.groups else None,
        )
        for r in reports
    ]


REPORT_HEADERS = ["task", "samples", "usable", "mean reward", "pass@1", "pass@k", "no signal", "failures"] + [
    f"{s} s" for s in STAGE_COLUMNS
]


def rollouts(by_rollout: dict[str, tuple[list[TaskReport], dict[str, list[SampleInfo]]]]) -> Html:
    if not by_rollout:
        return layout(
            "Rollouts",
            tag("p", "no rollout in this store (see `polar-mitm rollout` and `serve`)"),
            active="rollouts",
        )
    parts = []
    for rid, (reports, groups) in by_rollout.items():
        group_rows = []
        for gid, members in groups.items():
            final = [s for s in members if s.status != "retried"]
            rewards = [s.reward or 0.0 for s in final if s.trainable]
            flat = len(rewards) > 1 and len(set(rewards)) == 1
            group_rows.append(
                Row(
                    [
                        link(path("group", gid), gid),
                        members[0].task_id,
                        len(final),
                        " ".join("-" if s.reward is None else f"{s.reward:g}" for s in final),
                        "no signal" if flat else "",
                    ],
                    css="nosignal" if flat else None,
                )
            )
        parts.append(
            Html(
                tag("h2", f"Rollout {rid}", id=f"rollout-{rid}")
                + table(REPORT_HEADERS, _report_rows(reports))
                + table(["group", "task", "samples", "rewards", ""], group_rows, class_="grid groups")
            )
        )
    return layout("Rollouts", join(parts), active="rollouts")


def group(
    gid: str, members: Sequence[SampleInfo], advantage: dict[str, float], report: TaskReport | None
) -> Html:
    final = [s for s in members if s.status != "retried"]
    rewards = [s.reward or 0.0 for s in final if s.trainable]
    flat = len(rewards) > 1 and len(set(rewards)) == 1
    cards = []
    for s in members:
        detail = _detail(s.reward_detail)
        timings = json.loads(s.timings or "{}")
        cards.append(
            tag(
                "section",
                Html(
                    tag(
                        "h3",
                        Html(f"sample {s.sample_index}" + (f" · attempt {s.attempt}" if s.attempt else "")),
                    )
                    + facts(
                        [
                            ("status", tag("span", s.status, class_=f"status {s.status}")),
                            (
                                "reward",
                                tag("span", "-" if s.reward is None else f"{s.reward:g}", class_="reward"),
                            ),
                            ("advantage", num(advantage.get(s.session_id))),
                            ("cause", s.cause or "-"),
                            ("session", link(path("session", s.session_id), s.session_id)),
                            ("stages", ", ".join(f"{k} {v:.2f}s" for k, v in timings.items()) or "-"),
                        ]
                    )
                    + detail
                ),
                class_=f"sample {s.status}",
                data_status=s.status,
                data_reward="" if s.reward is None else s.reward,
            )
        )
    head = Html(
        (
            tag(
                "p",
                "no signal: every usable sample got the same reward, so GRPO learns nothing from this group",
                class_="warn",
            )
            if flat
            else ""
        )
        + (table(REPORT_HEADERS, _report_rows([report])) if report else "")
    )
    task = members[0].task_id if members else "?"
    return layout(
        f"Group {gid}",
        Html(head + tag("div", join(cards), class_="samples")),
        subtitle=tag("p", f"task {task}", class_="muted"),
        active="rollouts",
    )


def _detail(raw: str | None) -> Html:
    """The verifier's detail: tests passed / failed when it says, the output tail, the rest as JSON."""
    if not raw:
        return Html("")
    try:
        d = json.loads(raw)
    except ValueError:
        return tag("pre", raw)
    if not isinstance(d, dict):
        return tag("pre", pretty(raw))
    pairs = []
    for key in ("passed", "failed", "tests_passed", "tests_failed", "exit_code", "kind", "where"):
        if key in d and not isinstance(d[key], (dict, list)):
            pairs.append((key, d[key]))
    tail = next((d[k] for k in ("output_tail", "output", "stdout", "log") if isinstance(d.get(k), str)), None)
    return Html(
        (facts(pairs) if pairs else "")
        + (tag("pre", tail[-2000:], class_="tail") if tail else "")
        + tag("details", Html(tag("summary", "reward_detail") + tag("pre", pretty(raw))))
    )


# --- plots --------------------------------------------------------------------------------------


def plots_page(
    rewards_by_task: dict[str, list[float]],
    turns_per_session: list[int],
    ratios: list[float],
    stage_seconds: dict[str, list[float]],
    *,
    ratio_sessions: int,
) -> Html:
    figs = [plots.histogram([float(t) for t in turns_per_session], title="turns per session", bins=15)]
    figs.append(
        plots.histogram(
            ratios,
            title=f"trainer-token ratio per session (per-request ÷ prefix-merge tokens; last {ratio_sessions} sessions)",
            bins=12,
        )
    )
    for task, rewards in sorted(rewards_by_task.items()):
        figs.append(
            plots.histogram(
                rewards,
                title=f"reward distribution · {task}",
                bins=10,
                lo=0.0,
                hi=max(1.0, max(rewards or [1.0])),
            )
        )
    for stage, secs in stage_seconds.items():
        figs.append(plots.histogram(secs, title=f"seconds in stage {stage}", bins=12, unit="s"))
    return layout("Plots", tag("div", join(figs), class_="plots"), active="plots")


# --- live ---------------------------------------------------------------------------------------


def live(server: str | None, snapshot: dict[str, Any] | None, error: str | None) -> Html:
    if server is None:
        return layout(
            "Live",
            problem(
                "Live",
                "no rollout service to watch",
                Html(
                    "start the viewer with "
                    + tag("code", "--server URL")
                    + " (the URL of `polar-mitm serve`)."
                ),
            ),
            active="live",
        )
    if error:
        return layout(
            "Live",
            problem(
                "Live",
                f"the service at {server} did not answer: {error}",
                "is `polar-mitm serve` running there, and is POLAR_MITM_SERVICE_TOKEN set?",
            ),
            active="live",
        )
    snap = snapshot or {}
    body = Html(
        tag(
            "p",
            Html(f"service {esc(server)} · " + tag("span", "connecting…", id="live-state")),
            class_="muted",
        )
        + tag("div", "", id="weights", class_="weights")
        + tag("h2", "Nodes")
        + tag("div", "", id="nodes")
        + tag("h2", "Tasks")
        + tag("div", "", id="tasks")
        + tag("h2", "Events")
        + tag("ol", "", id="events", class_="events")
        + json_block(snap)
    )
    return layout("Live", body, active="live")
