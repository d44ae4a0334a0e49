"""The node protocol: gateway nodes register, send heartbeats, lease samples and report results.

Scheduling is pull-based: a node asks for work when it has room (`POST /v1/nodes/{id}/lease`
with its free capacity), so the nodes with the least stage pressure are the ones that take
samples, and the server never needs to reach a node. Every dispatch carries a lease; a result
under a stale lease is refused, so a sample is never recorded twice. A node that misses
heartbeats is lost: its unfinished samples are dispatched once more. Each reply carries the
node's `Control` (paused, weight version, samples to cancel, leases to drop, draining).

Nothing waits forever: a sample dispatched to a node whose heartbeats stop listing it, or that
its node holds past its deadline (its budget plus `deadline_grace`), is repaired, as a lost
node's are: queued again while it has dispatches left, else failed with the cause, and its task
completes. A node is told to drop every lease it lists that is no longer its (it was declared
lost and came back, or the sample was repaired), so no sample runs under two leases. `/metrics`
counts the repairs (`polar_service_repairs_total` by reason and action).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any

from aiohttp import web

from polar_mitm import api as m
from polar_mitm import auth
from polar_mitm.outcomes import TRAINABLE
from polar_mitm.service.events import Events
from polar_mitm.service.http import PRINCIPAL, ApiError, body_of
from polar_mitm.service.metrics import Metrics
from polar_mitm.service.tasks_api import Tasks
from polar_mitm.store.service import NodeRow, ServiceStore, TaskRow
from polar_mitm.tasks.model import Task

log = logging.getLogger("polar_mitm.service")


class Nodes:
    def __init__(
        self,
        store: ServiceStore,
        events: Events,
        metrics: Metrics,
        tasks: Tasks,
        *,
        node_timeout: float,
        max_dispatches: int,
        max_body: int,
        max_result: int,
        deadline_grace: float = 60.0,
    ):
        self.store = store
        self.events = events
        self.metrics = metrics
        self.tasks = tasks
        self.node_timeout = node_timeout
        self.max_dispatches = max_dispatches
        self.max_body = max_body
        self.max_result = max_result
        self.deadline_grace = deadline_grace
        self.heartbeats: dict[str, m.Heartbeat] = {}  # the last load each node reported
        self.heartbeat_at: dict[str, float] = {}
        # Per node, the longest silence between its registration or heartbeats, seen here (what a
        # node timeout must exceed; `/metrics`).
        self.longest_silence: dict[str, float] = {}
        # A node's silence counts from this server's start at the earliest: while a killed server
        # was down, nobody could reach it, and its nodes get node_timeout to come back.
        self.started_at = time.time()

    def control(self, node_id: str, drop: list[str] | None = None) -> m.Control:
        node = self.store.node(node_id)
        return m.Control(
            paused=self.store.get("paused") == "1",
            weight_version=self.store.get("weight_version"),
            cancel=self.store.cancelling_for(node_id),
            draining=node is not None and node.state == "draining",
            drop=drop or [],
        )

    def _node(self, node_id: str) -> NodeRow:
        node = self.store.node(node_id)
        if node is None:
            raise ApiError(404, "not_found", f"no node {node_id!r}; register first")
        return node

    def _silent(self, node: NodeRow, now: float) -> float:
        """Seconds since the node was last heard from, or since this server started."""
        return now - max(node.last_seen, self.started_at)

    def _live(self, node: NodeRow, now: float | None = None) -> bool:
        return node.state != "lost" and self._silent(node, now or time.time()) < self.node_timeout

    def healthy_nodes(self) -> list[str]:
        now = time.time()
        return [n.id for n in self.store.nodes() if self._live(n, now)]

    async def register(self, request: web.Request) -> web.Response:
        reg: m.NodeRegistration = await body_of(request, m.NodeRegistration, self.max_body)
        principal = request[PRINCIPAL]
        if principal.startswith("node:") and principal != f"node:{reg.node_id}":
            raise ApiError(
                403, "forbidden", f"node {principal[5:]}'s key registers node {principal[5:]} only"
            )
        held = self.store.node(reg.node_id)
        if held is not None and self._live(held) and principal != f"node:{reg.node_id}":
            wait = self.node_timeout - self._silent(held, time.time())
            raise ApiError(
                409,
                "conflict",
                f"node id {reg.node_id!r} is held by a live node; choose another --node-id, or wait"
                f" {max(wait, 0):.0f} s until it is lost",
            )
        key = auth.new_token()
        self.store.register_node(reg.node_id, reg.url, reg.workers)
        self.heartbeat_at[reg.node_id] = time.time()
        self.store.set_node_key(reg.node_id, auth.digest(key))
        self.events.publish(m.Event(kind="node", state="active", data={"node_id": reg.node_id}))
        log.info("node %s registered (%s)", reg.node_id, reg.url or "no url")
        reply = m.Registered(**self.control(reg.node_id).model_dump(), node_key=key)
        return web.json_response(reply.model_dump(mode="json"))

    async def heartbeat(self, request: web.Request) -> web.Response:
        node_id = request.match_info["node_id"]
        hb: m.Heartbeat = await body_of(request, m.Heartbeat, self.max_body)
        node = self._node(node_id)
        if node.state == "lost":  # it came back: accept it again; its old leases are gone
            self.store.set_node_state(node_id, "active")
        self.store.heartbeat(node_id, hb.model_dump_json())
        self.heartbeats[node_id] = hb
        now = time.time()
        if (last := self.heartbeat_at.get(node_id)) is not None:
            self.longest_silence[node_id] = max(self.longest_silence.get(node_id, 0.0), now - last)
            if now - last > self.node_timeout / 2:  # an operator's early sign of a starved node
                log.warning(
                    "node %s was silent %.1f s (node timeout %g s)", node_id, now - last, self.node_timeout
                )
        self.heartbeat_at[node_id] = now
        self.store.set_stages(node_id, hb.samples)
        ours = self.store.held_by(node_id)
        # A sample the node does not list (the lease reply never reached it, or it lost the job)
        # for longer than a node may be silent: repaired. A node that lists only (task, index)
        # pairs is taken at its word for every copy of that sample.
        if hb.leases is not None:
            listed = set(hb.leases)
            unheld = [
                (t, i, lease)
                for t, i, lease, _, at in ours
                if lease not in listed and now - at > self.node_timeout
            ]
        else:
            pairs = {(t, i) for t, i, _ in hb.samples}
            unheld = [
                (t, i, lease)
                for t, i, lease, _, at in ours
                if (t, i) not in pairs and now - at > self.node_timeout
            ]
        if unheld:
            self.repair(
                unheld, "unheld", f"node {node_id} no longer holds it (its heartbeats stopped listing it)"
            )
        # Leases it lists that are not its any more: it stops those copies (fencing).
        current = {row[2] for row in ours}
        drop = [lease for lease in hb.leases or () if lease not in current]
        return web.json_response(self.control(node_id, drop).model_dump(mode="json"))

    def repair(self, stale: list[tuple[str, int, str]], reason: str, cause: str) -> None:
        """Samples given up under their leases (`ServiceStore.repair`), counted, and their tasks
        completed where that was the last one."""
        requeued, failed, cancelled = self.store.repair(stale, cause, self.max_dispatches)
        for action, n in (("requeued", requeued), ("failed", failed), ("cancelled", cancelled)):
            if n:
                self.metrics.repairs.labels(reason, action).inc(n)
        if requeued or failed or cancelled:
            log.warning("%s: %d queued again, %d failed, %d cancelled", cause, requeued, failed, cancelled)
        for t, i, _ in stale:
            self.events.publish(
                m.Event(kind="sample", task_id=t, index=i, state="repaired", data={"reason": reason})
            )
        for t in {t for t, _, _ in stale}:
            self.tasks.maybe_complete(t)

    async def lease(self, request: web.Request) -> web.Response:
        node_id = request.match_info["node_id"]
        body: m.LeaseRequest = await body_of(request, m.LeaseRequest, self.max_body)
        node = self._node(node_id)
        self.store.heartbeat(node_id, node.stats)
        if node.state != "active":
            return web.json_response(m.LeaseReply(control=self.control(node_id)).model_dump(mode="json"))
        out = []
        parsed: dict[str, tuple[TaskRow, m.TaskRequest, Task] | str] = {}  # each task read once per lease
        for s, lease in self.store.lease(node_id, body.capacity):
            if s.task_id not in parsed:
                row = self.tasks.task(s.task_id)
                try:
                    parsed[s.task_id] = (
                        row,
                        m.TaskRequest.model_validate_json(row.request),
                        self.tasks.unsealed(Task.model_validate_json(row.task)),
                    )
                except auth.UnsealError as e:
                    parsed[s.task_id] = str(e)
            got = parsed[s.task_id]
            if isinstance(got, str):  # its secrets cannot be read back: failed, said why
                self.store.finish_sample(
                    s.task_id, s.idx, lease, status="failed", cause=got, reward=0.0, node_id=node_id
                )
                self.tasks.maybe_complete(s.task_id)
                continue
            row, req, task = got
            out.append(
                m.Assignment(
                    task_id=s.task_id,
                    index=s.idx,
                    lease=lease,
                    task=task,
                    harness=req.harness,
                    harness_cmd=req.harness_cmd,
                    runtime=req.runtime,
                    builder=req.builder,
                    num_samples=row.num_samples,
                    agent_timeout_seconds=req.agent_timeout_seconds,
                    timeout_seconds=req.timeout_seconds,
                )
            )
            self.events.publish(
                m.Event(
                    kind="sample",
                    task_id=s.task_id,
                    index=s.idx,
                    state="dispatched",
                    data={"node_id": node_id},
                )
            )
            self.events.publish(m.Event(kind="task", task_id=s.task_id, state="running"))
        return web.json_response(
            m.LeaseReply(assignments=out, control=self.control(node_id)).model_dump(mode="json")
        )

    async def result(self, request: web.Request) -> web.Response:
        node_id = request.match_info["node_id"]
        res: m.SampleResult = await body_of(request, m.SampleResult, self.max_result)
        row = self.tasks.task(res.task_id)
        req = m.TaskRequest.model_validate_json(row.request)
        rows, versions, detail = stale_check(res, req)
        status = res.status  # a sample that finished before a cancel reached it keeps its work
        if status == "cancelled" and self.store.requeue_sample(
            res.task_id, res.index, res.lease, self.max_dispatches, node_id
        ):
            # Cancelled by its node (shutting down), not by us: it runs again elsewhere.
            self.events.publish(m.Event(kind="sample", task_id=res.task_id, index=res.index, state="queued"))
            return web.json_response({"accepted": True, "requeued": True})
        ok = self.store.finish_sample(
            res.task_id,
            res.index,
            res.lease,
            status=status,
            cause=res.cause,
            reward=res.reward if status in TRAINABLE else (0.0 if status == "failed" else None),
            detail=detail,
            timings=res.timings,
            weight_versions=versions,
            session_id=res.session_id,
            rows=rows,
            node_id=node_id,
        )
        if not ok:
            raise ApiError(
                409,
                "stale_lease",
                f"sample {res.task_id}#{res.index} is not leased to {node_id} under this lease",
            )
        self.metrics.finished(status, res.timings)
        self.events.publish(
            m.Event(
                kind="sample",
                task_id=res.task_id,
                index=res.index,
                state="finished",
                data={"status": status, "reward": res.reward},
            )
        )
        self.tasks.maybe_complete(res.task_id)
        return web.json_response({"accepted": True})

    async def list_nodes(self, request: web.Request) -> web.Response:
        return web.json_response([self.node_view(n).model_dump(mode="json") for n in self.store.nodes()])

    def node_view(self, n: NodeRow) -> m.NodeView:
        return m.NodeView(
            node_id=n.id,
            url=n.url,
            state=n.state,
            workers=json.loads(n.workers),
            last_seen=n.last_seen,
            healthy=self._live(n),
            load=self.heartbeats.get(n.id),
            dispatched=self.store.dispatched_count(n.id),
        )

    async def drain_node(self, request: web.Request) -> web.Response:
        node = self._node(request.match_info["node_id"])
        self.store.set_node_state(node.id, "draining")
        self.events.publish(m.Event(kind="node", state="draining", data={"node_id": node.id}))
        return web.json_response(self.node_view(self._node(node.id)).model_dump(mode="json"))

    def lose_node(self, node_id: str) -> None:
        """The node is gone: its samples go back to the queue once, its id is free again."""
        self.store.set_node_state(node_id, "lost")
        requeued, failed = self.store.requeue_node(node_id, self.max_dispatches)
        for action, n in (("requeued", requeued), ("failed", failed)):
            if n:
                self.metrics.repairs.labels("node_lost", action).inc(n)
        log.warning("node %s lost: %d samples queued again, %d failed", node_id, requeued, failed)
        self.events.publish(
            m.Event(
                kind="node", state="lost", data={"node_id": node_id, "requeued": requeued, "failed": failed}
            )
        )
        for t in {r.id for r in self.store.tasks(("running",))}:
            self.tasks.maybe_complete(t)

    async def watch(self) -> None:
        """Nodes that stopped sending heartbeats are lost; their samples go back to the queue once.
        Samples held past their deadline are repaired."""
        while True:
            await asyncio.sleep(min(1.0, self.node_timeout / 3))
            now = time.time()
            for n in self.store.nodes():
                if n.state != "lost" and self._silent(n, now) > self.node_timeout:
                    self.lose_node(n.id)
            self.repair_overdue(now)

    def repair_overdue(self, now: float) -> None:
        by_node: dict[str, list[tuple[str, int, str]]] = {}
        for t, i, lease, node_id in self.store.overdue(now, self.deadline_grace, self.started_at):
            by_node.setdefault(node_id, []).append((t, i, lease))
        for node_id, stale in by_node.items():
            self.repair(
                stale,
                "deadline",
                f"past its deadline on node {node_id} (its timeout + {self.deadline_grace:g} s)",
            )


def stale_check(
    res: m.SampleResult, req: m.TaskRequest
) -> tuple[list[dict[str, Any]], list[str], dict[str, Any] | None]:
    """The weight versions a sample's turns span; with max_staleness, flag or mask the rows of a
    sample that spans more version changes than allowed."""
    versions: list[str] = []
    for row in res.rows:
        for v in json.loads(row.get("metadata") or "{}").get("weight_versions") or []:
            if v is not None and str(v) not in versions:
                versions.append(str(v))
    detail = dict(res.detail or {})
    rows = res.rows
    if req.max_staleness is not None and len(versions) - 1 > req.max_staleness:
        detail["stale"] = {
            "versions": versions,
            "max_staleness": req.max_staleness,
            "action": req.stale_action,
        }
        for row in rows:
            meta = json.loads(row.get("metadata") or "{}")
            meta["stale"] = versions
            if req.stale_action == "mask":
                row["loss_mask"] = [0] * len(row.get("loss_mask") or [])
                meta["masked"] = f"stale: spans weight versions {versions}"
            row["metadata"] = json.dumps(meta, sort_keys=True, separators=(",", ":"))
    return rows, versions, detail or None
