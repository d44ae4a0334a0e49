"""What is loaded on first use is loaded once, however many callers ask at once (single-flight):
the one helper for every lazy load (the tokenizer and its chat template, the engines' model info,
the recipes, a task's image, what a harness runs).

The first caller starts the load; the callers meanwhile wait for that one load instead of starting
their own; the result is kept, and a failure is not: the next caller loads again. Two flavours of
the same rule:

- `once`, a decorator for plain functions (threads, start-up): the result per key (the arguments,
  or what `key` makes of them); the threads that ask while a key loads wait for that call (and
  share its failure), other keys load meanwhile.
- `Flights`, for an event loop: a coroutine's result per key. The callers wait on one task,
  shielded, so a caller that leaves (a turn cancelled) cancels nothing the others wait on.
  Heavy work inside a load belongs in a thread (`asyncio.to_thread`): a load that held the loop
  would stall every stream (and, before they had a thread of their own, every heartbeat) it serves.

Standard library only (core floor).
"""

from __future__ import annotations

import asyncio
import functools
import threading
from collections.abc import Awaitable, Callable, Hashable
from typing import Any, overload


@overload
def once[F: Callable[..., Any]](fn: F) -> F: ...
@overload
def once[F: Callable[..., Any]](*, key: Callable[..., Hashable]) -> Callable[[F], F]: ...
def once(fn: Any = None, *, key: Callable[..., Hashable] | None = None) -> Any:
    """`fn` called once per key (its arguments, or `key(*args, **kwargs)`), from any thread: the
    callers that come while it runs wait for that call's result; a call that raises keeps nothing.
    `fn.forget()` drops what was kept (tests, a file that changed)."""

    def decorate(fn: Any) -> Any:
        kept: dict[Hashable, Any] = {}
        flying: dict[Hashable, _Flight] = {}
        guard = threading.Lock()

        @functools.wraps(fn)
        def loaded(*args: Any, **kwargs: Any) -> Any:
            k = key(*args, **kwargs) if key is not None else (args, tuple(sorted(kwargs.items())))
            with guard:
                if k in kept:
                    return kept[k]
                flight = flying.get(k)
                if flight is None:
                    flight = flying[k] = _Flight()
                    mine = True
                else:
                    mine = False
            if not mine:  # another thread loads it: its result (or its failure) is ours
                flight.landed.wait()
                if flight.error is not None:
                    raise flight.error
                return flight.value
            try:
                flight.value = fn(*args, **kwargs)
            except BaseException as e:
                flight.error = e
                raise
            finally:
                with guard:
                    if flight.error is None:
                        kept[k] = flight.value
                    del flying[k]
                flight.landed.set()
            return flight.value

        def forget() -> None:
            with guard:
                kept.clear()

        loaded.forget = forget  # type: ignore[attr-defined]
        return loaded

    return decorate(fn) if fn is not None else decorate


class _Flight:
    """One call of a `once` function under way: the threads that wait for it, what it gave."""

    def __init__(self) -> None:
        self.landed = threading.Event()
        self.value: Any = None
        self.error: BaseException | None = None


class Flights[K: Hashable, V]:
    """Coroutine loads on one event loop, one per key: `await flights.get(key, load)` runs
    `load()` for the first caller of a key, and every caller until it ends waits for that run.
    `kept`: the dict the results go to, when its owner reads them there (a runtime's images)."""

    def __init__(self, kept: dict[K, V] | None = None) -> None:
        self._kept: dict[K, V] = {} if kept is None else kept
        self._flying: dict[K, asyncio.Future[V]] = {}

    def kept(self, key: K) -> V | None:
        """What the key's load gave, if it has ended well (never waits)."""
        return self._kept.get(key)

    def keep(self, key: K, value: V) -> None:
        """Keep `value` as the key's load (known some other way: the preflight's model info)."""
        self._kept[key] = value

    def forget(self, key: K) -> None:
        self._kept.pop(key, None)

    def start(self, key: K, load: Callable[[], Awaitable[V]]) -> asyncio.Future[V]:
        """The key's load as a future, started now unless it is under way (or kept: then done)."""
        if key in self._kept:
            done = asyncio.get_running_loop().create_future()
            done.set_result(self._kept[key])
            return done
        flight = self._flying.get(key)
        if flight is None:
            flight = self._flying[key] = asyncio.ensure_future(load())
            flight.add_done_callback(functools.partial(self._landed, key))
        return flight

    async def get(self, key: K, load: Callable[[], Awaitable[V]]) -> V:
        if key in self._kept:
            return self._kept[key]
        # Shielded: a caller that goes away does not cancel the load the others wait on.
        return await asyncio.shield(self.start(key, load))

    def _landed(self, key: K, flight: asyncio.Future[V]) -> None:
        # Runs before the waiters resume (the first callback added): what they read is kept.
        if self._flying.get(key) is flight:
            del self._flying[key]
        if flight.cancelled():
            return
        if flight.exception() is None:  # retrieved here too: raised where awaited, never unseen
            self._kept[key] = flight.result()
