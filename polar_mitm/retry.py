"""Trying again after a failure, with a growing pause, a bounded number of times: the one helper
for the node's reports to the server, the server's callbacks, and a store's first WAL switch.

Each failure but the last is logged (at `level`) with the pause that follows it; the last one,
the give-up, always at WARNING with the number of attempts, and then raised: whoever called
decides what giving up means (a report dropped, a callback marked failed). Standard library only
(core floor): an async variant for the event loop, a sync one for threads and start-up.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterator

_log = logging.getLogger("polar_mitm.retry")


def delays(first: float, factor: float = 2.0, cap: float = 60.0) -> Iterator[float]:
    """first, first·factor, first·factor², … never above `cap`: the pauses between attempts."""
    delay = first
    while True:
        yield min(delay, cap)
        delay = min(delay * factor, cap)


class _Policy:
    """What `retry` and `retry_async` share: which failures are retried, and the logging."""

    def __init__(
        self,
        what: str,
        attempts: int,
        retry_on: tuple[type[BaseException], ...],
        when: Callable[[BaseException], bool] | None,
        log: logging.Logger,
        level: int,
    ) -> None:
        if attempts < 1:
            raise ValueError(f"attempts must be at least 1, not {attempts}")
        self.what, self.attempts, self.retry_on, self.when = what, attempts, retry_on, when
        self.log, self.level = log, level

    def retried(self, e: BaseException) -> bool:
        return isinstance(e, self.retry_on) and (self.when is None or self.when(e))

    def failed(self, attempt: int, e: BaseException, pause: float) -> bool:
        """Log attempt `attempt`'s failure; True when it was the last (give up)."""
        if attempt >= self.attempts:
            self.log.warning("%s: giving up after %d attempts: %s", self.what, self.attempts, _why(e))
            return True
        self.log.log(
            self.level,
            "%s failed (attempt %d of %d): %s; again in %.2g s",
            self.what,
            attempt,
            self.attempts,
            _why(e),
            pause,
        )
        return False


def _why(e: BaseException) -> str:
    return str(e) or type(e).__name__


async def retry_async[T](
    fn: Callable[[], Awaitable[T]],
    *,
    what: str,
    attempts: int,
    first: float,
    factor: float = 2.0,
    cap: float = 60.0,
    retry_on: tuple[type[BaseException], ...] = (Exception,),
    when: Callable[[BaseException], bool] | None = None,
    on_retry: Callable[[int, BaseException], None] | None = None,
    log: logging.Logger = _log,
    level: int = logging.WARNING,
) -> T:
    """`await fn()` until it returns, at most `attempts` times, pausing `delays(first, factor, cap)`
    between tries. A failure not in `retry_on` (or that `when` refuses) is raised at once;
    `on_retry(attempt, error)` runs before each pause (to record the failure somewhere)."""
    policy = _Policy(what, attempts, retry_on, when, log, level)
    pauses = delays(first, factor, cap)
    attempt = 0
    while True:
        attempt += 1
        try:
            return await fn()
        except BaseException as e:
            if not policy.retried(e):
                raise
            pause = next(pauses)
            if policy.failed(attempt, e, pause):
                raise
            if on_retry is not None:
                on_retry(attempt, e)
        await asyncio.sleep(pause)


def retry[T](
    fn: Callable[[], T],
    *,
    what: str,
    attempts: int,
    first: float,
    factor: float = 2.0,
    cap: float = 60.0,
    retry_on: tuple[type[BaseException], ...] = (Exception,),
    when: Callable[[BaseException], bool] | None = None,
    on_retry: Callable[[int, BaseException], None] | None = None,
    log: logging.Logger = _log,
    level: int = logging.WARNING,
) -> T:
    """`retry_async` for a blocking call: `fn()` with `time.sleep` pauses."""
    policy = _Policy(what, attempts, retry_on, when, log, level)
    pauses = delays(first, factor, cap)
    attempt = 0
    while True:
        attempt += 1
        try:
            return fn()
        except BaseException as e:
            if not policy.retried(e):
                raise
            pause = next(pauses)
            if policy.failed(attempt, e, pause):
                raise
            if on_retry is not None:
                on_retry(attempt, e)
        time.sleep(pause)
