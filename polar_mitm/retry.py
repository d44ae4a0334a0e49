"""Trying again after a failure, with a growing pause, a bounded number of times: the one helper
for the node's reports to the server, the server's callbacks, and a store's first WAL switch.

Each failure but the last is logged (at `level`) with the pause that follows it; the last one,
the give-up, always at WARNING with the number of attempts, and then raised: whoever called
decides what giving up means (a report dropped, a callback marked failed). Standard library only
(core floor): `Backoff.call_async` for the event loop, `Backoff.call` for threads and start-up.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass

_log = logging.getLogger("polar_mitm.retry")


def delays(first: float, factor: float = 2.0, cap: float = 60.0) -> Iterator[float]:
    """first, first·factor, first·factor², … never above `cap`: the pauses between attempts."""
    delay = first
    while True:
        yield min(delay, cap)
        delay = min(delay * factor, cap)


@dataclass(frozen=True)
class Backoff:
    """How to try again: `call` (blocking) or `call_async` runs `fn()` until it returns, at most
    `attempts` times, pausing `delays(first, factor, cap)` between tries. A failure not in
    `retry_on` (or that `when` refuses) is raised at once; `on_retry(attempt, error)` runs before
    each pause (to record the failure somewhere); the last failure is logged and raised."""

    what: str  # what is tried, for the log: "reporting t1#0"
    attempts: int
    first: float
    factor: float = 2.0
    cap: float = 60.0
    retry_on: tuple[type[BaseException], ...] = (Exception,)
    when: Callable[[BaseException], bool] | None = None
    on_retry: Callable[[int, BaseException], None] | None = None
    log: logging.Logger = _log
    level: int = logging.WARNING  # of each failure before the last (the give-up is a WARNING)

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError(f"attempts must be at least 1, not {self.attempts}")

    def call[T](self, fn: Callable[[], T]) -> T:
        pauses = delays(self.first, self.factor, self.cap)
        attempt = 0
        while True:
            attempt += 1
            try:
                return fn()
            except BaseException as e:
                pause = self._failed(attempt, e, pauses)
            time.sleep(pause)

    async def call_async[T](self, fn: Callable[[], Awaitable[T]]) -> T:
        pauses = delays(self.first, self.factor, self.cap)
        attempt = 0
        while True:
            attempt += 1
            try:
                return await fn()
            except BaseException as e:
                pause = self._failed(attempt, e, pauses)
            await asyncio.sleep(pause)

    def _failed(self, attempt: int, e: BaseException, pauses: Iterator[float]) -> float:
        """Called while `e` is handled: re-raises it unless it is retried; else logs it and
        returns the pause before the next attempt."""
        if not isinstance(e, self.retry_on) or (self.when is not None and not self.when(e)):
            raise  # noqa: PLE0704 - re-raises `e`, which the caller is handling
        why = str(e) or type(e).__name__
        if attempt >= self.attempts:
            self.log.warning("%s: giving up after %d attempts: %s", self.what, self.attempts, why)
            raise  # noqa: PLE0704
        pause = next(pauses)
        self.log.log(
            self.level,
            "%s failed (attempt %d of %d): %s; again in %.2g s",
            self.what,
            attempt,
            self.attempts,
            why,
            pause,
        )
        if self.on_retry is not None:
            self.on_retry(attempt, e)
        return pause
