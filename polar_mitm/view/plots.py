"""Plots as inline SVG, drawn on the server: nothing to load, nothing fetched.

Pure functions from numbers to markup; `pages.plots` picks the numbers (reward distribution per
task, turns per session, trainer-token ratio, seconds per stage).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from polar_mitm.view.html import Html, esc

W, H, PAD = 420, 170, 30


def histogram(values: Sequence[float], *, title: str, bins: int = 12, unit: str = "", lo: float | None = None,
              hi: float | None = None) -> Html:  # fmt: skip
    """Counts of `values` in equal bins between lo and hi (their min and max by default)."""
    if not values:
        return _frame(title, Html(f'<text x="{W / 2}" y="{H / 2}" class="none">no data</text>'), len(values))
    lo = min(values) if lo is None else lo
    hi = max(values) if hi is None else hi
    if hi <= lo:
        hi = lo + 1.0
    counts = [0] * bins
    for v in values:
        k = min(bins - 1, max(0, int((v - lo) / (hi - lo) * bins)))
        counts[k] += 1
    return bars(counts, title=title, labels=(_tick(lo, unit), _tick(hi, unit)), n=len(values))


def bars(counts: Sequence[int], *, title: str, labels: tuple[str, str] = ("", ""), n: int | None = None,
         names: Sequence[str] | None = None) -> Html:  # fmt: skip
    """One bar per count, scaled to the largest; `names` label each bar (else the two ends)."""
    top = max(counts) if counts else 0
    width = (W - 2 * PAD) / max(1, len(counts))
    parts = []
    for i, c in enumerate(counts):
        h = 0 if top == 0 else (H - 2 * PAD) * c / top
        x, y = PAD + i * width, H - PAD - h
        parts.append(
            f'<rect class="bar" x="{x + 1:.1f}" y="{y:.1f}" width="{max(1.0, width - 2):.1f}" height="{h:.1f}">'
            f"<title>{esc(names[i] if names else i)}: {c}</title></rect>"
        )
        if names:
            parts.append(
                f'<text class="tick" x="{x + width / 2:.1f}" y="{H - PAD + 12}">{esc(names[i])}</text>'
            )
    if not names:
        parts.append(f'<text class="tick" x="{PAD}" y="{H - PAD + 12}">{esc(labels[0])}</text>')
        parts.append(f'<text class="tick end" x="{W - PAD}" y="{H - PAD + 12}">{esc(labels[1])}</text>')
    parts.append(f'<text class="tick" x="4" y="{PAD}">{top}</text>')
    return _frame(title, Html("".join(parts)), sum(counts) if n is None else n)


def _tick(x: float, unit: str) -> str:
    return (f"{x:.3g}" if math.isfinite(x) else str(x)) + unit


def _frame(title: str, body: Html, n: int) -> Html:
    return Html(
        f'<figure class="plot"><svg viewBox="0 0 {W} {H}" width="{W}" height="{H}" role="img">'
        f'<line class="axis" x1="{PAD}" y1="{H - PAD}" x2="{W - PAD}" y2="{H - PAD}"/>{body}</svg>'
        f"<figcaption>{esc(title)} <span class=muted>(n={n})</span></figcaption></figure>"
    )
