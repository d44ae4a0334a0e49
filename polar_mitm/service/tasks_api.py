"""The task API: a trainer's TaskRequests in (`POST /v1/tasks`), views and scored groups out
(`GET /v1/tasks[/{id}[/results]]`), cancels (`DELETE`); and when a group is complete.

What reaches the host is off unless the operator turned it on: the `local` runtime
(`--allow-local-runtime`), task paths and the host paths a task names (`--task-root`), callbacks
(`--callback-allow`). A refusal is a 403 that names the flag. A task's secrets (its env, its
evaluator's) are sealed before the store keeps them and unsealed only for the node that runs it.
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from aiohttp import web

from polar_mitm import api as m
from polar_mitm import auth
from polar_mitm.outcomes import TRAINABLE
from polar_mitm.recipes import all_recipes
from polar_mitm.reconstruct.groups import advantages
from polar_mitm.service import http
from polar_mitm.service.callbacks import Callbacks
from polar_mitm.service.events import Events
from polar_mitm.service.http import ApiError, body_of, forbid
from polar_mitm.service.metrics import Metrics
from polar_mitm.store.service import SampleRow, ServiceStore, TaskRow, TaskSummary, unpack_rows
from polar_mitm.strategies import Normalize, choices
from polar_mitm.tasks import TaskFileError, load_tasks
from polar_mitm.tasks.model import Task


def _without_content(e: TaskFileError) -> str:
    """A task file's problems without the values it holds (an error must not quote a file)."""
    problems = [p.splitlines()[0].split(", got ", 1)[0][:200] for p in e.problem.split("; ") if p.strip()]
    return "; ".join(problems)


def _known_harness(name: str) -> None:
    """A harness the server's recipes know (the nodes run this package's recipes), else a 422
    that names the known ones: the server decides, so a client of another version can submit."""
    known = all_recipes()
    if name not in known:
        message = f"unknown harness {name[:80]!r}; known: {', '.join(sorted(known))}"
        raise ApiError(
            422, "invalid_request", f"harness: {message}", fields=[{"field": "harness", "message": message}]
        )


class Tasks:
    def __init__(
        self,
        store: ServiceStore,
        events: Events,
        metrics: Metrics,
        callbacks: Callbacks,
        sealer: auth.Sealer,
        *,
        max_body: int,
        allow_local_runtime: bool = False,
        task_root: Path | None = None,
        callback_allow: set[str] | None = None,
    ):
        self.store = store
        self.events = events
        self.metrics = metrics
        self.callbacks = callbacks
        self.sealer = sealer
        self.max_body = max_body
        self.allow_local_runtime = allow_local_runtime
        self.task_root = task_root
        self.callback_allow = callback_allow or set()

    # -- what reaches the host ------------------------------------------------------------------

    def _under_root(self, path: str | Path) -> bool:
        assert self.task_root is not None
        return Path(path).resolve().is_relative_to(self.task_root)

    def _check_host_paths(self, task: Task, field: str) -> None:
        """A task's host paths (its Dockerfile, its tests) lie under --task-root, when there is one;
        what it copies into a sandbox (`uploads`), only with one."""
        if self.task_root is None:
            if task.uploads:
                raise forbid(
                    f"{field}.uploads", "the server copies no host path unless started with --task-root DIR"
                )
            return
        for name, path in (
            ("dockerfile", task.dockerfile),
            ("evaluator.tests_dir", task.evaluator.tests_dir),
            *((f"uploads[{i}].source", u.source) for i, u in enumerate(task.uploads)),
        ):
            if path is not None and not self._under_root(path):
                raise forbid(f"{field}.{name}", f"{path} is outside --task-root {self.task_root}")

    def _allowed(self, req: m.TaskRequest) -> None:
        """What reaches the host is off unless the operator turned it on: a 403 naming the flag."""
        if req.runtime == "local" and not self.allow_local_runtime:
            raise forbid(
                "runtime",
                "'local' runs the harness (and any harness_cmd) on a node's host, outside a sandbox; "
                "the server allows it only with --allow-local-runtime",
            )
        if req.task_path is not None:
            if self.task_root is None:
                raise forbid(
                    "task_path",
                    "the server reads no host path unless started with --task-root DIR; "
                    "send the task inline (polar-mitm submit does)",
                )
            if not self._under_root(req.task_path):
                raise forbid("task_path", f"{req.task_path} is outside --task-root {self.task_root}")
        if req.callback_url is not None:
            host = (urlsplit(req.callback_url).hostname or "").lower()
            if not self.callback_allow:
                raise forbid(
                    "callback_url", "the server posts to no address unless started with --callback-allow HOST"
                )
            if host not in self.callback_allow:
                raise forbid(
                    "callback_url",
                    f"host {host!r} is not among --callback-allow ({', '.join(sorted(self.callback_allow))})",
                )
        if req.task is not None:
            self._check_host_paths(req.task, "task")

    def _resolve(self, req: m.TaskRequest) -> Task:
        _known_harness(req.harness)
        self._allowed(req)
        if req.task is not None:
            task = req.task
        else:
            path = Path(req.task_path).resolve()  # type: ignore[arg-type]
            try:
                found = load_tasks([path])
            except TaskFileError as e:
                where = Path(e.path).resolve()
                shown = (
                    where.relative_to(self.task_root)
                    if self.task_root and where.is_relative_to(self.task_root)
                    else where.name
                )
                message = f"{shown}{f' line {e.line}' if e.line else ''}: {_without_content(e)}"
                raise ApiError(
                    422,
                    "invalid_request",
                    f"task_path: {message}",
                    fields=[{"field": "task_path", "message": message}],
                ) from None
            except Exception as e:  # what a loader did not expect: named, never quoted
                raise ApiError(
                    422,
                    "invalid_request",
                    f"task_path: {req.task_path} cannot be loaded as a task ({e.__class__.__name__})",
                ) from None
            for t in found:
                self._check_host_paths(t, "task_path")
            if len(found) > 1 and not req.task_id:
                raise ApiError(
                    422,
                    "invalid_request",
                    f"task_path: {req.task_path} holds {len(found)} tasks; name one with task_id",
                )
            task = found[0] if len(found) == 1 else next((t for t in found if t.id == req.task_id), None)  # type: ignore[assignment]
            if task is None:
                raise ApiError(422, "invalid_request", f"task_id: no task {req.task_id!r} in {req.task_path}")
        if req.evaluator is not None:
            task = task.model_copy(update={"evaluator": req.evaluator})
            self._check_host_paths(task, "evaluator")
        if req.runtime == "local" and task.evaluator.kind in ("harbor", "swebench"):
            raise ApiError(
                422,
                "invalid_request",
                f"runtime: the {task.evaluator.kind} evaluator needs a container runtime",
            )
        return task

    # -- secrets --------------------------------------------------------------------------------

    def _sealed(self, task: Task) -> Task:
        """The task as the store keeps it: its env values (and its evaluator's) sealed."""
        ev = task.evaluator.model_copy(update={"env": self.sealer.seal(task.evaluator.env)})
        return task.model_copy(update={"env": self.sealer.seal(task.env), "evaluator": ev})

    def unsealed(self, task: Task) -> Task:
        """The task as its node runs it (`auth.UnsealError` when its secrets cannot be read back)."""
        ev = task.evaluator.model_copy(update={"env": self.sealer.unseal(task.evaluator.env)})
        return task.model_copy(update={"env": self.sealer.unseal(task.env), "evaluator": ev})

    # -- routes ---------------------------------------------------------------------------------

    async def submit(self, request: web.Request) -> web.Response:
        req: m.TaskRequest = await body_of(request, m.TaskRequest, self.max_body)
        task_id = self.accept(req)
        return web.json_response(
            m.Submitted(task_id=task_id, num_samples=req.num_samples).model_dump(mode="json"), status=202
        )

    def accept(self, req: m.TaskRequest) -> str:
        """Check, seal and queue a request (an ApiError when it cannot be); its task id."""
        task = self._resolve(req)
        task_id = req.task_id or task.id
        if not m.TASK_ID.fullmatch(task_id):
            raise ApiError(
                422, "invalid_request", f"task_id: {task_id[:80]!r} cannot name a task in a URL; pass task_id"
            )
        stored = req.model_copy(
            update={
                "task": self._sealed(req.task) if req.task is not None else None,
                "evaluator": req.evaluator.model_copy(update={"env": self.sealer.seal(req.evaluator.env)})
                if req.evaluator is not None
                else None,
            }
        )
        ok = self.store.add_task(
            task_id,
            stored.model_dump_json(),
            self._sealed(task).model_dump_json(),
            req.priority,
            req.num_samples,
            bool(req.callback_url),
        )
        if not ok:
            raise ApiError(409, "conflict", f"a task with id {task_id!r} exists; submit with another task_id")
        self.events.publish(m.Event(kind="task", task_id=task_id, state="queued"))
        self.metrics.submitted.inc()
        return task_id

    def task(self, task_id: str) -> TaskRow:
        """The task's row, or a 404."""
        row = self.store.task(task_id)
        if row is None:
            raise ApiError(404, "not_found", f"no task {task_id[:80]!r}")
        return row

    def view(self, row: TaskSummary, samples: list[SampleRow] | None = None) -> m.TaskView:
        """A task's view from its summary columns and its samples without their rows: nothing
        stored is parsed but the samples' small JSON columns."""
        if samples is None:
            samples = self.store.samples(row.id, rows=False)
        views = [
            m.SampleView(
                index=s.idx,
                state=s.state,  # type: ignore[arg-type]
                stage=s.stage,
                status=s.status,
                cause=s.cause,
                node_id=s.node_id,
                dispatches=s.dispatches,
                reward=s.reward,
                timings=json.loads(s.timings or "{}"),
                weight_versions=json.loads(s.weight_versions or "[]"),
                session_id=s.session_id,
            )
            for s in samples
        ]
        return m.TaskView(
            task_id=row.id,
            state=row.state,  # type: ignore[arg-type]
            num_samples=row.num_samples,
            priority=row.priority,
            harness=row.harness,
            runtime=row.runtime,
            created_at=row.created_at,
            updated_at=row.updated_at,
            samples=views,
            callback=row.callback_state,
        )

    def _summary(self, task_id: str) -> TaskSummary:
        found = self.store.summaries(task_id)
        if not found:
            raise ApiError(404, "not_found", f"no task {task_id[:80]!r}")
        return found[0]

    async def get_task(self, request: web.Request) -> web.Response:
        return web.json_response(
            self.view(self._summary(request.match_info["task_id"])).model_dump(mode="json")
        )

    async def list_tasks(self, request: web.Request) -> web.Response:
        samples = self.store.all_samples()
        return web.json_response(
            [self.view(r, samples.get(r.id, [])).model_dump(mode="json") for r in self.store.summaries()]
        )

    def rows(self, task_id: str, normalize: str | None = Normalize.STD) -> list[dict[str, Any]]:
        """The group's rows, with the GRPO advantage over its usable samples."""
        samples = [s for s in self.store.samples(task_id) if s.state == "finished"]
        rewards = {s.idx: s.reward or 0.0 for s in samples if s.status in TRAINABLE}
        adv = advantages(rewards, normalize) if normalize else {}  # type: ignore[arg-type]
        out = []
        for s in samples:
            for row in unpack_rows(s.rows):
                row["group_id"] = task_id
                row["sample_index"] = s.idx
                row["advantage"] = adv.get(s.idx, 0.0) if normalize else None
                out.append(row)
        return out

    def group(self, task_id: str) -> dict[str, Any]:
        """What a callback posts: the task's view and its rows."""
        return {
            "task": self.view(self._summary(task_id)).model_dump(mode="json"),
            "rows": self.rows(task_id),
        }

    async def results(self, request: web.Request) -> web.StreamResponse:
        row = self.task(request.match_info["task_id"])
        fmt = request.query.get("format", "json")
        normalize = request.query.get("normalize", Normalize.STD)
        if normalize not in (*choices(Normalize), "none"):
            raise ApiError(
                422,
                "invalid_request",
                f"normalize: {normalize!r} is not one of {', '.join(choices(Normalize))}, none",
            )
        rows = self.rows(row.id, None if normalize == "none" else normalize)
        if fmt == "json":
            return http.json_body({"task_id": row.id, "state": row.state, "rows": rows})
        if fmt == "parquet":
            return web.Response(body=parquet_bytes(rows), content_type="application/vnd.apache.parquet")
        raise ApiError(422, "invalid_request", f"format: {fmt!r} is not one of json, parquet")

    async def cancel_task(self, request: web.Request) -> web.Response:
        task_id = self.cancel(request.match_info["task_id"])
        return web.json_response(self.view(self._summary(task_id)).model_dump(mode="json"))

    def cancel(self, task_id: str) -> str:
        """Cancel a task not yet done or cancelled (a 404 when there is none); its id."""
        row = self.task(task_id)
        if row.state not in ("done", "cancelled"):
            self.store.cancel_samples(row.id, "cancelled by request")
            self.store.set_task_state(row.id, "cancelled")
            self.events.publish(m.Event(kind="task", task_id=row.id, state="cancelled"))
            self.maybe_complete(row.id)
        return row.id

    # -- completion -----------------------------------------------------------------------------

    def maybe_complete(self, task_id: str) -> None:
        """Called whenever a sample of the task finished or was cancelled: stop early once enough
        samples are usable, mark the task done when every sample is, and deliver its callback."""
        row = self.store.task(task_id)
        if row is None:
            return
        req = m.TaskRequest.model_validate_json(row.request)
        samples = self.store.samples(task_id, rows=False)  # states only: no group's rows read
        usable = sum(1 for s in samples if s.state == "finished" and s.status in TRAINABLE)
        if (
            req.early_stop_min_usable
            and usable >= req.early_stop_min_usable
            and any(s.state in ("queued", "dispatched") for s in samples)
        ):
            self.store.cancel_samples(task_id, f"early stop: {usable} usable samples in")
            samples = self.store.samples(task_id, rows=False)
        if all(s.state == "finished" for s in samples) and row.state not in ("done",):
            if row.state != "cancelled":
                self.store.set_task_state(task_id, "done")
            self.events.publish(
                m.Event(
                    kind="task",
                    task_id=task_id,
                    state="done" if row.state != "cancelled" else "cancelled",
                    data={"usable": usable},
                )
            )
            if req.callback_url:
                self.callbacks.due(task_id)


def parquet_bytes(rows: list[dict[str, Any]]) -> bytes:
    import pyarrow.parquet as pq

    from polar_mitm.reconstruct.trajectory import Trajectory, to_table

    buf = io.BytesIO()
    pq.write_table(to_table([Trajectory.from_row(r) for r in rows]), buf, compression="zstd")
    return buf.getvalue()
