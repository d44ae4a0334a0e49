"""POSTRUN's scoring: a sample is verified where its agent never ran.

On a runtime with fresh sandboxes (`Runtime.fresh_verifier`, Docker), when the harness ends:
1. the agent's sandbox is halted: every process it left (a `setsid` loop, a watcher) ends at once;
2. its workdir, the agent's artefacts, is exported as a tar, and the agent's sandbox removed;
3. a new sandbox starts from the task's image (`SandboxSpec.purpose = "verifier"`: nothing of
   ours mounted; no network, or where the task lets its verifier reach the internet, a channel of
   its own to the proxy under the agent's egress rules, with the model refused), so `bash`, the interpreter and every path outside the workdir are
   the image's own, whatever the agent replaced in its sandbox;
4. the image's workdir is replaced by the artefacts, except what the evaluator takes from the
   image (`evaluators.from_image`: SWE-bench's repository, test files and conftest.py);
5. only then does the evaluator run: it copies its tests in, creates /logs/verifier empty and
   reads its verdict.
This is how SWE-bench's own harness scores (a fresh container from the artefacts); Harbor itself
verifies in the agent's container. `reward_detail["verifier"]` records where and how it ran.

The `local` runtime (a host directory) and `apptainer` score in the agent's own sandbox, as before,
and say so in the detail; `session_completed` runs nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import posixpath
import shlex
import shutil
import tarfile
import tempfile
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any, BinaryIO

from polar_mitm.rollout.canary import Canary
from polar_mitm.rollout.evaluators import (
    HARBOR_TESTS,
    EvaluatorError,
    FromImage,
    HarnessOutcome,
    Score,
    evaluate,
    from_image,
    reset_conftests,
)
from polar_mitm.rollout.verdict import RECORD_DIR, Setup, uses_pytest
from polar_mitm.sandbox.base import ExportTooLarge, Runtime, Sandbox, SandboxError, SandboxSpec, Snapshot
from polar_mitm.sandbox.channel import Channel
from polar_mitm.tasks.model import Task

ARTEFACT_LIMIT = 1 << 30  # bytes of a workdir's tar; beyond it the sample is not scored
KEEP_DIR = "/tmp/polar-mitm-from-image"  # in the verifier: the image's files while the workdir is replaced
LISTED = 50  # dropped paths named in the detail


class VerifierUnavailable(SandboxError):
    """The fresh verification sandbox could not be started or used: an infrastructure failure."""


# Opens the verifier's own channel to the proxy (a context: closed once it is scored), for a task
# whose verifier may reach the internet; the pipeline's, which knows the proxy.
OpenChannel = Callable[[], AbstractAsyncContextManager[Channel]]
FORWARDER_START_SEC = 30.0


async def score(
    runtime: Runtime,
    task: Task,
    agent: Sandbox,
    spec: SandboxSpec,
    outcome: HarnessOutcome,
    open_channel: OpenChannel | None = None,
) -> Score:
    """The sample's score, from a fresh sandbox where the runtime has them; with the internet
    through a channel of its own (`open_channel`) where the task lets its verifier reach it."""
    if task.evaluator.kind == "session_completed":
        s = await evaluate(task, agent, outcome)
        s.detail["verifier"] = {"sandbox": "none", "note": "session_completed rewards the exit status"}
        return s
    if not runtime.fresh_verifier:
        if task.evaluator.kind == "swebench":
            await reset_conftests(task, agent)
        s = await evaluate(task, agent, outcome)
        s.detail["verifier"] = {
            "sandbox": "agent",
            **agent.describe(),
            "isolated": False,
            "note": f"the {runtime.name} runtime scores in the agent's own sandbox, where processes "
            "the agent left and files it changed outside its workdir can reach the verifier",
        }
        return s
    if verifier_mode(task, runtime) == "shared":
        return await _shared(runtime, task, agent, spec, outcome, open_channel)
    return await _fresh(runtime, task, agent, spec, outcome, open_channel)


def verifier_mode(task: Task, runtime: Runtime) -> str:
    """Where a sample is verified: "shared" (a sandbox from a snapshot of the agent's own
    filesystem, everything it changed anywhere: Harbor's default for its tasks) or "separate"
    (a sandbox from the task's image holding the agent's workdir: SWE-bench's rule, and a Harbor
    task's that says `environment_mode = "separate"`). Shared where the runtime can snapshot."""
    mode = task.evaluator.environment_mode or ("shared" if task.evaluator.kind == "harbor" else "separate")
    return mode if mode == "separate" or runtime.snapshots else "separate"


# What a verifier's tests start with before any of the task's code runs: the shells, `env` (a
# test script's `#!/usr/bin/env bash`), the dynamic loader and libc and what the loader is told to
# load first. In shared mode the agent's filesystem is the verifier's; a change the agent made to
# any of these makes the verdict suspect (the seal, the read-only tests and the canary hold for
# the rest). The agent runs as an unprivileged user by default and cannot change them at all.
LAUNCH_PATHS = frozenset(
    {
        "/bin/bash", "/usr/bin/bash", "/bin/sh", "/usr/bin/sh", "/bin/dash", "/usr/bin/dash",
        "/bin/env", "/usr/bin/env", "/etc/ld.so.preload", "/etc/ld.so.conf", "/etc/ld.so.cache",
    }
)  # fmt: skip
LAUNCH_PREFIXES = ("/etc/ld.so.conf.d/", "/lib/x86_64-linux-gnu/ld-linux", "/lib/x86_64-linux-gnu/libc.so",
                   "/usr/lib/x86_64-linux-gnu/ld-linux", "/usr/lib/x86_64-linux-gnu/libc.so", "/lib64/",
                   "/usr/lib64/", "/lib/ld-linux", "/usr/lib/ld-linux")  # fmt: skip


def launch_changes(changed: list[str]) -> list[str]:
    """The paths of `changed` that the verifier's tests start with (LAUNCH_PATHS)."""
    return [p for p in changed if p in LAUNCH_PATHS or p.startswith(LAUNCH_PREFIXES)]


async def _shared(
    runtime: Runtime,
    task: Task,
    agent: Sandbox,
    spec: SandboxSpec,
    outcome: HarnessOutcome,
    open_channel: OpenChannel | None,
) -> Score:
    """Harbor's shared mode, with what the agent ran kept out: the agent's sandbox halted (every
    process it left ends at once), its filesystem snapshotted, the sandbox removed, and the
    verifier started from the snapshot: what the agent installed, built or edited anywhere is
    there; nothing it started is."""
    agent_name = agent.describe().get("container") or agent.name
    try:
        await agent.halt()
        snap = await runtime.snapshot(agent, f"{spec.name}-verifier")
    except SandboxError as e:
        await agent.stop()
        if isinstance(e, ExportTooLarge):
            raise EvaluatorError(f"task {task.id}: the agent's environment is not scored: {e}") from None
        raise VerifierUnavailable(f"snapshotting {agent_name}: {e}") from e
    except BaseException:
        await asyncio.shield(agent.stop())
        raise
    removing = asyncio.ensure_future(agent.stop())
    try:
        return await _score_artefacts(
            runtime, task, spec, outcome, None, 0, agent_name, open_channel, snapshot=snap
        )
    finally:
        await asyncio.shield(removing)
        await asyncio.shield(runtime.drop_snapshot(snap))


async def _fresh(
    runtime: Runtime,
    task: Task,
    agent: Sandbox,
    spec: SandboxSpec,
    outcome: HarnessOutcome,
    open_channel: OpenChannel | None,
) -> Score:
    workdir = posixpath.normpath(task.workdir)
    parent, base = posixpath.split(workdir)
    if not base:
        raise EvaluatorError(f"task {task.id}: workdir {task.workdir!r} cannot be replaced by artefacts")
    agent_name = agent.describe().get("container") or agent.name
    async with _spool_slot:
        with tempfile.TemporaryFile(prefix="polar-artefacts-") as spool:
            try:
                await agent.halt()
                size: int | None = await agent.export(workdir, ARTEFACT_LIMIT, spool)
            except FileNotFoundError:
                size = None  # the agent removed its workdir: the verifier gets an empty one
            except ExportTooLarge as e:
                await agent.stop()
                raise EvaluatorError(f"task {task.id}: the agent's artefacts are not scored: {e}") from None
            except SandboxError as e:
                await agent.stop()
                raise VerifierUnavailable(f"copying the artefacts out of {agent_name}: {e}") from e
            except BaseException:  # cancelled (early stop, Ctrl-C): nothing left running
                await asyncio.shield(agent.stop())
                raise
            removing = asyncio.ensure_future(agent.stop())  # while the verifier's sandbox starts
            try:
                data = spool if size is not None else None
                return await _score_artefacts(
                    runtime, task, spec, outcome, data, size or 0, agent_name, open_channel
                )
            finally:
                await asyncio.shield(removing)


# Artefacts in flight at once in this process: each is a file on disk of at most ARTEFACT_LIMIT
# bytes (memory holds a chunk of it), so the disk they take is bounded by SPOOLS x the limit.
SPOOLS = 8
_spool_slot = asyncio.Semaphore(SPOOLS)


async def _score_artefacts(
    runtime: Runtime,
    task: Task,
    spec: SandboxSpec,
    outcome: HarnessOutcome,
    data: BinaryIO | None,
    size: int,
    agent_name: str,
    open_channel: OpenChannel | None = None,
    snapshot: Snapshot | None = None,
) -> Score:
    workdir = posixpath.normpath(task.workdir)
    parent = posixpath.dirname(workdir)
    keep = from_image(task.evaluator)
    copied: dict[str, Any] = {"from": workdir, "bytes": size}
    if snapshot is not None:
        copied = {"snapshot": snapshot.ref, "changed_paths": snapshot.changed_count}
    async with contextlib.AsyncExitStack() as stack:
        if snapshot is None and data is not None and (keep.paths or keep.names):
            kept = stack.enter_context(tempfile.TemporaryFile(prefix="polar-artefacts-"))
            dropped = await asyncio.to_thread(without, data, keep, kept)
            data = kept
            copied["kept_from_image"] = [*keep.paths, *(f"**/{n}" for n in keep.names)]
            copied["dropped"] = dropped[:LISTED]
        if data is None and snapshot is None:
            copied["note"] = "the agent's workdir did not exist"
        channel = None
        if open_channel is not None and task.verifier_internet:
            channel = await stack.enter_async_context(open_channel())
        setup, inputs = verifier_inputs(runtime, task, spec.session_dir / "verifier-inputs")
        if snapshot is not None:
            tampered = tuple(launch_changes(snapshot.changed))
            setup = dataclasses.replace(setup, tampered=tampered)
        vspec = dataclasses.replace(
            spec,
            name=f"{spec.name}-verifier",
            harness=None,
            purpose="verifier",
            channel=channel.socket_path if channel is not None else None,
            inputs=inputs,
            image=snapshot.ref if snapshot is not None else None,
        )
        try:
            verifier = await runtime.start(task, vspec)
        except SandboxError as e:
            raise VerifierUnavailable(f"starting the verifier's sandbox: {e}") from e
        try:
            try:
                if channel is not None and verifier.proxy_address is not None:
                    try:
                        await channel.wait_ready(FORWARDER_START_SEC)
                    except TimeoutError:
                        raise VerifierUnavailable(
                            f"the verifier's forwarder did not start within {FORWARDER_START_SEC:g} s"
                        ) from None
                if snapshot is None:
                    await _place(verifier, workdir, parent, data, keep)
                s = await evaluate(task, verifier, outcome, setup)
            except SandboxError as e:
                if not await verifier.alive():
                    raise VerifierUnavailable(f"the verifier's sandbox died: {e}") from e
                raise
            s.detail["verifier"] = {
                "sandbox": "fresh",
                "mode": "shared" if snapshot is not None else "separate",
                **verifier.describe(),
                "agent_sandbox": agent_name,
                "agent_stopped_first": True,
                "copied": copied,
                "internet": channel is not None,
            }
            return s
        finally:
            await verifier.stop()


VERIFIER_HELPERS = "/opt/polar-mitm/verifier"  # what a task's tests may use, read-only
# `untrusted CMD...`: CMD as an unprivileged user with no capability, for a task's tests to run
# the agent's code with: it cannot then write /logs, touch the tests' own processes or read
# what only root reads (docs/threat-model.md).
UNTRUSTED = """#!/bin/sh
# polar-mitm: run a command as nobody, with no capability and no way to gain one.
if setpriv --reuid=65534 --regid=65534 --clear-groups -- true 2>/dev/null; then
  exec setpriv --reuid=65534 --regid=65534 --clear-groups --inh-caps=-all --no-new-privs -- "$@"
fi
# A user namespace that maps root alone (Apptainer's verifier) has no other user to become.
echo "polar-mitm: no unprivileged user here; running as is, without new privileges" >&2
exec setpriv --inh-caps=-all --no-new-privs -- "$@"
"""


def verifier_inputs(runtime: Runtime, task: Task, host_dir: Path) -> tuple[Setup, list[tuple[Path, str]]]:
    """What a fresh verifier is shown read-only, prepared on the host in `host_dir`: a pristine
    copy of a Harbor task's tests at /tests (its test.sh executable, as Harbor makes it before it
    runs it), the helpers a task's tests may use at VERIFIER_HELPERS, and the canary's plugin
    where the tests run pytest (rollout/canary.py). Nothing where the runtime cannot mount them
    (the tests are then copied in, as before)."""
    if not runtime.mounts_inputs:
        return Setup(), []
    spec = task.evaluator
    shutil.rmtree(host_dir, ignore_errors=True)
    inputs: list[tuple[Path, str]] = []
    mounted = False
    if spec.kind == "harbor" and spec.tests_dir is not None:
        tests = host_dir / "tests"
        shutil.copytree(spec.tests_dir, tests, symlinks=True)
        for p in [tests, *tests.rglob("*")]:
            if not p.is_symlink():
                p.chmod((p.stat().st_mode | 0o444 | (0o111 if p.is_dir() else 0)) & 0o7777)
        (tests / "test.sh").chmod(0o755)
        inputs.append((tests, HARBOR_TESTS))
        mounted = True
    helper = host_dir / "verifier"
    helper.mkdir(parents=True)
    (helper / "untrusted").write_text(UNTRUSTED)
    (helper / "untrusted").chmod(0o755)
    helper.chmod(0o755)
    inputs.append((helper, VERIFIER_HELPERS))
    canary = None
    if uses_pytest(spec):
        canary = Canary.new(RECORD_DIR)
        inputs.append((canary.write(host_dir / "plugin"), canary.mount))
    return Setup(tests_mounted=mounted, canary=canary), inputs


def without(data: BinaryIO, keep: FromImage, into: BinaryIO) -> list[str]:
    """Write into `into` the tar `data` (members under the workdir's name) less what comes from
    the image; returns the workdir-relative paths left out. A link or file standing where a kept
    path's directory belongs is left out too, so the image's files are put back where they were.
    Streams member by member: neither tar is held in memory."""
    dropped: dict[str, None] = {}
    data.seek(0)
    with tarfile.open(fileobj=data, mode="r|") as src, tarfile.open(fileobj=into, mode="w|") as dst:
        for m in src:
            rel = m.name.strip("/").partition("/")[2]
            under = next((p for p in keep.paths if rel == p or rel.startswith(p + "/")), None)
            blocks = not m.isdir() and any(p.startswith(rel + "/") for p in keep.paths)
            if rel and (under or blocks or keep.covers(rel)):
                dropped.setdefault(under or rel)  # a kept directory once, not each file in it
                continue
            dst.addfile(m, src.extractfile(m) if m.isfile() else None)
    return list(dropped)


async def _place(
    verifier: Sandbox, workdir: str, parent: str, data: BinaryIO | None, keep: FromImage
) -> None:
    """Replace the verifier's workdir (the image's) by the artefacts, keeping `keep` from the image.

    Everything runs with the image's own tools in a sandbox no agent process ever ran in."""
    q = shlex.quote
    if not (keep.paths or keep.names):  # the whole workdir is the agent's
        made = f" && mkdir -p {q(workdir)}" if data is None else ""
        await _sh(verifier, f"rm -rf {q(workdir)} && mkdir -p {q(parent)}{made}", "clearing the workdir")
        if data is not None:
            await verifier.put_tar(parent, data)
        return
    aside = [
        "set -e",
        f"rm -rf {KEEP_DIR}",
        f"mkdir -p {KEEP_DIR}",
        f"if [ -d {q(workdir)} ]; then cd {q(workdir)}",
        f"for p in {' '.join(q(p) for p in keep.paths)}; do"
        f' if [ -e "$p" ] || [ -L "$p" ]; then mkdir -p "{KEEP_DIR}/$(dirname "$p")";'
        f' mv "$p" "{KEEP_DIR}/$p"; fi; done'
        if keep.paths
        else ":",
        *(
            f"find . -path ./.git -prune -o -name {q(n)} -print | while IFS= read -r p; do"
            f' mkdir -p "{KEEP_DIR}/$(dirname "$p")"; mv "$p" "{KEEP_DIR}/$p"; done'
            for n in keep.names
        ),
        "fi",
        "cd /",
        f"rm -rf {q(workdir)}",
        f"mkdir -p {q(parent)}",
    ]
    await _sh(verifier, "\n".join(aside), "clearing the image's workdir")
    if data is not None:
        await verifier.put_tar(parent, data)
    restore = f"mkdir -p {q(workdir)} && cp -a {KEEP_DIR}/. {q(workdir)}/ && rm -rf {KEEP_DIR}"
    await _sh(verifier, restore, "putting the image's files back")


async def _sh(sandbox: Sandbox, script: str, what: str) -> None:
    r = await sandbox.exec(["sh", "-c", script], workdir="/", timeout=300)
    if r.exit_code != 0:
        raise EvaluatorError(f"verifier sandbox {sandbox.name}: {what} failed: {r.output[-300:]}")
