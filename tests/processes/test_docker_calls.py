"""A Docker sandbox's life through the real daemon, with each of the runtime's two ways to make
its calls once a container exists: its own (`DaemonCalls`, http.client on the daemon's Unix
socket) and the SDK's (`SdkCalls`, for a daemon elsewhere). Both must say the same: an exec's
output and exit code, a kill that restarts the container with its files, files copied in, read
and exported (a missing one, one too large), the daemon's refusals
(an exec in a paused container), the processes left behind, a seal, a halt and the removal.
And a container whose forwarder cannot start: the start fails by name, nothing is left."""

from __future__ import annotations

import asyncio
import io
import tarfile
import tempfile
import time

import pytest

from polar_mitm.sandbox.base import ExportTooLarge, SandboxError, SandboxSpec
from polar_mitm.sandbox.daemon import DaemonCalls, DaemonRefused, SdkCalls
from polar_mitm.sandbox.docker import DockerRuntime
from polar_mitm.tasks.model import Task

IMAGE = "polar-mitm/rollout-base:bookworm"

pytestmark = pytest.mark.docker


@pytest.mark.parametrize("transport", ["daemon", "sdk"])
async def test_a_sandboxs_calls_say_the_same_through_either_transport(tmp_path, certs_dir, transport):
    from polar_mitm.proxy.certs import ensure_ca

    rt = DockerRuntime()
    try:
        await rt.check()
    except Exception as e:
        pytest.skip(f"no Docker daemon: {e}")
    if transport == "sdk":
        rt._calls = SdkCalls(rt.client.api)
    assert isinstance(rt.calls, DaemonCalls if transport == "daemon" else SdkCalls)
    spec = SandboxSpec(
        name=f"polar-calls-{transport}-{time.time_ns()}",
        session_dir=tmp_path / "s",
        ca=ensure_ca(certs_dir),
        purpose="verifier",
        labels={"polar-mitm.rollout": "calls-test"},
    )
    sb = await rt.start(Task(id="calls", instruction="x", image=IMAGE, workdir="/app"), spec)
    try:
        r = await sb.exec(["sh", "-c", "pwd; echo err >&2; echo kept > f; exit 3"])
        assert r.exit_code == 3 and sorted(r.output.splitlines()) == ["/app", "err"]  # two pipes: any order
        assert await sb.alive()
        # Something left running, then every process killed and the container started again.
        await sb.exec(["sh", "-c", "(setsid sleep 300 </dev/null >/dev/null 2>&1 &)"])
        assert any("sleep 300" in p.command for p in await sb.processes())
        await sb.kill_all()
        assert await sb.alive() and not any("sleep 300" in p.command for p in await sb.processes())
        assert (await sb.exec(["cat", "f"])).output == "kept\n"
        # Files in and out: a directory copied in, a file read back, the workdir exported whole.
        (tmp_path / "src").mkdir()
        (tmp_path / "src" / "x").write_text("in")
        await sb.put(tmp_path / "src", "/app/in")
        assert await sb.read("/app/in/x") == b"in" and await sb.read("/app/none") is None
        with tempfile.TemporaryFile() as spool:
            size = await sb.export("/app", 1 << 20, spool)
            spool.seek(0)
            with tarfile.open(fileobj=spool) as tar:
                assert {"app/f", "app/in/x"} <= set(tar.getnames()) and size > 0
            with pytest.raises(ExportTooLarge):
                await sb.export("/app", 10, spool)
        with pytest.raises(FileNotFoundError):
            await sb.export("/nowhere", 1 << 20, io.BytesIO())
        # The daemon's refusal, named: no exec in a paused container.
        await asyncio.to_thread(rt.calls.pause, sb.container.id)
        with pytest.raises(SandboxError, match="409"):
            await sb.exec(["true"])
        with pytest.raises(DaemonRefused) as refused:
            await asyncio.to_thread(rt.calls.pause, sb.container.id)
        assert refused.value.status == 409
        await sb.halt()  # a paused container is killed too
        assert not await sb.alive()
        assert await sb.read("/app/f") == b"kept\n"  # its files stay readable
    finally:
        await sb.stop()
    assert not await sb.alive()  # removed
    await sb.stop()  # once more: nothing to remove, no error


async def test_a_forwarder_that_cannot_start_fails_the_start_by_name_and_leaves_no_container(
    tmp_path, certs_dir
):
    """A verifier whose task lets it reach the internet gets a channel, whose forwarder runs on
    the image's python3 (no node is mounted into a verifier unless given). In an image without
    python3 the start fails, naming the image, and the container made for it is removed."""
    from polar_mitm.proxy.certs import ensure_ca

    rt = DockerRuntime()
    try:
        await rt.check()
    except Exception as e:
        pytest.skip(f"no Docker daemon: {e}")
    tag = f"polar-mitm/test-no-python:{time.time_ns()}"
    maker = await asyncio.to_thread(
        lambda: rt.client.containers.run(IMAGE, ["sh", "-c", "rm -f /usr/bin/python3*"], detach=True)
    )
    try:
        assert (await asyncio.to_thread(maker.wait))["StatusCode"] == 0
        await asyncio.to_thread(lambda: maker.commit(*tag.split(":")))
    finally:
        await asyncio.to_thread(lambda: maker.remove(force=True))
    try:
        (tmp_path / "proxy.sock").touch()  # the channel's host end: only mounted here
        spec = SandboxSpec(
            name=f"polar-no-forwarder-{time.time_ns()}",
            session_dir=tmp_path / "s",
            ca=ensure_ca(certs_dir),
            purpose="verifier",
            channel=tmp_path / "proxy.sock",
            labels={"polar-mitm.rollout": "calls-test"},
        )
        task = Task(id="noforward", instruction="x", image=tag, workdir="/app")
        with pytest.raises(SandboxError, match=rf"task noforward: .*{tag}.*python3"):
            await rt.start(task, spec)
        left = await asyncio.to_thread(
            lambda: rt.client.containers.list(all=True, filters={"name": spec.name})
        )
        assert left == []
        # The same verifier on the image with python3 starts, its forwarder running.
        ok = await rt.start(Task(id="forward", instruction="x", image=IMAGE, workdir="/app"), spec)
        try:
            assert await ok.alive()
            top = await asyncio.to_thread(rt.calls.top, ok.container.id, "-o pid,args")
            assert any("forward.py" in row[-1] for row in top["Processes"])
        finally:
            await ok.stop()
    finally:
        await asyncio.to_thread(lambda: rt.client.images.remove(tag, force=True))
