"""The rollout service's control plane at scale: the real `polar-mitm serve` and N real
`polar-mitm node` processes on this machine, S samples in groups of 8, a trainer that submits
them all at once (`--submitters` at a time over `AsyncRolloutClient`) and collects every group with
the client (`RolloutClient.wait`), and two subscribers to the event stream, one of them slow.

First calls are measured: there is no warm-up. The nodes register and the clock starts; each
node's first lease, first harness and (with `--rows session`) its first model call through its
proxy fall inside the measured time.

A sample is instant but its report is not small: with `--rows session` (the default) the
harness (the `local` runtime, a shell line) posts the first request of the captured Claude Code
session (`bench/fixtures/claude_code_session.jsonl.zst`: 11.6k prompt tokens) through its node's
proxy once, and the fake backend answers at once with ~15k tokens, so the node builds and reports
a row of that session's shape (11.6k prompt + 14.8k response tokens with mask and logprobs);
`--rows none` writes the instruction and makes no model call (no rows: the control plane alone).

Printed: samples/s; the submit phase (wall time, each submit's round trip as the client saw it,
the client's own CPU); the server's CPU per sample (and the rate one core of it would carry); the
p50/p99 of the lease and result calls as the server timed them (`/metrics`); the server's RSS,
CPU and the store's size over time; the parquet export of every group; what each subscriber of
`/v1/events` received; the samples dispatched more than once and the server's repairs.

    nice .venv/bin/python bench/bench_scale.py [--samples 10000] [--nodes 16] [--rows session|none]
        [--submitters 32]  # submits in flight at once; 1: one after another (the sync client)
        [--profile]   # py-spy on the server (pip install py-spy), its busiest frames at the end
        [--ray 3]     # the nodes as Ray actors (`serve --ray`) on a local cluster: `ray start
                      # --head` and 3 `ray start --address` workers, every one on 127.0.0.1

With `--ray W` the same samples run on a Ray cluster of this machine's own: a head and W workers,
each a `ray start --block` with its own temp dir and its share of the actors' CPUs, all on
127.0.0.1 (Ray on Linux replaces a loopback `--node-ip-address` with the machine's address and
listens on every interface; the bench runs `ray start` with that lookup pinned to 127.0.0.1, as
`serve --ray local` does for its own Ray). `serve --ray 127.0.0.1:PORT --nodes N` places the
nodes; the cluster is stopped at the end, on failure too (each `ray start` is a session of its
own: every process left in it is killed).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from _procs import Profile, _start, ensure_ca, free_port, start_fake, workdir  # noqa: E402
from bench_request_storage import load_session  # noqa: E402

from polar_mitm import procs  # noqa: E402
from polar_mitm.backends.tokenizer_build import ensure_tokenizer  # noqa: E402
from polar_mitm.client import AsyncRolloutClient, RolloutClient  # noqa: E402
from polar_mitm.service.ray_nodes import SINGLE_NODE_ENV  # noqa: E402
from polar_mitm.tasks.model import EvaluatorSpec, Task  # noqa: E402

SESSION = ROOT / "bench" / "fixtures" / "claude_code_session.jsonl.zst"
REPLY_TOKENS = 14_800  # the captured session's response part (its last prompt less its first)
INSTANT = ["sh", "-c", 'echo "$1" > out.txt', "harness", "{instruction}"]


def session_harness(body: Path) -> list[str]:
    """One model call through the node's proxy (curl, the proxy's CA), then the instruction."""
    call = (
        'curl -sS --fail -o /dev/null --cacert "$SSL_CERT_FILE" -H "content-type: application/json"'
        ' -H "x-api-key: k" -H "anthropic-version: 2023-06-01"'
        f" --data-binary @{body} https://api.anthropic.com/v1/messages"
    )
    return ["sh", "-c", call + ' && echo "$1" > out.txt', "harness", "{instruction}"]


def session_body(work: Path) -> Path:
    """The captured session's first request, answered whole (no stream) and long enough."""
    first = load_session(SESSION)[0]
    body = json.loads(first["request"])
    body.update(stream=False, max_tokens=REPLY_TOKENS + 200)
    path = work / "request.json"
    path.write_text(json.dumps(body))
    return path


def long_reply(tokenizer: Path, tokens: int) -> str:
    """Source text of this repository cut to `tokens` tokens: what the fake backend answers."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer / "tokenizer.json"))
    text = ""
    for f in sorted((ROOT / "polar_mitm" / "store").glob("*.py")) * 4:
        text += f.read_text()
        if len(tok.encode(text).ids) > tokens:
            break
    ids = tok.encode(text).ids[:tokens]
    out = tok.decode(ids)
    assert "<tool_call>" not in out and "<think>" not in out
    return out


# -- what the server did ----------------------------------------------------------------------


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of the process (all its threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def tree_cpu_s(pid: int) -> float:
    """The process's CPU seconds and its reaped children's (a node's harnesses and evaluators)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return sum(int(f) for f in fields[11:15]) / os.sysconf("SC_CLK_TCK")


def store_mb(db: Path) -> float:
    return sum(p.stat().st_size for p in db.parent.glob(db.name + "*")) / 2**20


def quantile(buckets: list[tuple[float, float]], q: float) -> float:
    """histogram_quantile: linear inside the bucket that holds the q-th observation."""
    total = buckets[-1][1]
    if total == 0:
        return float("nan")
    rank, lo_le, lo_n = q * total, 0.0, 0.0
    for le, n in buckets:
        if n >= rank:
            if le == float("inf"):
                return lo_le
            return lo_le + (le - lo_le) * (rank - lo_n) / max(n - lo_n, 1e-9)
        lo_le, lo_n = le, n
    return lo_le


def route_times(metrics: str) -> dict[str, tuple[int, float, float, float]]:
    """route → (calls, mean, p50, p99) seconds from `polar_service_request_seconds`."""
    buckets: dict[str, list[tuple[float, float]]] = {}
    sums: dict[str, float] = {}
    for line in metrics.splitlines():
        m = re.match(r'polar_service_request_seconds_bucket\{le="([^"]+)",route="([^"]+)"\} (\S+)', line)
        if m:
            buckets.setdefault(m[2], []).append((float(m[1]), float(m[3])))
        m = re.match(r'polar_service_request_seconds_sum\{route="([^"]+)"\} (\S+)', line)
        if m:
            sums[m[1]] = float(m[2])
    out = {}
    for route, b in buckets.items():
        b.sort()
        n = int(b[-1][1])
        out[route] = (n, sums.get(route, 0.0) / max(n, 1), quantile(b, 0.5), quantile(b, 0.99))
    return out


def submit_all(
    url: str, token: str, tasks: list[Task], submitters: int, **kw: Any
) -> tuple[list[str], list[float], float]:
    """Submit every task, `submitters` at a time, as a trainer hands over a step's tasks: task ids
    in the tasks' order, each submit's round trip (s) and the CPU this thread spent.

    On a loaded machine (load average 13-25) a submit costs the client 1.5-3 ms of CPU but its
    round trip is 27-60 ms at the median and up to 260 ms at p99 (the scheduler runs the server,
    then the client); one after another, 1,250 such waits take 60-95 s. With several in flight
    over one connection pool the waits overlap (26-29 s, 32 at a time). `submitters=1` is the
    sync client's one-after-another loop, as the bench did before."""
    lat: list[float] = []
    c0 = time.thread_time()
    if submitters <= 1:
        ids = []
        with RolloutClient(url, token=token, timeout=300) as client:
            for t in tasks:
                s0 = time.monotonic()
                ids.append(client.submit(t, **kw))
                lat.append(time.monotonic() - s0)
        return ids, lat, time.thread_time() - c0

    async def submit(client: AsyncRolloutClient, gate: asyncio.Semaphore, task: Task) -> str:
        async with gate:
            s0 = time.monotonic()
            task_id = await client.submit(task, **kw)
            lat.append(time.monotonic() - s0)
            return task_id

    async def run() -> list[str]:
        gate = asyncio.Semaphore(submitters)
        async with AsyncRolloutClient(url, token=token, timeout=300) as client:
            return list(await asyncio.gather(*(submit(client, gate, t) for t in tasks)))

    ids = asyncio.run(run())
    return ids, lat, time.thread_time() - c0


def twice_dispatched(db: Path) -> int:
    """Samples the server dispatched more than once (a node lost or a lease repaired)."""
    import sqlite3

    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=30)
    try:
        return con.execute("SELECT COUNT(*) FROM service_samples WHERE dispatches > 1").fetchone()[0]
    finally:
        con.close()


def repairs(metrics: str) -> int:
    """`polar_service_repairs_total`, every reason and action together."""
    return int(
        sum(float(m[1]) for m in re.finditer(r"^polar_service_repairs_total\{[^}]*\} (\S+)", metrics, re.M))
    )


class Subscriber(threading.Thread):
    """`GET /v1/events` over a raw socket, read at `rate` bytes/s at most (None: as fast as it
    comes); counts the events it received."""

    def __init__(self, port: int, token: str, rate: float | None):
        super().__init__(daemon=True)
        self.port, self.token, self.rate = port, token, rate
        self.events = 0
        self.bytes = 0
        self.stop = threading.Event()

    def run(self) -> None:
        s = socket.create_connection(("127.0.0.1", self.port))
        if self.rate is not None:  # a small window, so the server's writes back up soon
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.sendall(
            f"GET /v1/events HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {self.token}\r\n\r\n".encode()
        )
        s.settimeout(1.0)
        chunk = 4096 if self.rate is None else 1024
        while not self.stop.is_set():
            try:
                data = s.recv(chunk)
            except TimeoutError:
                continue
            if not data:
                break
            self.bytes += len(data)
            self.events += data.count(b"\ndata: ")
            if self.rate is not None:
                time.sleep(len(data) / self.rate)
        s.close()


class Monitor(threading.Thread):
    """Every `every` seconds: finished samples, the server's RSS and CPU, the store's size."""

    def __init__(self, pid: int, db: Path, every: float):
        super().__init__(daemon=True)
        self.pid, self.db, self.every = pid, db, every
        self.curve: list[tuple[float, int, float, float, float]] = []
        self.stop = threading.Event()
        self.t0 = time.monotonic()

    def finished(self) -> int:
        import sqlite3

        con = sqlite3.connect(f"file:{self.db}?mode=ro", uri=True, timeout=30)
        try:
            return con.execute("SELECT COUNT(*) FROM service_samples WHERE state = 'finished'").fetchone()[0]
        finally:
            con.close()

    def point(self) -> None:
        self.curve.append(
            (
                time.monotonic() - self.t0,
                self.finished(),
                rss_mb(self.pid),
                cpu_s(self.pid),
                store_mb(self.db),
            )
        )

    def run(self) -> None:
        while not self.stop.wait(self.every):
            self.point()


# -- a Ray cluster of this machine's own -----------------------------------------------------

# `ray start`, with the node's address pinned to 127.0.0.1 (see the module's docstring).
_RAY_START = """
import sys
import ray._private.services as services
services.get_node_ip_address = lambda address=None: "127.0.0.1"
from ray.scripts.scripts import main
sys.argv = ["ray", *sys.argv[1:]]
main()
"""


def session_members(sid: int) -> list[int]:
    """Every live process whose session is `sid` (what a `start_new_session` child started)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if int(fields[3]) == sid and fields[0] != "Z":
                found.append(int(entry.name))
    return found


class RayCluster:
    """A head and `workers` worker nodes, each a `ray start --block` of its own session with its
    own temp dir, `cpus` logical CPUs each, on 127.0.0.1. `stop()` ends every process of theirs."""

    def __init__(self, work: Path, workers: int, cpus: int):
        self.work, self.workers, self.cpus = work, workers, cpus
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.starts: list[subprocess.Popen] = []
        self.temps: list[str] = []

    def _start(self, name: str, *args: str) -> None:
        import tempfile

        temp = tempfile.mkdtemp(prefix="pmray", dir="/tmp")  # Ray's socket paths must stay short
        self.temps.append(temp)
        argv = [sys.executable, "-c", _RAY_START, "start", *args, "--node-ip-address", "127.0.0.1",
                "--num-cpus", str(self.cpus), "--object-store-memory", str(256 * 2**20),
                "--disable-usage-stats", "--temp-dir", temp, "--block"]  # fmt: skip
        log = (self.work / f"ray-{name}.log").open("w")
        env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_TMPDIR")}
        self.starts.append(
            subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        )

    def start(self, timeout: float = 300) -> None:
        self._start("head", "--head", "--port", str(self.port), "--include-dashboard", "false")
        self.wait(1, timeout)
        for i in range(self.workers):
            self._start(f"worker{i}", "--address", self.address)
        self.wait(1 + self.workers, timeout)

    def alive_nodes(self) -> int:
        out = subprocess.run(
            [sys.executable, "-c", "import ray, sys; ray.init(address=sys.argv[1], logging_level='ERROR');"
             " print(sum(n['Alive'] for n in ray.nodes()))", self.address],
            capture_output=True, text=True, timeout=120, env={**os.environ, SINGLE_NODE_ENV: "0"},
        )  # fmt: skip
        lines = out.stdout.strip().splitlines()
        return int(lines[-1]) if out.returncode == 0 and lines and lines[-1].isdigit() else 0

    def wait(self, n: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while self.alive_nodes() < n:
            dead = [p.args for p in self.starts if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                raise RuntimeError(f"the Ray cluster did not reach {n} nodes; logs in {self.work}/ray-*.log")
            time.sleep(1)

    def stop(self) -> None:
        for p in reversed(self.starts):  # workers first, the head last
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in reversed(self.starts):
            procs.stop(p, 20, group=True)
            for pid in session_members(p.pid):  # one that left the group (Ray's workers do)
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        import shutil

        for temp in self.temps:
            shutil.rmtree(temp, ignore_errors=True)


# -- the run ----------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=10_000)
    ap.add_argument("--nodes", type=int, default=16)
    ap.add_argument("--group", type=int, default=8, help="samples per task (a GRPO group)")
    ap.add_argument("--rows", choices=("session", "none"), default="session")
    ap.add_argument("--capacity", type=int, default=4, help="samples each node holds at most")
    ap.add_argument("--slow-rate", type=float, default=2048, help="the slow subscriber's bytes/s")
    ap.add_argument("--every", type=float, default=10.0, help="seconds between points of the curve")
    ap.add_argument(
        "--submitters", type=int, default=32, help="submits in flight at once (1: one after another)"
    )
    ap.add_argument("--profile", action="store_true", help="py-spy the server while the samples run")
    ap.add_argument("--keep", action="store_true", help="keep the work directory")
    ap.add_argument(
        "--ray",
        type=int,
        default=None,
        metavar="W",
        help="the nodes as Ray actors (`serve --ray`) on a local cluster: a head and W workers",
    )
    a = ap.parse_args()
    groups = a.samples // a.group
    total = groups * a.group
    work = workdir("polar-scale-")
    token = "bench-scale-token"
    os.environ.update(POLAR_MITM_SERVICE_TOKEN=token, XDG_CONFIG_HOME=str(work / "config"))
    tok = ensure_tokenizer("qwen")
    ensure_ca(work)
    started: list[Any] = []  # the fake backend, the server
    nodes: list[subprocess.Popen] = []
    if a.ray is not None:
        # One authentication mode for the cluster and every client of it: Ray 2.60's head turns
        # token authentication on where ~/.ray/auth_token exists, and a client that connects by
        # address (the bench's count of alive nodes, serve) does not, and is refused.
        os.environ["RAY_AUTH_MODE"] = "disabled"
    cluster = RayCluster(work, a.ray, math.ceil(a.nodes / (a.ray + 1))) if a.ray is not None else None
    try:
        if cluster:
            cluster.start()
        if a.rows == "session":
            script = [{"match": "", "text": long_reply(tok, REPLY_TOKENS)}]
            fake = start_fake(work, tokenizer_path=str(tok), script=script)
            cmd = session_harness(session_body(work))
        else:
            fake = start_fake(work, tokenizer_path=str(tok))
            cmd = INSTANT
        started.append(fake.popen)
        db = work / "service.sqlite"
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        argv = [sys.executable, "-m", "polar_mitm", "serve", "--listen", f"127.0.0.1:{port}",
                "--allow-local-runtime", "--db", str(db)]  # fmt: skip
        if cluster:  # serve places the nodes, with the same options a node process is given
            argv += ["--ray", cluster.address, "--nodes", str(a.nodes), "--backend", fake.url,
                     "--tokenizer", str(tok), "--certs", str(work / "certs"), "--capacity", str(a.capacity)]  # fmt: skip
            os.environ[SINGLE_NODE_ENV] = "0"  # the driver's own address: 127.0.0.1, like the cluster's
        else:
            argv += ["--nodes", "0"]
        server, _ = _start(argv, "rollout server on", work / "serve.log")
        started.append(server)
        for i in range(a.nodes if not cluster else 0):
            argv = [sys.executable, "-m", "polar_mitm", "node", "--server", url, "--node-id", f"n{i}",
                    "--backend", fake.url, "--tokenizer", str(tok), "--db", str(work / f"node{i}.sqlite"),
                    "--certs", str(work / "certs"), "--capacity", str(a.capacity)]  # fmt: skip
            log = (work / f"node{i}.log").open("w")
            nodes.append(subprocess.Popen(argv, stdout=log, stderr=log, start_new_session=True))
        http = httpx.Client(base_url=url, headers={"authorization": f"Bearer {token}"}, timeout=300)
        deadline = time.monotonic() + 300
        while len([n for n in http.get("/v1/nodes").json() if n["healthy"]]) < a.nodes:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the nodes did not all register; logs in {work}")
            time.sleep(0.5)
        fast, slow = Subscriber(port, token, None), Subscriber(port, token, a.slow_rate)
        fast.start()
        slow.start()
        time.sleep(0.5)
        rss0 = rss_mb(server.pid)
        monitor = Monitor(server.pid, db, a.every)
        client = RolloutClient(url, token=token, timeout=300)
        cpu0 = cpu_s(server.pid)
        bench0, nodes0 = time.process_time(), sum(tree_cpu_s(n.pid) for n in nodes)
        profile = Profile(server.pid, work / "server.pyspy.txt", rate=100) if a.profile else None
        if profile:
            profile.__enter__()
        t0 = time.monotonic()
        monitor.t0 = t0
        monitor.start()
        evaluator = EvaluatorSpec(kind="command", command="grep -q pass out.txt")
        tasks = [Task(id=f"g{i:05d}", instruction="pass", evaluator=evaluator) for i in range(groups)]
        ids, submit_lat, submit_cpu = submit_all(
            url, token, tasks, a.submitters, samples=a.group, harness="claude-code", runtime="local",
            harness_cmd=cmd,
        )  # fmt: skip
        submitted = time.monotonic() - t0
        rows = completed = passed = 0
        tokens = 0
        for g in client.wait(ids, poll=1.0, timeout=24 * 3600):
            completed += sum(o.status == "completed" for o in g.outcomes)
            passed += sum(o.reward == 1.0 for o in g.outcomes)
            rows += len(g.samples)
            tokens += sum(len(s.tokens) for s in g.samples)
        elapsed = time.monotonic() - t0
        if profile:
            profile.__exit__(None, None, None)
        monitor.stop.set()
        monitor.join()
        monitor.point()
        cpu = cpu_s(server.pid) - cpu0
        bench_cpu = time.process_time() - bench0  # the trainer's side: submit, wait, subscribers
        nodes_cpu = sum(tree_cpu_s(n.pid) for n in nodes) - nodes0
        metrics_text = http.get("/metrics").text
        times = route_times(metrics_text)
        repaired = repairs(metrics_text)
        twice = twice_dispatched(db)
        # The export: every group's parquet, one after another (what a trainer fetches).
        e0 = time.monotonic()
        parquet_bytes = sum(
            len(http.get(f"/v1/tasks/{t}/results", params={"format": "parquet"}).content) for t in ids
        )
        export = time.monotonic() - e0
        listing0 = time.monotonic()
        http.get("/v1/tasks").raise_for_status()
        listing = time.monotonic() - listing0
        time.sleep(2)
        fast.stop.set()
        slow.stop.set()
        per_sample_events = 2  # dispatched + finished, besides the tasks' own
        load = os.getloadavg()
    finally:
        for p in nodes:
            procs.stop(p, 15, group=True)
        for p in reversed(started):
            procs.stop(p, 15)
        if cluster:
            cluster.stop()

    nice = os.nice(0)
    placed = (
        f"{a.nodes} Ray actors on a local cluster (a head and {a.ray} workers, {cluster.cpus} CPUs each)"
        if cluster
        else f"{a.nodes} node processes"
    )
    print(
        f"\n{total:,} samples ({groups:,} groups of {a.group}), {placed} (capacity"
        f" {a.capacity} each), rows: {a.rows}; {os.cpu_count()} cores shared with other work (load"
        f" average at the end {load[0]:.1f}), nice {nice}; work dir {work}"
    )
    print(
        "no warm-up: the clock starts once the nodes register, so every node's first lease and"
        " harness (with --rows session its first model call too) are measured"
    )
    print(
        f"completed {completed:,}/{total:,}, reward 1 (the harness's call answered) {passed:,};"
        f" {rows:,} rows, {tokens:,} tokens"
    )
    print("\n| measure | value |\n|---|---|")
    print(f"| samples/s (submit to the last group collected) | {total / elapsed:.1f} ({elapsed:.0f} s) |")
    submit_lat.sort()
    how = "one after another" if a.submitters <= 1 else f"{a.submitters} at a time"
    print(
        f"| submitting {groups:,} tasks ({how}) | {submitted:.1f} s ({groups / submitted:.0f} tasks/s);"
        f" a submit's round trip p50 / p99 {1000 * submit_lat[len(submit_lat) // 2]:.1f} /"
        f" {1000 * submit_lat[int(len(submit_lat) * 0.99)]:.1f} ms; the client's CPU"
        f" {1000 * submit_cpu / groups:.1f} ms a submit |"
    )
    print(
        f"| server CPU per sample | {1000 * cpu / total:.1f} ms ({cpu:.0f} s in all; one core of it:"
        f" {total / max(cpu, 1e-9):.0f} samples/s) |"
    )
    print(
        "| the nodes' CPU per sample (theirs and their harnesses', evaluators') | "
        + (f"{1000 * nodes_cpu / total:.1f} ms ({nodes_cpu:.0f} s in all) |" if nodes else "not read (Ray) |")
    )
    print(
        f"| the bench's own CPU per sample (submit, wait, subscribers) | {1000 * bench_cpu / total:.1f} ms |"
    )
    for route, label in (
        ("POST /v1/nodes/{node_id}/lease", "lease"),
        ("POST /v1/nodes/{node_id}/results", "result"),
        ("POST /v1/nodes/{node_id}/heartbeat", "heartbeat"),
        ("GET /v1/tasks/{task_id}", "task status (the client's poll)"),
        ("GET /v1/tasks/{task_id}/results", "group results"),
        ("POST /v1/tasks", "submit"),
    ):
        n, mean, p50, p99 = times.get(route, (0, 0.0, 0.0, 0.0))
        print(
            f"| {label} calls: p50 / p99 / mean (server-side) | {1000 * p50:.1f} / {1000 * p99:.1f} /"
            f" {1000 * mean:.1f} ms over {n:,} |"
        )
    print(f"| server RSS before / after | {rss0:.0f} / {rss_mb_last(monitor):.0f} MB |")
    print(
        f"| store at the end | {monitor.curve[-1][4]:.0f} MB ({1024 * monitor.curve[-1][4] / total:.0f} kB"
        " per sample) |"
    )
    print(
        f"| parquet export, every group (`GET …/results?format=parquet`) | {export:.1f} s"
        f" ({1000 * export / groups:.1f} ms a group, {parquet_bytes / 2**20:.0f} MB) |"
    )
    print(f"| `GET /v1/tasks` (every task) at the end | {listing:.2f} s |")
    print(f"| samples dispatched more than once / the server's repairs | {twice:,} / {repaired:,} |")
    expected = total * per_sample_events
    print(
        f"| events: a fast subscriber / a slow one ({a.slow_rate:.0f} B/s) | {fast.events:,} /"
        f" {slow.events:,} (≥ {expected:,} published) |"
    )
    print("\nover time (server):\n\n| s | finished | RSS MB | CPU s | store MB | store kB/sample |")
    print("|---|---|---|---|---|---|")
    for t, n, rss, c, size in monitor.curve:
        print(
            f"| {t:.0f} | {n:,} | {rss:.0f} | {c - cpu0:.0f} | {size:.0f} | {1024 * size / max(n, 1):.0f} |"
        )
    if profile:
        profile.print_top(40)
    if not a.keep:
        import shutil

        shutil.rmtree(work, ignore_errors=True)


def rss_mb_last(monitor: Monitor) -> float:
    return monitor.curve[-1][2] if monitor.curve else 0.0


if __name__ == "__main__":
    main()
