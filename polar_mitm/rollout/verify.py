"""POSTRUN's scoring: a sample is verified where its agent never ran.

On a runtime with fresh sandboxes (`Runtime.fresh_verifier`, Docker), when the harness ends:
1. the agent's sandbox is halted: every process it left (a `setsid` loop, a watcher) ends at once;
2. its workdir, the agent's artefacts, is exported as a tar, and the agent's sandbox removed;
3. a new sandbox starts from the task's image (`SandboxSpec.purpose = "verifier"`: no network,
   nothing of ours mounted), so `bash`, the interpreter and every path outside the workdir are
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
import dataclasses
import io
import posixpath
import shlex
import tarfile
from typing import Any

from polar_mitm.rollout.evaluators import (
    EvaluatorError,
    FromImage,
    HarnessOutcome,
    Score,
    evaluate,
    from_image,
    reset_conftests,
)
from polar_mitm.sandbox.base import ExportTooLarge, Runtime, Sandbox, SandboxError, SandboxSpec
from polar_mitm.tasks.model import Task

ARTEFACT_LIMIT = 1 << 30  # bytes of a workdir's tar; beyond it the sample is not scored
KEEP_DIR = "/tmp/polar-mitm-from-image"  # in the verifier: the image's files while the workdir is replaced
LISTED = 50  # dropped paths named in the detail


class VerifierUnavailable(SandboxError):
    """The fresh verification sandbox could not be started or used: an infrastructure failure."""


async def score(
    runtime: Runtime, task: Task, agent: Sandbox, spec: SandboxSpec, outcome: HarnessOutcome
) -> Score:
    """The sample's score, from a fresh sandbox where the runtime has them."""
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
    return await _fresh(runtime, task, agent, spec, outcome)


async def _fresh(
    runtime: Runtime, task: Task, agent: Sandbox, spec: SandboxSpec, outcome: HarnessOutcome
) -> Score:
    workdir = posixpath.normpath(task.workdir)
    parent, base = posixpath.split(workdir)
    if not base:
        raise EvaluatorError(f"task {task.id}: workdir {task.workdir!r} cannot be replaced by artefacts")
    agent_name = agent.describe().get("container") or agent.name
    try:
        await agent.halt()
        data: bytes | None = await agent.export(workdir, ARTEFACT_LIMIT)
    except FileNotFoundError:
        data = None  # the agent removed its workdir: the verifier gets an empty one
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
        return await _score_artefacts(runtime, task, spec, outcome, data, agent_name)
    finally:
        await asyncio.shield(removing)


async def _score_artefacts(
    runtime: Runtime,
    task: Task,
    spec: SandboxSpec,
    outcome: HarnessOutcome,
    data: bytes | None,
    agent_name: str,
) -> Score:
    workdir = posixpath.normpath(task.workdir)
    parent = posixpath.dirname(workdir)
    keep = from_image(task.evaluator)
    copied: dict[str, Any] = {"from": workdir, "bytes": len(data or b"")}
    if data is not None and (keep.paths or keep.names):
        data, dropped = without(data, keep)
        copied["kept_from_image"] = [*keep.paths, *(f"**/{n}" for n in keep.names)]
        copied["dropped"] = dropped[:LISTED]
    if data is None:
        copied["note"] = "the agent's workdir did not exist"
    vspec = dataclasses.replace(spec, name=f"{spec.name}-verifier", harness=None, purpose="verifier")
    try:
        verifier = await runtime.start(task, vspec)
    except SandboxError as e:
        raise VerifierUnavailable(f"starting the verifier's sandbox: {e}") from e
    try:
        try:
            await _place(verifier, workdir, parent, data, keep)
            s = await evaluate(task, verifier, outcome)
        except SandboxError as e:
            if not await verifier.alive():
                raise VerifierUnavailable(f"the verifier's sandbox died: {e}") from e
            raise
        s.detail["verifier"] = {
            "sandbox": "fresh",
            **verifier.describe(),
            "agent_sandbox": agent_name,
            "agent_stopped_first": True,
            "copied": copied,
        }
        return s
    finally:
        await verifier.stop()


def without(data: bytes, keep: FromImage) -> tuple[bytes, list[str]]:
    """The tar `data` (members under the workdir's name) less what comes from the image; and the
    workdir-relative paths left out. A link or file standing where a kept path's directory
    belongs is left out too, so the image's files are put back where they were."""
    out, dropped = io.BytesIO(), dict[str, None]()
    with tarfile.open(fileobj=io.BytesIO(data)) as src, tarfile.open(fileobj=out, mode="w") as dst:
        for m in src:
            rel = m.name.strip("/").partition("/")[2]
            under = next((p for p in keep.paths if rel == p or rel.startswith(p + "/")), None)
            blocks = not m.isdir() and any(p.startswith(rel + "/") for p in keep.paths)
            if rel and (under or blocks or keep.covers(rel)):
                dropped.setdefault(under or rel)  # a kept directory once, not each file in it
                continue
            dst.addfile(m, src.extractfile(m) if m.isfile() else None)
    return out.getvalue(), list(dropped)


async def _place(verifier: Sandbox, workdir: str, parent: str, data: bytes | None, keep: FromImage) -> None:
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
