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


# -- every lazy load, through the one helper (polar_mitm/once.py) ------------------------------


def test_once_runs_one_call_per_key_for_threads_that_ask_together_and_keeps_no_failure():
    from polar_mitm.once import once

    calls: list[str] = []
    fail = {"b"}

    @once
    def load(key: str) -> str:
        calls.append(key)
        time.sleep(0.2)
        if key in fail:
            raise OSError(key)
        return key.upper()

    got: list[object] = []

    def ask(key: str) -> None:
        try:
            got.append(load(key))
        except OSError as e:
            got.append(e)

    t0 = time.monotonic()
    threads = [threading.Thread(target=ask, args=(k,)) for k in "aaaabb"]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(calls) == ["a", "b"]  # the waiters shared the call (and the failure)
    assert got.count("A") == 4 and sum(isinstance(g, OSError) for g in got) == 2
    assert time.monotonic() - t0 < 0.35  # the keys loaded side by side
    fail.clear()
    assert load("b") == "B" and calls.count("b") == 2  # the failure was not kept


def test_threads_reading_the_longest_token_of_one_tokenizer_share_one_reading(fresh_dir):
    """The bound the gateway reads before tokenizing (~0.5 s for a real vocabulary): each thread
    that asked before the first had finished read the whole vocabulary again."""
    from polar_mitm.backends import large_inputs

    tok = Tokenizer.load(fresh_dir)
    reads: list[int] = []
    real = tok.decode_each

    def slow(ids):
        reads.append(1)
        time.sleep(0.3)
        return real(ids)

    tok.decode_each = slow  # type: ignore[method-assign]
    got: list[int] = []
    threads = [
        threading.Thread(target=lambda: got.append(large_inputs.longest_token_bytes(tok))) for _ in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(reads) == 1 and len(set(got)) == 1 and len(got) == 4


async def test_the_chat_template_is_compiled_with_the_tokenizer_load_not_by_the_first_render(
    fresh_dir, monkeypatch
):
    """Compiling Qwen's template takes ~50 ms of a core (more on a loaded machine): the first
    render, on the proxy's event loop for a short conversation, did it there."""
    from polar_mitm.backends import tokenizer as tokenizer_module

    template = fresh_dir / "chat_template.jinja"  # a text no other test compiled
    template.write_text(template.read_text() + "{# " + str(fresh_dir) + " #}")
    discovery = Discovery(PolicyConfig(tokenizer=str(fresh_dir)), client=None, engines=None)  # type: ignore[arg-type]
    tok = await discovery.tokenizer()

    def no_compiling() -> None:
        raise AssertionError("the chat template compiled by a render")

    monkeypatch.setattr(tokenizer_module, "_jinja_environment", no_compiling)
    assert "<|im_start|>user" in tok.render([{"role": "user", "content": "u"}])


class _Images:
    """The image half of a Docker client: each lookup counted, and slow (a pull)."""

    def __init__(self) -> None:
        self.lookups = 0

    def get(self, name: str) -> object:
        self.lookups += 1
        time.sleep(0.2)
        return object()


async def test_the_samples_of_a_group_starting_together_look_their_image_up_once():
    """A group's 8 samples prepare its task at once: each looked the image up (and pulled it, when
    missing) on its own. The daemon's limits (`docker info`) are read once too."""
    from types import SimpleNamespace

    from polar_mitm.sandbox.base import Limits
    from polar_mitm.sandbox.docker import DockerRuntime
    from polar_mitm.tasks.model import Task

    images, infos = _Images(), []

    def info() -> dict:
        infos.append(1)
        time.sleep(0.2)
        return {"MemoryLimit": False, "CpuCfsQuota": True, "PidsLimit": True}

    rt = DockerRuntime(client=SimpleNamespace(images=images, info=info))
    task = Task(id="t", instruction="x", image="polar-mitm/some-image:1")
    await asyncio.gather(*(rt.prepare(task) for _ in range(8)))
    assert images.lookups == 1 and rt.image_of(task) == "polar-mitm/some-image:1"
    assert len(infos) == 1
    assert "memory" in (rt.unenforced(Limits()) or "") and rt.unenforced(Limits(memory_mb=None)) is None


async def test_a_docker_daemon_that_cannot_apply_a_limit_starts_no_container_unless_allowed(tmp_path):
    """Docker starts a container without a limit its kernel lacks (a warning, nothing more): the
    runtime refuses the start instead, before any container exists, unless the limits allow it."""
    from types import SimpleNamespace

    from polar_mitm.proxy.certs import ensure_ca
    from polar_mitm.sandbox.base import SandboxError, SandboxSpec
    from polar_mitm.sandbox.docker import DockerRuntime
    from polar_mitm.tasks.model import Task

    created: list = []
    client = SimpleNamespace(
        images=_Images(),
        info=lambda: {"MemoryLimit": False, "CpuCfsQuota": True, "PidsLimit": True},
        containers=SimpleNamespace(create=lambda *a, **k: created.append(k)),
    )
    rt = DockerRuntime(client=client)
    task = Task(id="t", instruction="x", image="polar-mitm/some-image:1")
    spec = SandboxSpec("s", tmp_path / "s", ensure_ca(tmp_path / "ca"))
    with pytest.raises(SandboxError, match="memory limits.*--allow-unenforced-limits"):
        await rt.start(task, spec)
    with pytest.raises(SandboxError, match="memory limits"):  # a task's own memory is a limit too
        await rt.start(task.model_copy(update={"memory_mb": 512}), spec)
    assert created == []
