"""The few HTML pieces every page is made of: escaping, the layout, tables, links, numbers.

Everything a page shows from the store was written by an untrusted harness (prompts, replies,
tool output, even session ids), so every value goes through `esc` or `attr`; markup is only ever
built here, in `pages` and in `token_pages`, never from stored text. The layout loads our one script and one
stylesheet from /static (the Content-Security-Policy the server sends allows nothing else).
"""

from __future__ import annotations

import html
import json
import time
from collections.abc import Iterable, Sequence
from typing import Any
from urllib.parse import quote, urlencode

NAV = (("/sessions", "Sessions"), ("/rollouts", "Rollouts"), ("/plots", "Plots"), ("/live", "Live"))


class Html(str):
    """Markup we built (already escaped); a plain `str` is text and gets escaped."""


def esc(value: Any) -> Html:
    if isinstance(value, Html):
        return value
    return Html(html.escape("" if value is None else str(value), quote=True))


def attr(value: Any) -> str:
    return html.escape("" if value is None else str(value), quote=True)


def join(parts: Iterable[Any], sep: str = "") -> Html:
    return Html(sep.join(esc(p) for p in parts))


VOID = frozenset({"input", "br", "meta", "link", "img"})


def tag(element: str, body: Any = "", /, **attrs: Any) -> Html:
    """<element attrs>body</element>; attribute names take `_` for `-` and a trailing `_` (class_)."""
    rendered = "".join(
        f' {k.rstrip("_").replace("_", "-")}="{attr(v)}"'
        for k, v in attrs.items()
        if v is not None and v is not False
    )
    if element in VOID:
        return Html(f"<{element}{rendered}>")
    return Html(f"<{element}{rendered}>{esc(body)}</{element}>")


def link(href: str, text: Any, /, **attrs: Any) -> Html:
    return tag("a", text, href=href, **attrs)


def path(*parts: str, **query: Any) -> str:
    """A viewer URL: each part quoted (ids are untrusted text), then the non-empty query values."""
    url = "/" + "/".join(quote(str(p), safe="") for p in parts)
    q = {k: v for k, v in query.items() if v is not None and v != "" and v is not False}
    return url + ("?" + urlencode(q) if q else "")


def table(
    headers: Sequence[Any], rows: Iterable[Sequence[Any]], *, class_: str = "grid", empty: str = "none"
) -> Html:
    head = join(tag("th", h) for h in headers)
    body = [tag("tr", join(tag("td", c) for c in row), class_=getattr(row, "css", None)) for row in rows]
    if not body:
        body = [tag("tr", tag("td", empty, colspan=len(headers), class_="empty"))]
    return tag("table", Html(tag("thead", tag("tr", head)) + join(body)), class_=class_)


class Row(list):
    """A table row with a CSS class (e.g. a group without signal)."""

    def __init__(self, cells: Iterable[Any], css: str | None = None):
        super().__init__(cells)
        self.css = css


def facts(pairs: Iterable[tuple[str, Any]]) -> Html:
    """A two-column list of what something is."""
    return tag("dl", join(Html(tag("dt", k) + tag("dd", v)) for k, v in pairs), class_="facts")


def when(ts: float | None) -> str:
    if ts is None:
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts))


def num(x: float | int | None, digits: int = 3) -> str:
    if x is None:
        return "-"
    if isinstance(x, int):
        return f"{x:,}"
    return f"{x:.{digits}g}"


def pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def json_block(data: Any) -> Html:
    """Data for our script, in a non-executed script element; `<` escaped so no text ends it."""
    text = json.dumps(data, separators=(",", ":")).replace("<", "\\u003c")
    return Html(f'<script type="application/json" id="data">{text}</script>')


def pretty(raw: str | None) -> str:
    """Stored JSON pretty-printed (or the text as it is)."""
    if raw is None:
        return ""
    try:
        return json.dumps(json.loads(raw), indent=2, ensure_ascii=False)
    except ValueError:
        return raw


def layout(title: str, body: Any, *, active: str = "", subtitle: Any = "", status: int = 200) -> Html:
    nav = join(link(href, text, class_="on" if href.lstrip("/") == active else None) for href, text in NAV)
    return Html(
        "<!doctype html><html lang=en><head><meta charset=utf-8>"
        f"<title>{esc(title)} · polar-mitm view</title>"
        '<meta name=viewport content="width=device-width, initial-scale=1">'
        '<link rel=stylesheet href="/static/view.css"><script src="/static/view.js" defer></script>'
        f"</head><body><header><a class=brand href=/sessions>polar-mitm view</a><nav>{nav}</nav></header>"
        f"<main><h1>{esc(title)}</h1>{esc(subtitle)}{esc(body)}</main></body></html>"
    )


def problem(title: str, message: str, hint: Any = "") -> Html:
    """The body of a page that explains what went wrong and what to do."""
    return Html(tag("div", Html(tag("p", message) + (tag("p", hint) if hint else "")), class_="problem"))
