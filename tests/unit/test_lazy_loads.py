"""What a process loads on first use is loaded once, off the event loop: the turns that arrive
together (a node's first samples all make their first model call at once) wait for the one load
instead of each starting their own, and the loop keeps serving meanwhile.

The bug this is shaped like: three turns loaded the tokenizer at once, each in a worker thread,
and the node's heartbeats starved until the node was declared lost while alive."""

from __future__ import annotations

import asyncio
import shutil
import threading
import time

import pytest

from polar_mitm.backends.tokenizer import Tokenizer
from polar_mitm.policy.config import PolicyConfig
from polar_mitm.policy.discovery import Discovery


@pytest.fixture
def fresh_dir(tmp_path, tiny_tokenizer_dir):
    """A tokenizer directory no earlier test loaded (the load is cached per directory)."""
    return shutil.copytree(tiny_tokenizer_dir, tmp_path / "tok")


@pytest.fixture
def slow_loads(monkeypatch):
    """Tokenizer construction made 0.3 s slower (a real vocabulary's second), counted."""
    made: list[str] = []
    real = Tokenizer.__init__

    def slow(self, path):
        made.append(str(path))
        time.sleep(0.3)
        real(self, path)

    monkeypatch.setattr(Tokenizer, "__init__", slow)
    return made


def test_threads_loading_one_directory_at_once_share_one_load(fresh_dir, slow_loads):
    got: list[Tokenizer] = []
    threads = [threading.Thread(target=lambda: got.append(Tokenizer.load(fresh_dir))) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(slow_loads) == 1
    assert len(got) == 6 and all(t is got[0] for t in got)


async def test_turns_asking_for_the_tokenizer_at_once_share_one_load_off_the_loop(
    fresh_dir, slow_loads, monkeypatch
):
    loads: list[str] = []
    real = Tokenizer.load.__func__

    def counted(cls, path):
        loads.append(str(path))
        return real(cls, path)

    monkeypatch.setattr(Tokenizer, "load", classmethod(counted))
    discovery = Discovery(PolicyConfig(tokenizer=str(fresh_dir)), client=None, engines=None)  # type: ignore[arg-type]

    # The loop keeps its beat while the load runs: the longest gap between ticks stays short.
    gaps: list[float] = []

    async def ticks() -> None:
        last = time.monotonic()
        while True:
            await asyncio.sleep(0.01)
            now = time.monotonic()
            gaps.append(now - last)
            last = now

    ticker = asyncio.create_task(ticks())
    # One caller that goes away meanwhile cancels nothing the others wait on.
    leaver = asyncio.create_task(discovery.tokenizer())
    await asyncio.sleep(0.05)
    leaver.cancel()
    toks = await asyncio.gather(*(discovery.tokenizer() for _ in range(8)))
    ticker.cancel()
    assert len(loads) == 1 and len(slow_loads) == 1
    assert all(t is toks[0] for t in toks)
    assert await discovery.tokenizer() is toks[0] and len(loads) == 1  # kept
    assert max(gaps) < 0.2, f"the event loop stalled {max(gaps):.2f} s during the load"


async def test_a_failed_load_is_tried_again_by_the_next_caller(tmp_path, fresh_dir):
    missing = tmp_path / "not-yet"
    discovery = Discovery(PolicyConfig(tokenizer=str(missing)), client=None, engines=None)  # type: ignore[arg-type]
    with pytest.raises(Exception):  # noqa: B017 - whatever the loader raises for a missing directory
        await discovery.tokenizer()
    shutil.copytree(fresh_dir, missing)
    assert (await discovery.tokenizer()).vocab_size > 0
