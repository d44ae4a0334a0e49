"""A gateway node: one proxy and the rollout pipeline, fed by a rollout server.

The node registers, then loops: a heartbeat (its load per stage, its proxy's generations) and,
when it has room, a lease of samples. Every sample runs through the node's one `Pipeline`, with
what it runs (harness, command, runtime) as its own `SampleSpec`, so the node's worker counts bound
it whatever the harnesses; when a sample has an outcome, the node builds its rows from its own
store with the request's builder and reports them under the sample's lease. The server's replies
carry its switches: pause or resume generation (the proxy's gate), samples to cancel, drain.

A node holds each dispatch by its lease: a sample dispatched to it again (after the server gave
the first copy up) is a new job beside the old one, and the old copy's refusal (409) touches
nothing of the new. The heartbeats list the leases held; the server answers with the leases it no
longer counts as this node's (`Control.drop`: a node it declared lost and that came back, a sample
it repaired), which the node cancels without reporting, so no sample runs under two leases.

Heartbeats go out from a thread of their own, with a client of their own, so the node's work on
its event loop (a first tokenizer load, a burst of streams, a slow report) cannot starve them: a
busy node is slow, not lost.

The same code runs in-process beside `serve`, as `polar-mitm node` on another machine, and as a
Ray actor (`ray_nodes.py`).

A node holds the node credential (derived from the service token, or given as such), which only
registers; registering returns this node's own key, and every later call carries that key alone.
"""

from __future__ import annotations

import asyncio
import logging
import os
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import httpx
from pydantic import BaseModel

from polar_mitm import api as m
from polar_mitm import auth, recipes
from polar_mitm.outcomes import trainable
from polar_mitm.proxy.embedded import PolarProxy, ProxyConfig
from polar_mitm.reconstruct.export import iter_trajectories
from polar_mitm.reconstruct.source import Selection
from polar_mitm.retry import Backoff
from polar_mitm.rollout.pipeline import Pipeline, RolloutOptions, SampleJob, SampleSpec, new_token
from polar_mitm.rollout.spec import Specs
from polar_mitm.sandbox import make_runtime
from polar_mitm.sandbox.base import Runtime
from polar_mitm.service.node_config import NodeConfig

log = logging.getLogger("polar_mitm.node")
# A finished sample's report to an unreachable server is tried again for about 10 minutes (pauses
# 0.5, 1, 2, 4, then 5 s): a killed server that restarts on its store takes it then, and the sample
# is not run twice. The sample stays listed in the node's heartbeats meanwhile.
REPORT_ATTEMPTS = 125
REPORT_PAUSE_CAP = 5.0


@dataclass(eq=False)
class Held:
    """A sample the node holds under one lease (its key in `GatewayNode.jobs`)."""

    job: SampleJob
    task_id: str
    index: int
    builder: str


class GatewayNode:
    def __init__(self, config: NodeConfig):
        self.config = config
        self.proxy = PolarProxy(
            ProxyConfig(
                db=config.db,
                certs_dir=config.certs_dir,
                default_session=f"{config.node_id}-unattributed",
                token=new_token(),
                egress_allow=config.egress_allow,
                policy=config.policy,
                own_process=config.own_process,
            )
        )
        self.pipeline: Pipeline | None = None  # started with the node
        self._runtimes: dict[str, Runtime] = {}  # by name, made on first use
        self._specs = Specs()  # what a lease runs, resolved once per harness, command, runtime
        self.jobs: dict[str, Held] = {}  # by lease: a re-dispatch of a sample is another job
        self.control = m.Control()
        self.preparing: dict[str, tuple[str, int]] = {}  # lease -> (task, index): image being prepared
        self._beating: threading.Thread | None = None
        self._beat_http: httpx.Client | None = None
        self._beat_stop = threading.Event()
        self._http: aiohttp.ClientSession | None = None
        self._stop = asyncio.Event()
        self._work_dir = config.work_dir or Path(tempfile.mkdtemp(prefix="polar-node-"))
        if config.node_token is None and config.token is None:
            raise ValueError("a node needs the node credential (node_token) or the service token")
        self._enroll = config.node_token or auth.node_token(config.token)  # type: ignore[arg-type]
        self._key: str | None = None  # issued at registration
        self._workers: dict[str, int] = {}
        defaults = RolloutOptions()
        self.capacity = config.capacity or (config.init_workers or defaults.init_workers) + (
            config.run_workers or defaults.run_workers
        )

    @property
    def node_id(self) -> str:
        return self.config.node_id

    # -- HTTP to the server ---------------------------------------------------------------------

    async def _post(self, path: str, body: BaseModel, credential: str | None = None) -> Any:
        assert self._http is not None
        bearer = credential or self._key or self._enroll
        async with self._http.post(
            self.config.server.rstrip("/") + path,
            data=body.model_dump_json(),
            headers={"authorization": f"Bearer {bearer}", "content-type": "application/json"},
        ) as r:
            data = await r.json(content_type=None)
            if r.status >= 400:
                raise NodeRefused(r.status, (data or {}).get("error", {}).get("message", str(data)))
            return data

    # -- life -----------------------------------------------------------------------------------

    async def start(self) -> None:
        await self.proxy.start()
        self.pipeline = Pipeline(
            self.config.pipeline_options(),
            self.proxy,
            None,  # each sample brings its runtime
            work_dir=self._work_dir / "samples",
            rollout_id=f"{self.node_id}-0",
        )
        self.pipeline.on_done = self._report
        await self.pipeline.start(node=self.node_id, server=self.config.server)
        self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60))
        workers = {
            k: v
            for k, v in {
                "init": self.config.init_workers,
                "run": self.config.run_workers,
                "postrun": self.config.postrun_workers,
                "ready": self.config.ready_size,
                "capacity": self.capacity,
            }.items()
            if v is not None
        }
        self._workers = workers
        # The heartbeats' own client, made before registering: making one loads a TLS context
        # (a fraction of a second, seconds on a loaded machine), a silence the server would count.
        self._beat_http = httpx.Client(timeout=httpx.Timeout(30.0, connect=10.0))
        await self._preload()
        await self._register(wait=120.0)
        log.info("node %s registered with %s (proxy %s)", self.node_id, self.config.server, self.proxy.url)

    async def _preload(self) -> None:
        """Load what the first sample and its first model call would (the recipes; the tokenizer
        and its chat template: a second or more of a core, in which the library holds the GIL)
        before registering, so no sample waits on it and the
        server sees no silence for it. An engine not up yet is no reason not to serve: the first
        model call loads it then."""
        await asyncio.to_thread(recipes.all_recipes)  # what each sample's harness is, read once
        policy = self.proxy.policy
        if policy is None or policy.config.backend_mode == "chat":
            return
        try:
            await asyncio.wait_for(policy.tokenizer(), timeout=120.0)
        except Exception as e:  # the engine's info, or its tokenizer path, not there yet
            log.warning(
                "node %s: tokenizer not loaded ahead (%s); the first model call loads it", self.node_id, e
            )

    async def _register(self, wait: float = 0.0) -> None:
        """Join with the node credential and keep the key the server issues. An id still held by
        a live node (this node's earlier process, say) is waited for up to `wait` seconds."""
        deadline = asyncio.get_running_loop().time() + wait
        while True:
            try:
                reply = await self._post(
                    "/v1/nodes/register",
                    m.NodeRegistration(node_id=self.node_id, url=self.proxy.url, workers=self._workers),
                    credential=self._enroll,
                )
                break
            except NodeRefused as e:
                if e.status != 409 or asyncio.get_running_loop().time() > deadline:
                    raise
                log.warning("node id %s is still held (%s); registering again", self.node_id, e)
                await asyncio.sleep(1.0)
        got = m.Registered.model_validate(reply)
        self._key = got.node_key
        self._apply(got)

    async def serve(self) -> None:
        """Heartbeats (on their own thread) and leases until `stop()` (or cancellation)."""
        self._start_heartbeats()
        try:
            while not self._stop.is_set():
                if self.config.parent_pid is not None and os.getppid() != self.config.parent_pid:
                    log.warning("the process that started node %s is gone: stopping", self.node_id)
                    return
                free = self.capacity - len(self.jobs) - len(self.preparing)
                if free > 0 and not self.control.draining:
                    try:
                        reply = m.LeaseReply.model_validate(
                            await self._post(f"/v1/nodes/{self.node_id}/lease", m.LeaseRequest(capacity=free))
                        )
                    except (aiohttp.ClientError, NodeRefused, TimeoutError) as e:
                        log.warning("lease from %s failed: %s", self.config.server, e)
                        reply = None
                    if reply is not None:
                        self._apply(reply.control)
                        for a in reply.assignments:  # held from now on (heartbeats list them)
                            self.preparing[a.lease] = (a.task_id, a.index)
                        for a in reply.assignments:
                            try:
                                if a.lease in self.preparing:  # not dropped meanwhile
                                    await self._take(a)
                            finally:
                                self.preparing.pop(a.lease, None)
                try:
                    await asyncio.wait_for(self._stop.wait(), self.config.poll_interval)
                except TimeoutError:
                    pass
        finally:
            await self._stop_heartbeats()

    async def stop(self) -> None:
        """Stop taking work; cancel what runs (recorded as cancelled, reported); close."""
        self._stop.set()
        await self._stop_heartbeats()
        if self.pipeline is not None:
            await self.pipeline.close(interrupted=True)
        if self._http is not None:
            await self._http.close()
        if self._beat_http is not None:
            self._beat_http.close()
        await self.proxy.stop()

    async def run(self) -> None:
        await self.start()
        try:
            await self.serve()
        finally:
            await asyncio.shield(self.stop())

    # -- work -----------------------------------------------------------------------------------

    async def _spec(self, a: m.Assignment) -> SampleSpec:
        """What the assignment runs, resolved where the lease enters (once per harness, command,
        runtime); the sample's session carries it, its recipe tagging the session's side calls."""
        runtime = self._runtimes.get(a.runtime)
        if runtime is None:
            runtime = self._runtimes[a.runtime] = make_runtime(a.runtime)
        return await self._specs.get(a.harness, a.harness_cmd, runtime)

    async def _take(self, a: m.Assignment) -> None:
        task = a.task
        update: dict[str, Any] = {}
        if a.agent_timeout_seconds:
            update["agent_timeout_sec"] = a.agent_timeout_seconds
        if a.timeout_seconds:
            update["total_timeout_sec"] = a.timeout_seconds
        if update:
            task = task.model_copy(update=update)
        try:
            assert self.pipeline is not None
            spec = await self._spec(a)
            [job] = await self.pipeline.add(
                task, indices=[a.index], group_id=a.task_id, size=a.num_samples, spec=spec
            )
        except Exception as e:  # the runtime cannot work here, the image is missing, …
            log.warning("sample %s#%d cannot run on %s: %s", a.task_id, a.index, self.node_id, e)
            await self._send(
                m.SampleResult(
                    task_id=a.task_id,
                    index=a.index,
                    lease=a.lease,
                    status="failed",
                    cause=f"node {self.node_id}: {e}",
                    reward=0.0,
                )
            )
            return
        self.jobs[a.lease] = Held(job, a.task_id, a.index, a.builder)

    async def _report(self, job: SampleJob) -> None:
        # The job's own lease: another copy of the same sample (a re-dispatch) has its own.
        lease = next((lease for lease, h in self.jobs.items() if h.job is job), None)
        if lease is None:  # dropped (the server no longer counts it as ours): not reported
            return
        if job.final == "retried":
            return
        rows = await asyncio.to_thread(self._rows, job.session_id, self.jobs[lease].builder)
        timings = {k: round(v, 3) for k, v in job.timings.items()}
        detail = None
        if trainable(job.final):
            detail = {"exit_code": job.outcome.exit_code if job.outcome else None}
        await self._send(
            m.SampleResult(
                task_id=job.group.id,
                index=job.index,
                lease=lease,
                status=job.final or "cancelled",
                cause=job.cause,
                reward=job.reward,
                detail=detail,
                timings=timings,
                session_id=job.session_id,
                rows=rows,
            )
        )
        self.jobs.pop(lease, None)

    def _rows(self, session_id: str, builder: str) -> list[dict[str, Any]]:
        rows = iter_trajectories(self.config.db, strategy=builder, selection=Selection(session=session_id))
        return [r.to_row() for r in rows]

    async def _send(self, result: m.SampleResult) -> None:
        """Report a finished sample; an unreachable server is tried again for about 10 minutes,
        and after that the report is dropped (logged): the server runs the sample again."""
        try:
            await Backoff(
                f"reporting {result.task_id}#{result.index}",
                attempts=REPORT_ATTEMPTS,
                first=0.5,
                cap=REPORT_PAUSE_CAP,
                retry_on=(aiohttp.ClientError, TimeoutError),
                log=log,
                level=logging.INFO,  # the heartbeat's warning says the server is unreachable
            ).call_async(lambda: self._post(f"/v1/nodes/{self.node_id}/results", result))
        except NodeRefused as e:
            log.warning("server refused %s#%d: %s", result.task_id, result.index, e)
            # stale lease (re-dispatched elsewhere) or a bad report: never retried
        except (aiohttp.ClientError, TimeoutError):
            pass  # given up, and logged so

    # -- control --------------------------------------------------------------------------------

    def _apply(self, c: m.Control) -> None:
        policy = self.proxy.policy
        if policy is not None:
            if c.paused and policy.gate.is_set():
                log.info("pausing generation (weight update)")
                policy.pause()
            elif not c.paused and not policy.gate.is_set():
                log.info("resuming generation (weight version %s)", c.weight_version)
                policy.resume()
        cancel = set(c.cancel)
        for held in list(self.jobs.values()):
            if (held.task_id, held.index) in cancel and self.pipeline is not None:
                self.pipeline.cancel(held.job, "cancelled by the server")
        for lease in c.drop:
            # Fenced: the server gave this lease up (it declared us lost, or repaired the
            # sample); the sample may run elsewhere now, so this copy stops and is not reported.
            self.preparing.pop(lease, None)
            gone = self.jobs.pop(lease, None)
            if gone is not None:
                log.warning("dropping %s#%d (lease %s): the server no longer counts it as ours",
                            gone.task_id, gone.index, lease[:8])  # fmt: skip
                if self.pipeline is not None:
                    self.pipeline.cancel(gone.job, "dropped: the server gave its lease up")
        self.control = c

    def load(self) -> m.Heartbeat:
        """The heartbeat's body; read from the heartbeat thread, so it copies what it walks
        (a dict copy runs whole under the GIL) and changes nothing."""
        jobs, preparing = dict(self.jobs), dict(self.preparing)
        counts = self.pipeline.counts if self.pipeline is not None else {}
        stages = {
            "init": m.StageLoad(queued=counts.get("queued", 0), in_flight=counts.get("starting", 0)),
            "ready": m.StageLoad(queued=counts.get("ready", 0), in_flight=0),
            "run": m.StageLoad(queued=0, in_flight=counts.get("running", 0)),
            "postrun": m.StageLoad(queued=0, in_flight=counts.get("scoring", 0)),
        }
        policy = self.proxy.policy
        gateway = self.proxy.gateway
        return m.Heartbeat(
            stages=stages,
            generating=policy.generating if policy else 0,
            paused=bool(policy and not policy.gate.is_set()),
            turns=gateway.turns_served if gateway else 0,
            samples=[(h.task_id, h.index, h.job.stage) for h in jobs.values()]
            + [(t, i, "preparing") for t, i in preparing.values()],
            leases=[*jobs, *preparing],
        )

    # -- liveness -------------------------------------------------------------------------------

    def _start_heartbeats(self) -> None:
        self._beat_stop.clear()
        self._beating = threading.Thread(
            target=self._heartbeats,
            args=(asyncio.get_running_loop(),),
            name=f"heartbeats-{self.node_id}",
            daemon=True,
        )
        self._beating.start()

    async def _stop_heartbeats(self) -> None:
        self._beat_stop.set()
        if self._beating is not None:
            # Bounded: a heartbeat stuck on a hung server is a daemon thread, gone with the process.
            await asyncio.to_thread(self._beating.join, 5.0)
            self._beating = None

    def _heartbeats(self, loop: asyncio.AbstractEventLoop) -> None:
        """The heartbeat thread: a load snapshot, a POST with a client of its own, the reply's
        switches handed to the event loop. Nothing here waits on the loop, so a loop busy with
        the node's work delays what the reply asks (a pause, a drop), never the heartbeat."""
        url = f"{self.config.server.rstrip('/')}/v1/nodes/{self.node_id}/heartbeat"
        registering: Any = None
        http = self._beat_http
        assert http is not None, "start the node first"
        while not self._beat_stop.is_set():
            try:
                r = http.post(
                    url,
                    content=self.load().model_dump_json(),
                    headers={"authorization": f"Bearer {self._key or self._enroll}",
                             "content-type": "application/json"},
                )  # fmt: skip
                if r.status_code == 404:  # the server forgot us (a new database): register again
                    if registering is None or registering.done():
                        registering = asyncio.run_coroutine_threadsafe(self._register(), loop)
                elif r.status_code >= 400:
                    log.warning("heartbeat refused: HTTP %d: %s", r.status_code, r.text[:500])
                else:
                    loop.call_soon_threadsafe(self._apply, m.Control.model_validate_json(r.content))
            except httpx.HTTPError as e:
                log.warning("heartbeat to %s failed: %s", self.config.server, e)
            except Exception:
                if loop.is_closed():  # the node is stopping
                    return
                # Anything else (a reply it cannot read, say) costs this heartbeat, never the
                # thread: a thread that ended would have the live node declared lost.
                log.exception("heartbeat of %s", self.node_id)
            # Fast while paused, so a pause drains promptly.
            self._beat_stop.wait(
                min(self.config.heartbeat_interval, 0.2)
                if self.control.paused
                else self.config.heartbeat_interval
            )


class NodeRefused(RuntimeError):
    def __init__(self, status: int, message: str):
        super().__init__(f"HTTP {status}: {message}")
        self.status = status
