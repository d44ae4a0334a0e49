"""polar-mitm's CPU per Docker exec: the SDK's own client against those the docker runtime uses.

A rollout sample makes ~65 Docker API calls (docs/benchmarks.md), a third of them execs of three
calls each, and py-spy put most of polar-mitm's own CPU in a rollout in those calls. This starts
one container from the test image and runs `true` in it --execs times a round, alternating the
SDK's `docker.from_env()` (the baseline), `polar_mitm.sandbox.docker.docker_client()` (the SDK
with one connection pool: the runtime's client for creating containers, archives and images) and
`polar_mitm.sandbox.docker.DaemonCalls` (the runtime's calls once a container exists: http.client
on the daemon's socket), and prints the CPU this process spent per exec (user + system, from getrusage), the wall time per
exec, and the ratios against the baseline measured in the same run.

    .venv/bin/python bench/bench_docker_calls.py [--execs 200] [--rounds 4] [--threads 4]

--threads runs the execs from that many threads at once, as a node's pipeline does.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import docker  # noqa: E402

from polar_mitm.sandbox.daemon import DaemonCalls  # noqa: E402
from polar_mitm.sandbox.docker import docker_client, local_socket  # noqa: E402

IMAGE = os.environ.get("POLAR_MITM_TEST_IMAGE", "polar-mitm/rollout-base:bookworm")


def cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def one_exec(client: Any, cid: str) -> None:
    if isinstance(client, DaemonCalls):
        code, _ = client.run(cid, ["true"], {}, "/")
        assert code == 0, code
        return
    ex = client.api.exec_create(cid, ["true"], stdin=False, tty=False)
    client.api.exec_start(ex["Id"], demux=False)
    code = client.api.exec_inspect(ex["Id"]).get("ExitCode")
    assert code == 0, code


def run_round(client: Any, cid: str, execs: int, threads: int) -> tuple[float, float]:
    """(CPU seconds per exec, wall seconds per exec)."""
    c0, t0 = cpu(), time.perf_counter()
    if threads <= 1:
        for _ in range(execs):
            one_exec(client, cid)
    else:
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(lambda _: one_exec(client, cid), range(execs)))
    return (cpu() - c0) / execs, (time.perf_counter() - t0) / execs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--execs", type=int, default=200, help="execs per round")
    ap.add_argument("--rounds", type=int, default=4, help="rounds per client, alternating")
    ap.add_argument("--threads", type=int, default=4, help="threads calling at once (1: one after another)")
    args = ap.parse_args()
    base = docker.from_env(timeout=120)
    pooled = docker_client(120)
    socket_path = local_socket(pooled)
    clients: dict[str, Any] = {"sdk (from_env)": base, "polar-mitm (one pool)": pooled}
    if socket_path:
        clients["polar-mitm (daemon calls)"] = DaemonCalls(socket_path, pooled.api.api_version)
    box = base.containers.run(
        IMAGE, ["sleep", "infinity"], detach=True, network_mode="none", labels={"polar-mitm": "1"}
    )
    try:
        for c in clients.values():  # warm: each client's first connection, the daemon's caches
            run_round(c, box.id, 10, args.threads)
        seen: dict[str, list[tuple[float, float]]] = {k: [] for k in clients}
        for _ in range(args.rounds):
            for name, c in clients.items():
                seen[name].append(run_round(c, box.id, args.execs, args.threads))
    finally:
        box.remove(force=True)
    load = os.getloadavg()[0]
    print(f"{args.execs} execs x {args.rounds} rounds, {args.threads} thread(s), load {load:.1f}")
    print(f"{'client':<26} {'CPU ms/exec (median, min-max)':<32} {'wall ms/exec':<14} CPU ratio")
    ref = statistics.median(x[0] for x in seen["sdk (from_env)"])
    for name, xs in seen.items():
        cpus = [x[0] * 1e3 for x in xs]
        walls = [x[1] * 1e3 for x in xs]
        med = statistics.median(cpus)
        print(
            f"{name:<26} {med:6.2f} ({min(cpus):.2f}-{max(cpus):.2f}){'':<14} "
            f"{statistics.median(walls):8.2f}      {med / (ref * 1e3):.2f}x"
        )


if __name__ == "__main__":
    main()
