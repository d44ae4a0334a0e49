"""The pages that show tokens, as pure functions: a trajectory (one row, the exact tokens a
trainer reads, paged, coloured by loss mask and shaded by the engine's logprob) at
/trajectory/ID (?strategy, ?page), and a turn (the request as the harness sent it, the rendered
prompt, what the engine sampled, the reply) at /turn/ID. `tokens` pages the ids; the other pages
are in `pages`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from polar_mitm.reconstruct.trajectory import Trajectory
from polar_mitm.store.queries import TurnFacts
from polar_mitm.strategies import Strategy
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
    pretty,
    table,
    tag,
    when,
)
from polar_mitm.view.tokens import TokenPage

# --- rows: how they are made --------------------------------------------------------------------


def nondefault(strategy: str) -> str | None:
    """`strategy` as a link's query names it: nothing for the default (prefix-merge)."""
    return None if strategy == Strategy.PREFIX_MERGE else strategy


def strategy_switch(base: tuple[str, ...], strategy: str) -> Html:
    """Links to the page at `base` with its rows made by prefix-merge or per request."""
    return tag(
        "p",
        join(
            [
                "rows: ",
                link(
                    path(*base),
                    Strategy.PREFIX_MERGE,
                    class_="on" if strategy == Strategy.PREFIX_MERGE else None,
                ),
                " · ",
                link(
                    path(*base, strategy=Strategy.PER_REQUEST),
                    Strategy.PER_REQUEST,
                    class_="on" if strategy == Strategy.PER_REQUEST else None,
                ),
            ]
        ),
        class_="switch",
    )


# --- a trajectory -------------------------------------------------------------------------------

KIND_CLASS = {"prompt": "p", "context": "c", "sampled": "s", "copy": "y"}


def token_spans(page: TokenPage) -> Html:
    """The page's tokens, one span each (`data-i`: its index on the page), with a mark where each
    turn's sampled tokens begin."""
    out: list[str] = []
    text = page.text
    for k, token_id in enumerate(page.ids):
        at = page.start + k
        if at in page.boundaries:
            span = page.spans[page.boundaries[at]]
            out.append(
                f'<a class="turn-mark" href="{path("turn", span.turn_id)}" data-turn="{span.index}">'
                f"turn {span.index + 1}</a>"
            )
        cls = "t " + KIND_CLASS[page.kind[k]]
        if page.trained[k]:
            cls += f" b{page.shade[k]}"
        piece = text[k] if text is not None else f"{token_id} "
        if not piece:
            cls += " e"
        out.append(f'<span class="{cls}" data-i="{k}">{esc(piece)}</span>')
    return Html("".join(out))


def _minimap(row: Trajectory, page: TokenPage, base: tuple[str, ...], query: dict[str, Any]) -> Html:
    """One cell per page: how much of it is trained; the current page marked."""
    size = page.size
    mask = row.loss_mask
    cut = len(row.prompt_ids)
    cells = []
    for p in range(page.pages):
        lo, hi = p * size, min(row.num_tokens, (p + 1) * size)
        trained = int(mask[max(0, lo - cut) : max(0, hi - cut)].sum()) if hi > cut else 0
        level = min(4, (5 * trained) // max(1, hi - lo))
        cells.append(
            link(
                path(*base, **query, page=p),
                "",
                class_=f"cell l{level}" + (" on" if p == page.number else ""),
                title=f"page {p + 1}: tokens {lo:,}–{hi:,}, {trained:,} trained",
            )
        )
    return tag("div", join(cells), class_="minimap")


def trajectory(
    row: Trajectory,
    page: TokenPage,
    *,
    strategy: str,
    related: Sequence[Trajectory],
    tokenizer_note: str | None,
    query: dict[str, Any],
    break_tokens: Sequence[tuple[str, str]] = (),
) -> Html:
    base = ("trajectory", row.trajectory_id)
    note = tag("p", tokenizer_note, class_="warn") if tokenizer_note else ""
    nav = _pager(page, base, query)
    body = Html(
        _trajectory_facts(row, strategy, related)
        + _breaks(row, page, base, query, break_tokens)
        + strategy_switch(base, strategy)
        + _minimap(row, page, base, query)
        + LEGEND
        + note
        + nav
        + tag("div", token_spans(page), id="tokens", class_="tokens", data_start=page.start)
        + tag("div", "", id="tip", class_="tip", hidden=True)
        + nav
        + json_block(_page_data(page))
    )
    return layout(f"Trajectory {row.trajectory_id}", body, active="sessions")


def _trajectory_facts(row: Trajectory, strategy: str, related: Sequence[Trajectory]) -> Html:
    """The row's session, task, role, parent and children, sizes, reward and weight versions."""
    meta = row.meta
    parent = (
        link(path("trajectory", row.parent_id, strategy=nondefault(strategy)), row.parent_id)
        if row.parent_id
        else "-"
    )
    children = [r for r in related if r.parent_id == row.trajectory_id]
    return facts(
        [
            ("session", link(path("session", row.session_id), row.session_id)),
            ("task", row.task_id or "-"),
            ("role", tag("span", row.role, class_=f"role {row.role}")),
            ("parent", parent),
            (
                "children",
                join(
                    (
                        link(
                            path("trajectory", c.trajectory_id, strategy=nondefault(strategy)),
                            f"{c.role} {c.trajectory_id}",
                        )
                        for c in children
                    ),
                    ", ",
                )
                or "-",
            ),
            ("strategy", strategy),
            ("turns", row.num_turns),
            (
                "tokens",
                Html(
                    f"{row.num_tokens:,} (prompt {len(row.prompt_ids):,}, trained "
                    + tag("span", f"{row.num_trained}", id="trained-count", data_trained=row.num_trained)
                    + ")"
                ),
            ),
            ("finish", row.finish_reason),
            ("reward", "-" if row.reward is None else f"{row.reward:g}"),
            ("weight versions", ", ".join(meta.get("weight_versions") or []) or "-"),
            ("branched from", meta.get("branched_from") or "-"),
        ]
        + (
            [
                (
                    "rollout sample",
                    f"{row.group_id} #{row.sample_index} · {row.status} · advantage {num(row.advantage)}",
                )
            ]
            if row.group_id
            else []
        )
    )


def _breaks(
    row: Trajectory,
    page: TokenPage,
    base: tuple[str, ...],
    query: dict[str, Any],
    break_tokens: Sequence[tuple[str, str]],
) -> Html:
    """Where the row's turns stopped extending the sequence before them (prefix-merge's breaks),
    each linked to its first differing token (`break_tokens`: that token here and there, as
    text); nothing where there is none."""
    breaks = row.meta.get("breaks") or []
    if not breaks:
        return Html("")
    rows = []
    for i, b in enumerate(breaks):
        k = b.get("common_prefix", 0)
        mine, theirs = break_tokens[i] if i < len(break_tokens) else ("?", "?")
        rows.append(
            Row(
                [
                    tag("span", b.get("class"), class_=f"break {b.get('class')}"),
                    b.get("at"),
                    link(path("turn", b.get("turn_id", "")), b.get("turn_id")),
                    link(path("turn", b.get("vs_turn", "")), b.get("vs_turn")),
                    link(path(*base, **query, page=k // page.size) + f"#tok{k}", f"token {k:,}"),
                    tag("code", mine),
                    tag("code", theirs),
                    "yes" if b.get("in_sampled") else "no",
                ]
            )
        )
    columns = [
        "class",
        "at",
        "turn",
        "diverges from",
        "first differing token",
        "here",
        "there",
        "inside sampled",
    ]
    return Html(tag("h2", "Breaks") + table(columns, rows, class_="grid breaks"))


LEGEND = tag(
    "p",
    Html(
        tag("span", "prompt", class_="t p")
        + " "
        + tag("span", "context (tool results, user, template)", class_="t c")
        + " "
        + tag("span", "trained (shade: probability)", class_="t s b6")
        + " "
        + tag("span", "sampled, trained in another row", class_="t y")
    ),
    class_="legend",
)


def _pager(page: TokenPage, base: tuple[str, ...], query: dict[str, Any]) -> Html:
    """Previous and next page links around where this page is in the row."""
    nav = []
    if page.number > 0:
        nav.append(link(path(*base, **query, page=page.number - 1), "← previous page", rel="prev"))
    nav.append(
        tag(
            "span",
            f"page {page.number + 1} of {page.pages} · tokens {page.start:,}–{page.start + len(page.ids):,}",
        )
    )
    if page.number + 1 < page.pages:
        nav.append(link(path(*base, **query, page=page.number + 1), "next page →", rel="next"))
    return tag("p", join(nav, " "), class_="pager")


# --- a turn -------------------------------------------------------------------------------------


def turn(
    facts_: TurnFacts,
    *,
    request: str | None,
    response: str | None,
    reply: tuple[str, str],
    prompt_text: str,
    output: TokenPage | None,
    tokenizer_note: str | None,
) -> Html:
    t = facts_
    head = facts(
        [
            ("session", link(path("session", t.session_id), t.session_id)),
            ("style", t.style),
            ("endpoint", f"{t.host or ''}{t.path or ''}" or "-"),
            ("model", t.model or "-"),
            ("tag", t.tag or "-"),
            ("status", t.status),
            ("finish", t.finish_reason or "-"),
            ("weight version", t.weight_version or "-"),
            ("created", when(t.created_at)),
            ("latency", "-" if t.latency_ms is None else f"{t.latency_ms:.1f} ms"),
            ("tokens", f"prompt {t.prompt_len:,} · sampled {t.output_len:,}"),
            ("error", t.error or "-"),
            ("row", link(path("trajectory", t.id), "the row holding this turn")),
        ]
    )
    summary = _request_summary(request)
    note = tag("p", tokenizer_note, class_="warn") if tokenizer_note else ""
    body = Html(
        head
        + tag("h2", "Request as the harness sent it")
        + summary
        + tag(
            "details", Html(tag("summary", "raw request (credentials removed)") + tag("pre", pretty(request)))
        )
        + tag("details", Html(tag("summary", "request headers") + tag("pre", pretty(t.request_headers))))
        + tag("h2", "Rendered prompt")
        + note
        + tag(
            "details",
            Html(tag("summary", f"{t.prompt_len:,} tokens") + tag("pre", prompt_text, class_="prompt")),
        )
        + tag("h2", "What the engine sampled")
        + (tag("div", token_spans(output), id="tokens", class_="tokens") if output else tag("p", "nothing"))
        + tag("div", "", id="tip", class_="tip", hidden=True)
        + (json_block(_page_data(output)) if output else "")
        + tag("h2", "Reply the harness received")
        + tag("p", reply[0], class_="muted", id="reply-kind")
        + tag("pre", reply[1], id="reply")
        + tag(
            "details",
            Html(tag("summary", "the completion as recorded (neutral JSON)") + tag("pre", pretty(response))),
        )
    )
    return layout(f"Turn {t.id}", body, active="sessions")


def _page_data(page: TokenPage) -> dict[str, Any]:
    return {
        "start": page.start,
        "ids": page.ids,
        "lp": page.logprobs,
        "trained": [int(x) for x in page.trained],
        "turn": page.turn,
        "turns": [
            {"id": s.turn_id, "wv": s.weight_version, "tag": s.tag, "n": s.index + 1} for s in page.spans
        ],
        "text": page.text is not None,
    }


def _request_summary(request: str | None) -> Html:
    """Messages (role and the start of their text) and tool names of a native request."""
    try:
        body = json.loads(request or "")
    except ValueError:
        return tag("p", "no request stored" if request is None else "the request is not JSON")
    if not isinstance(body, dict):
        return Html("")
    messages = body.get("messages") or body.get("input") or body.get("contents") or []
    rows = []
    if isinstance(body.get("system"), (str, list)):
        rows.append(Row(["system", _short(body["system"])]))
    if isinstance(body.get("instructions"), str):
        rows.append(Row(["instructions", _short(body["instructions"])]))
    if isinstance(messages, list):
        for m in messages:
            if isinstance(m, dict):
                role = m.get("role") or m.get("type") or "?"
                content = m.get("content", m.get("parts", m.get("output", "")))
                rows.append(Row([role, _short(content)]))
    tools = body.get("tools") or []
    names = []
    if isinstance(tools, list):
        for tl in tools:
            if isinstance(tl, dict):
                names.append(
                    tl.get("name") or (tl.get("function") or {}).get("name") or tl.get("type") or "?"
                )
    return Html(
        table(["role", "content"], rows, class_="grid messages", empty="no messages")
        + tag("p", f"tools ({len(names)}): " + (", ".join(str(n) for n in names) or "none"), class_="muted")
    )


def _short(content: Any, limit: int = 400) -> str:
    text = content if isinstance(content, str) else json.dumps(content, ensure_ascii=False)
    return text if len(text) <= limit else text[:limit] + f" … ({len(text):,} characters)"
