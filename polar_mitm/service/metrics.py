"""`GET /metrics`: the service in Prometheus text format (`prometheus-client`).

Samples by state and status, and each node's queue depth and in-flight count per stage, are read
from the store and the last heartbeats at scrape time; turns served, samples finished and the
seconds each stage took (sandbox start among them) are counted as results arrive, the samples
the server repaired (given up by their node or past their deadline) as it repairs them; the seconds
the server took to answer each route (a node's lease and result calls among them) as it answers.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily


class Observed(Protocol):
    """What the gauges read at scrape time: the server's store, last heartbeats and healthy nodes
    (public parts only: metrics import nothing of the server)."""

    store: Any

    @property
    def heartbeats(self) -> dict[str, Any]: ...

    @property
    def longest_silence(self) -> dict[str, float]: ...

    def healthy_nodes(self) -> list[str]: ...


STAGE_BUCKETS = (0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600, 1800, 3600)
# A route's answer: from half a millisecond (a heartbeat) to seconds (a large group's parquet).
REQUEST_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 30)


class _Live:
    """Gauges computed at scrape time from the store and the heartbeats."""

    def __init__(self, server: Observed):
        self.server = server

    def collect(self):
        samples = GaugeMetricFamily(
            "polar_samples", "Samples by state and outcome", labels=["state", "status"]
        )
        for (state, status), n in self.server.store.counts().items():
            samples.add_metric([state, status or ""], n)
        yield samples
        queue = GaugeMetricFamily(
            "polar_node_stage_queue", "Samples waiting per node and stage", labels=["node", "stage"]
        )
        flight = GaugeMetricFamily(
            "polar_node_stage_in_flight", "Samples in flight per node and stage", labels=["node", "stage"]
        )
        gen = GaugeMetricFamily("polar_node_generating", "Generations under way per node", labels=["node"])
        turns = GaugeMetricFamily("polar_node_turns", "Turns served since the node started", labels=["node"])
        for node, hb in self.server.heartbeats.items():
            for stage, load in hb.stages.items():
                queue.add_metric([node, stage], load.queued)
                flight.add_metric([node, stage], load.in_flight)
            gen.add_metric([node], hb.generating)
            turns.add_metric([node], hb.turns)
        yield from (queue, flight, gen, turns)
        silence = GaugeMetricFamily(
            "polar_node_heartbeat_silence_max_seconds",
            "The longest a node went without a heartbeat (since its registration), seen by this server",
            labels=["node"],
        )
        for node, secs in self.server.longest_silence.items():
            silence.add_metric([node], secs)
        yield silence
        healthy = GaugeMetricFamily("polar_nodes_healthy", "Nodes with a recent heartbeat")
        healthy.add_metric([], len(self.server.healthy_nodes()))
        yield healthy
        paused = GaugeMetricFamily(
            "polar_generation_paused", "1 while generation is paused for a weight update"
        )
        paused.add_metric([], 1 if self.server.store.get("paused") == "1" else 0)
        yield paused


class Metrics:
    def __init__(self, server: Observed):
        self.registry = CollectorRegistry()
        self.registry.register(_Live(server))
        self.submitted = Counter("polar_tasks_submitted", "Tasks submitted", registry=self.registry)
        self.samples_finished = Counter(
            "polar_samples_finished", "Samples finished, by outcome", ["status"], registry=self.registry
        )
        self.repairs = Counter(
            "polar_service_repairs",
            "Dispatched samples the server gave up (reason: unheld, deadline, node_lost), by what"
            " became of them (requeued, failed, cancelled)",
            ["reason", "action"],
            registry=self.registry,
        )
        self.stage_seconds = Histogram(
            "polar_sample_stage_seconds",
            "Seconds a sample spent per stage (starting = sandbox start)",
            ["stage"],
            buckets=STAGE_BUCKETS,
            registry=self.registry,
        )
        self.request_seconds = Histogram(
            "polar_service_request_seconds",
            "Seconds the server took to answer a request, by route (method and path template)",
            ["route"],
            buckets=REQUEST_BUCKETS,
            registry=self.registry,
        )

    def finished(self, status: str, timings: dict[str, float]) -> None:
        self.samples_finished.labels(status).inc()
        for stage, secs in timings.items():
            self.stage_seconds.labels(stage).observe(secs)

    @web.middleware
    async def timed(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        """Each answer's seconds, by the route's template (`POST /v1/nodes/{node_id}/lease`), so
        an operator reads the lease and result calls' p99 at scale (`histogram_quantile`)."""
        t0 = time.perf_counter()
        try:
            return await handler(request)
        finally:
            resource = request.match_info.route.resource
            route = f"{request.method} {resource.canonical}" if resource is not None else "unmatched"
            self.request_seconds.labels(route).observe(time.perf_counter() - t0)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    async def metrics_text(self, request: web.Request) -> web.Response:
        """`GET /metrics`."""
        body, ctype = self.render()
        return web.Response(body=body, headers={"content-type": ctype})
