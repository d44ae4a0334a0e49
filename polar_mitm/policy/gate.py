"""The weight-sync gate: while a trainer updates the engine's weights no new generation starts.

Turns that arrive meanwhile start for the harness and keep it alive with pings until the gate
opens; `generating` counts the generations under way, so a pause can drain them."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator

from polar_mitm.neutral import Event, Ping, Started


class WeightGate:
    """Open unless paused; counts the generations under way."""

    def __init__(self, ping_interval: float):
        self.ping_interval = ping_interval
        self.event = asyncio.Event()  # set: open
        self.event.set()
        self.generating = 0
        self.waiting = 0  # turns held at the closed gate now

    def pause(self) -> None:
        """Start no new generation until `resume` (those under way finish)."""
        self.event.clear()

    def resume(self) -> None:
        self.event.set()

    @contextlib.contextmanager
    def generation(self) -> Iterator[None]:
        """One generation under way (what a pause drains) for as long as the block runs."""
        self.generating += 1
        try:
            yield
        finally:
            self.generating -= 1

    async def through(self, turn_id: str, prompt_tokens: int) -> AsyncIterator[Event]:
        """While paused: the turn starts for the harness and keeps it alive with pings."""
        if self.event.is_set():
            return
        self.waiting += 1
        try:
            yield Started(turn_id=turn_id, prompt_tokens=prompt_tokens)
            while not self.event.is_set():
                try:
                    await asyncio.wait_for(self.event.wait(), self.ping_interval)
                except TimeoutError:
                    yield Ping()
        finally:
            self.waiting -= 1
