"""Callback delivery: a finished group posted to the task's `callback_url`, with retries.

Whether a callback is due, delivered or failed is kept in the store, so a restarted server
delivers what was due and not yet delivered. Which hosts may be posted to is checked when the
task is submitted (`tasks_api.py`, `--callback-allow`); redirects are never followed.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import aiohttp

from polar_mitm import api as m
from polar_mitm.retry import Backoff
from polar_mitm.store.service import ServiceStore

log = logging.getLogger("polar_mitm.service")


class CallbackFailed(Exception):
    """One callback POST that did not land (the text is what the task's callback_error shows)."""


class Callbacks:
    def __init__(
        self,
        store: ServiceStore,
        payload: Callable[[str], dict[str, Any]],
        *,
        attempts: int = 8,
        backoff: float = 1.0,
    ):
        """`payload`: what is posted for a task (its view and rows); `attempts` posts at most,
        `backoff` seconds before the second, doubling up to a minute."""
        self.store = store
        self.payload = payload
        self.attempts = attempts
        self.backoff = backoff
        self.tasks: dict[str, asyncio.Task] = {}
        self._http: aiohttp.ClientSession | None = None

    def start(self) -> asyncio.Task:
        """Open the client and deliver, after a restart, what was due and not yet delivered;
        returns the loop that does it, for the server to cancel with the rest."""
        self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30))
        return asyncio.create_task(self._resume())

    async def stop(self) -> None:
        for t in self.tasks.values():
            t.cancel()
        await asyncio.gather(*self.tasks.values(), return_exceptions=True)
        if self._http is not None:
            await self._http.close()

    def due(self, task_id: str) -> None:
        """The task is done and has a callback: deliver it (once, however often it is called)."""
        if task_id not in self.tasks or self.tasks[task_id].done():
            self.tasks[task_id] = asyncio.create_task(self._deliver(task_id))

    async def _resume(self) -> None:
        """After a restart: deliver what was due and not yet delivered."""
        for row in self.store.pending_callbacks():
            self.due(row.id)

    async def _deliver(self, task_id: str) -> None:
        row = self.store.task(task_id)
        assert row is not None
        req = m.TaskRequest.model_validate_json(row.request)
        assert req.callback_url and self._http is not None
        payload = self.payload(task_id)
        http, url = self._http, req.callback_url

        async def post() -> None:
            try:
                # No redirects: only the allowed host is ever posted to.
                async with http.post(url, json=payload, allow_redirects=False) as r:
                    if r.status >= 300:
                        raise CallbackFailed(f"HTTP {r.status}")
            except (aiohttp.ClientError, TimeoutError, OSError) as e:
                raise CallbackFailed(f"{e.__class__.__name__}: {e}") from e

        try:
            await Backoff(
                f"callback for {task_id}",
                attempts=self.attempts,
                first=self.backoff,
                retry_on=(CallbackFailed,),
                on_retry=lambda _, e: self.store.set_callback(task_id, "pending", str(e)),
                log=log,
            ).call_async(post)
        except CallbackFailed as e:
            self.store.set_callback(task_id, "failed", str(e))
        else:
            self.store.set_callback(task_id, "delivered")
