"""Live progress of a rollout: how many samples are in each stage, passed and failed so far.

On a terminal a `rich` live line redraws in place; elsewhere (CI logs, pipes) a plain line is
printed whenever a sample finishes, and at most every few seconds otherwise.
"""

from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rich.live import Live

    from polar_mitm.rollout.pipeline import Pipeline

from polar_mitm.rollout.pipeline import STAGES


def summary_line(p: Pipeline) -> str:
    total = len(p.jobs)
    stages = " · ".join(f"{s} {p.counts.get(s, 0)}" for s in STAGES)
    o = p.outcomes
    tail = f"passed {o.get('passed', 0)} · not passed {o.get('not_passed', 0)}"
    bad = {k: o.get(k, 0) for k in ("agent_timeout", "failed", "cancelled") if o.get(k)}
    if bad:
        tail += " · " + " · ".join(f"{k.replace('_', ' ')} {v}" for k, v in bad.items())
    return f"{p.counts.get('done', 0)}/{total} done · {stages} · {tail}"


class Progress:
    def __init__(self, *, stream=None, interval: float = 5.0, live: bool | None = None):
        self.stream = stream or sys.stderr
        self.interval = interval
        self.live_mode = self.stream.isatty() if live is None else live
        self._live: Live | None = None
        self._last = 0.0
        self._done: object = None

    def __enter__(self) -> Progress:
        if self.live_mode:
            from rich.console import Console
            from rich.live import Live

            self._live = Live(
                "starting…", console=Console(file=self.stream), refresh_per_second=4, transient=False
            )
            self._live.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._live is not None:
            self._live.__exit__(*exc)

    def update(self, p: Pipeline) -> None:
        line = summary_line(p)
        if self._live is not None:
            self._live.update(line)
            return
        key = (p.counts.get("done", 0), tuple(sorted(p.outcomes.items())))
        now = time.monotonic()
        if key != self._done or now - self._last >= self.interval:
            self._done, self._last = key, now
            print(f"rollout {p.rollout_id}: {line}", file=self.stream, flush=True)
