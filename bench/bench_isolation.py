"""What a sandbox's isolation costs: start time and per-turn latency, channel vs host network.

Two ways a Docker sandbox reaches the proxy, in one run, against the same proxy and fake backend:
"host", the host's network (as before isolation), the harness straight to the proxy's port; and
"channel", no network, the sample's Unix socket channel and the forwarder inside. Each with our
node mounted (what JavaScript harnesses get; the forwarder runs on it) and without (the forwarder
runs on the image's python3).

Start: --starts sandboxes started and stopped one after another (`runtime.start`: the
container, its workdir; with a channel, the socket too), median seconds; "ready" is how long after
that the forwarder said it listens (the harness waits for it; it starts later as a rule). Per turn: a client inside the sandbox (python3) makes
--turns model calls (Anthropic Messages through HTTPS_PROXY, TLS to the gateway), over one
kept-alive tunnel and with a new tunnel per call, the modes taking turns in rounds so that the
machine's other load weighs on each alike; median milliseconds per call, and what the
channel adds to the host network's median. Prints figures and ratios; asserts nothing.

    .venv/bin/python bench/bench_isolation.py [--starts 8] [--turns 60]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from polar_mitm.backends.tokenizer_build import ensure_tokenizer
from polar_mitm.fake import FakeBackendConfig, start_fake_backend
from polar_mitm.policy import PolicyConfig
from polar_mitm.proxy.embedded import PolarProxy, ProxyConfig, proxy_url
from polar_mitm.sandbox.base import HarnessMount, SandboxSpec
from polar_mitm.sandbox.channel import Channel
from polar_mitm.sandbox.docker import DockerRuntime
from polar_mitm.tasks.model import Task

CLIENT = r"""
import base64, http.client, json, os, ssl, sys, time
proxy, n, fresh = os.environ["P"], int(sys.argv[1]), sys.argv[2] == "fresh"
creds, hostport = proxy.split("://", 1)[1].rsplit("@", 1)
host, port = hostport.rsplit(":", 1)
auth = {"Proxy-Authorization": "Basic " + base64.b64encode(creds.encode()).decode()}
ctx = ssl.create_default_context(cafile=os.environ["CA"])
body = json.dumps({"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
headers = {"content-type": "application/json", "x-api-key": "k", "anthropic-version": "2023-06-01"}
def connect():
    c = http.client.HTTPSConnection(host, int(port), context=ctx, timeout=30)
    c.set_tunnel("api.anthropic.com", 443, headers=auth)
    return c
conn, out = connect(), []
for i in range(n):
    t = time.perf_counter()
    if fresh and i:
        conn.close()
        conn = connect()
    conn.request("POST", "/v1/messages", body, headers)
    r = conn.getresponse()
    r.read()
    assert r.status == 200, r.status
    out.append(time.perf_counter() - t)
print(json.dumps(out))
"""

IMAGE = "polar-mitm/rollout-base:bookworm"


def node_mount(tmp: Path) -> HarnessMount | None:
    node = shutil.which("node")
    return HarnessMount(modules=tmp, bin=tmp, node=Path(node).resolve()) if node else None


async def start_one(rt: DockerRuntime, proxy: PolarProxy, work: Path, mode: str, k: int):
    """A sandbox for `mode`, its channel (or None), the proxy URL its harness gets, and the
    seconds of `runtime.start` and of the wait for the forwarder after it."""
    session = f"s_bench_{mode.replace('/', '_')}_{k}_{time.time_ns()}"
    await proxy.store.ensure_session(session)
    token = proxy.issue_session(session)
    serve = lambda sock, head: proxy.adopt(sock, head, address=("127.0.0.1", 0))  # noqa: E731 (as the pipeline)
    t0 = time.perf_counter()
    channel = await Channel(session, token, serve=serve).start() if mode.startswith("channel") else None
    d = work / session
    spec = SandboxSpec(
        name=f"polar-bench-{session}",
        session_dir=d,
        ca=proxy.ca,
        harness=node_mount(work) if mode.endswith("/node") else None,
        channel=channel.socket_path if channel else None,
        labels={"polar-mitm.rollout": "bench-isolation"},
    )
    sb = await rt.start(Task(id="bench", instruction="x", image=IMAGE), spec)
    t1 = time.perf_counter()
    if channel is not None:
        await channel.wait_ready(30)
    url = proxy_url(*(sb.proxy_address or ("127.0.0.1", proxy.port)), session, token)
    return sb, channel, url, t1 - t0, time.perf_counter() - t1


async def measure(proxy: PolarProxy, work: Path, modes: tuple[str, ...], starts: int, turns: int) -> dict:
    """Every mode in turn, round after round (start, then turns in --rounds slices), so that
    whatever else the machine does weighs on each mode alike."""
    runtimes = {m: DockerRuntime(network="host" if m.startswith("host") else "none") for m in modes}
    out: dict[str, dict] = {m: {"start": [], "ready": [], "keepalive": [], "fresh": []} for m in modes}
    for k in range(starts):
        for m in modes:
            sb, channel, _, started, waited = await start_one(runtimes[m], proxy, work, m, k)
            out[m]["start"].append(started)
            out[m]["ready"].append(waited)
            await sb.stop()
            if channel:
                await channel.close()
    up = {m: await start_one(runtimes[m], proxy, work, m, starts) for m in modes}
    try:
        rounds = 4
        for _ in range(rounds):
            for how in ("keepalive", "fresh"):
                for m in modes:
                    sb, _, url, _, _ = up[m]
                    env = {"P": url, "CA": str(sb.ca.bundle)}
                    n = max(2, turns // rounds) + 2
                    r = await sb.exec(["python3", "-c", CLIENT, str(n), how], env=env, timeout=300)
                    if r.exit_code != 0:
                        raise RuntimeError(f"{m} {how}: {r.output[-500:]}")
                    out[m][how] += json.loads(r.output.strip().splitlines()[-1])[2:]  # 2 warm-up calls
    finally:
        for sb, channel, *_ in up.values():
            await sb.stop()
            if channel:
                await channel.close()
    return {
        m: {
            "start_s": statistics.median(v["start"]),
            "ready_s": statistics.median(v["ready"]),
            "keepalive_ms": statistics.median(v["keepalive"]) * 1000,
            "fresh_ms": statistics.median(v["fresh"]) * 1000,
        }
        for m, v in out.items()
    }


async def bare_start(starts: int) -> dict[str, float]:
    """Median seconds to start a bare `sleep infinity` container with each network, alternately
    (the daemon's share of the start: with "none" it makes the container a network namespace)."""
    import docker

    client = docker.from_env()
    times: dict[str, list[float]] = {"host": [], "none": []}
    for _ in range(starts):
        for network, t in times.items():
            t0 = time.perf_counter()
            c = await asyncio.to_thread(
                client.containers.run, IMAGE, entrypoint=["sleep", "infinity"], command=[], detach=True,
                network_mode=network, labels={"polar-mitm.rollout": "bench-isolation"},
            )  # fmt: skip
            t.append(time.perf_counter() - t0)
            await asyncio.to_thread(c.remove, force=True)
    return {n: statistics.median(t) for n, t in times.items()}


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--starts", type=int, default=8)
    ap.add_argument("--turns", type=int, default=60)
    a = ap.parse_args()
    tok = ensure_tokenizer("tiny")
    runner, url = await start_fake_backend(FakeBackendConfig(tokenizer_path=str(tok)))
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        proxy = PolarProxy(
            ProxyConfig(db=str(work / "bench.sqlite"), certs_dir=work / "certs",
                        policy=PolicyConfig(backend_url=url, tokenizer=str(tok)))
        )  # fmt: skip
        await proxy.start()
        proxy.serve_issued_only()
        try:
            modes = ("host/node", "channel/node", "host/python3", "channel/python3")
            results = await measure(proxy, work, modes, a.starts, a.turns)
            bare = await bare_start(a.starts)
        finally:
            await proxy.stop()
            await runner.cleanup()
    print(
        f"{'mode':<16} {'start s':>8} {'x host':>7} {'ready s':>8} {'turn ms':>8} {'+ms':>6} {'new-tunnel ms':>14} {'+ms':>6}"
    )
    for m, r in results.items():
        base = results["host/" + m.split("/")[1]]
        print(
            f"{m:<16} {r['start_s']:>8.3f} {r['start_s'] / base['start_s']:>7.2f} {r['ready_s']:>8.3f} "
            f"{r['keepalive_ms']:>8.2f} {r['keepalive_ms'] - base['keepalive_ms']:>+6.2f} "
            f"{r['fresh_ms']:>14.2f} {r['fresh_ms'] - base['fresh_ms']:>+6.2f}"
        )  # fmt: skip
    print(
        f"a bare container (docker run, sleep): host network {bare['host']:.3f} s, network none "
        f"{bare['none']:.3f} s ({bare['none'] / bare['host']:.2f}x: the network namespace's share)"
    )


if __name__ == "__main__":
    asyncio.run(main())
