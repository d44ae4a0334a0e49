"""`RolloutClient` and `AsyncRolloutClient` stay in step: the same public methods with the same
signatures (modulo async), and the same answers from a real server on 127.0.0.1.

A method added to one client and not the other, or a parameter that drifts, fails here by name.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from polar_mitm.client import AsyncRolloutClient, Group, RolloutClient, RolloutError
from polar_mitm.service.config import ServerConfig
from polar_mitm.service.server import RolloutServer
from polar_mitm.tasks.model import EvaluatorSpec, Task

# The async spelling of the few names Python itself spells differently.
ASYNC_NAME = {"close": "aclose", "__enter__": "__aenter__", "__exit__": "__aexit__"}


def public(cls: type) -> dict[str, Callable[..., Any]]:
    """The methods a user calls: no leading underscore, plus the context-manager protocol."""
    return {
        name: fn
        for name, fn in vars(cls).items()
        if callable(fn) and (not name.startswith("_") or name in {*ASYNC_NAME, *ASYNC_NAME.values()})
    }


def sync_spelling(annotation: object) -> object:
    """An async method's annotation as its sync twin writes it."""
    if not isinstance(annotation, str):
        return annotation
    return annotation.replace("AsyncIterator", "Iterator").replace("AsyncRolloutClient", "RolloutClient")


def test_both_clients_have_the_same_public_methods():
    sync_names = {ASYNC_NAME.get(n, n) for n in public(RolloutClient)}
    async_names = set(public(AsyncRolloutClient))
    assert sync_names - async_names == set(), "missing from AsyncRolloutClient"
    assert async_names - sync_names == set(), "missing from RolloutClient"


@pytest.mark.parametrize("name", sorted(public(RolloutClient)))
def test_each_method_has_the_same_signature_modulo_async(name):
    sync_fn = public(RolloutClient)[name]
    async_fn = public(AsyncRolloutClient).get(ASYNC_NAME.get(name, name))
    assert async_fn is not None, f"AsyncRolloutClient has no {ASYNC_NAME.get(name, name)}"
    s, a = inspect.signature(sync_fn), inspect.signature(async_fn)
    assert [(p.name, p.kind, p.default, p.annotation) for p in s.parameters.values()] == [
        (p.name, p.kind, p.default, sync_spelling(p.annotation)) for p in a.parameters.values()
    ], f"{name}: {s} != {a}"
    assert s.return_annotation == sync_spelling(a.return_annotation), name
    if name != "__init__":
        # Every async method is awaited or iterated with `async for`; no sync one is.
        assert inspect.iscoroutinefunction(async_fn) or inspect.isasyncgenfunction(async_fn), name
        assert not (inspect.iscoroutinefunction(sync_fn) or inspect.isasyncgenfunction(sync_fn)), name


def a_task(task_id: str) -> Task:
    return Task(id=task_id, instruction="x", evaluator=EvaluatorSpec(kind="command", command="true"))


async def test_both_clients_get_the_same_answers_from_one_server(tmp_path):
    """No node runs anything: tasks queue, are cancelled, and come back as empty groups; pause
    with no node is drained at once. What differs between the two answers is only the id."""
    server = RolloutServer(ServerConfig(db=tmp_path / "s.sqlite", token="parity-token"))
    await server.start("127.0.0.1", 0)
    try:
        sync = RolloutClient(server.url, token=server.token)
        answers: dict[str, dict[str, Any]] = {}

        async def drive(kind: str, call: Callable[[str, Any], Any]) -> None:
            async def run(name: str, *args: Any, **kw: Any) -> Any:
                return await call(name, *args, **kw)

            tid = await run("submit", a_task(f"{kind}-t"), samples=2, harness="claude-code", priority=3)
            got: dict[str, Any] = {"submit": tid.removeprefix(kind)}
            got["status"] = (await run("status", tid)).model_dump(
                exclude={"task_id", "created_at", "updated_at"}
            )
            got["cancel"] = (await run("cancel", tid)).model_dump(
                exclude={"task_id", "created_at", "updated_at"}
            )
            groups = await run("wait", [tid], poll=0.05, timeout=10)
            got["wait"] = [(g.state, g.index, len(g.samples), [o.state for o in g.outcomes]) for g in groups]
            group: Group = await run("results", tid, normalize="loo")
            got["results"] = (group.state, group.samples, [o.status for o in group.outcomes])
            got["parquet"] = (await run("parquet", tid))[:4]
            got["pause"] = await run("pause", 1.0)
            got["resume"] = await run("resume", f"{kind}-v2")
            try:
                await run("status", "no-such-task")
            except RolloutError as e:
                got["error"] = (e.status, str(e))
            answers[kind] = got

        async def call_sync(name: str, *args: Any, **kw: Any) -> Any:
            def go() -> Any:
                out = getattr(sync, name)(*args, **kw)
                return list(out) if name == "wait" else out

            return await asyncio.to_thread(go)

        async with AsyncRolloutClient(server.url, token=server.token) as client:

            async def call_async(name: str, *args: Any, **kw: Any) -> Any:
                out = getattr(client, name)(*args, **kw)
                if isinstance(out, AsyncIterator):
                    return [x async for x in out]
                return await out

            await drive("sync", call_sync)
            await drive("async", call_async)
        await asyncio.to_thread(sync.close)
    finally:
        await server.stop()
    s, a = answers["sync"], answers["async"]
    assert s["submit"] == a["submit"] == "-t"
    assert s["status"]["state"] == "queued" and s["status"]["num_samples"] == 2
    assert s["cancel"]["state"] == "cancelled"
    assert s["parquet"] == b"PAR1"
    assert s["pause"]["drained"] is True and s["error"][0] == 404
    assert s["resume"]["weight_version"] == "sync-v2" and a["resume"]["weight_version"] == "async-v2"
    s["resume"].pop("weight_version"), a["resume"].pop("weight_version")
    assert s == a
