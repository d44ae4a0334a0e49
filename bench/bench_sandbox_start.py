"""A sandbox's start under Apptainer (the image's SIF already cached) against Docker's, as a ratio
measured in one run, and the one-time conversion of the image into the SIF cache.

Each round starts and stops one agent sandbox of each runtime, alternated, from the Docker test
image (`scripts/docker.sh`'s), as a rollout does for a sample: the instance or container, the
workdir, the harness's HOME. `--convert` first converts the image into an empty SIF cache and
reports how long that took (what the first sample of a new image costs). `--limits` also starts,
alternated with the others, each runtime's sandboxes as they were before the limits by default and
the kernel's options (no memory, CPU or /tmp limit; Apptainer without `kernel_options`: no
read-only /proc knobs, a /sys, no user namespace for a verifier), agent and verifier, and prints
after / before. `--disk` does the same for the seccomp profile in every Apptainer instance and the
bounded HOME (and Apptainer's /tmp): before, no profile, HOME a host directory, Apptainer's /tmp
its overlay. Each start and stop is timed on the wall clock and in CPU (this process and the
children it reaped: Apptainer's own processes; Docker's work is the daemon's, not counted).

    .venv/bin/python bench/bench_sandbox_start.py [--rounds 10] [--convert] [--limits] [--disk]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from polar_mitm.proxy.certs import ensure_ca  # noqa: E402
from polar_mitm.sandbox.apptainer import ApptainerRuntime  # noqa: E402
from polar_mitm.sandbox.apptainer import runtime as apptainer_module  # noqa: E402
from polar_mitm.sandbox.base import Limits, SandboxSpec  # noqa: E402
from polar_mitm.sandbox.docker import DockerRuntime  # noqa: E402
from polar_mitm.tasks.model import Task  # noqa: E402

IMAGE = "polar-mitm/rollout-base:bookworm"


CPU: list[float] = []  # seconds of CPU of each start and stop, in the order timed


def cpu() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


async def start_stop(runtime, task: Task, spec: SandboxSpec) -> float:
    c0, t0 = cpu(), time.perf_counter()
    sb = await runtime.start(task, spec)
    took = time.perf_counter() - t0
    await sb.stop()
    CPU.append(cpu() - c0)
    return took


NO_LIMITS = Limits(memory_mb=None, cpus=None, tmp_mb=None, home_mb=None)


async def start_before_disk(runtime, task: Task, spec: SandboxSpec) -> float:
    """A start as it was before the seccomp profile in every Apptainer instance and the bounded
    HOME (and Apptainer's /tmp)."""
    kernel = apptainer_module.kernel_options
    apptainer_module.kernel_options = lambda *a, seccomp=None, **k: kernel(*a, **k)  # type: ignore[assignment]
    tmp = spec.limits.tmp_mb if runtime.name == "docker" else None
    try:
        return await start_stop(
            runtime, task, dataclasses.replace(spec, limits=Limits(tmp_mb=tmp, home_mb=None))
        )
    finally:
        apptainer_module.kernel_options = kernel


async def start_as_before(runtime, task: Task, spec: SandboxSpec) -> float:
    """A start as it was before the limits by default and Apptainer's kernel options."""
    kernel = apptainer_module.kernel_options
    apptainer_module.kernel_options = lambda *a, **k: []  # type: ignore[assignment]
    try:
        return await start_stop(runtime, task, dataclasses.replace(spec, limits=NO_LIMITS))
    finally:
        apptainer_module.kernel_options = kernel


async def main(rounds: int, convert: bool, limits: bool, disk: bool) -> None:
    work = Path(tempfile.mkdtemp(prefix="bench-start-"))
    ca = ensure_ca(work / "ca")
    task = Task(id="bench", instruction="x", image=IMAGE, workdir="/app")
    apptainer = ApptainerRuntime(registry_dir=work / "registry", sif_dir=(work / "sif") if convert else None)
    await apptainer.check()
    docker = DockerRuntime()
    await docker.check()
    t0 = time.perf_counter()
    await apptainer.prepare(task)
    prepared = time.perf_counter() - t0
    await docker.prepare(task)
    if convert:
        print(f"first conversion of {IMAGE} into the SIF cache: {prepared:.1f} s")
    else:
        print(f"SIF found in the cache in {prepared * 1000:.0f} ms (--convert measures a fresh conversion)")
    times: dict[str, list[float]] = {"docker": [], "apptainer": []}
    cpus: dict[str, list[float]] = {}
    for i in range(rounds):
        for name, rt in (
            (("docker", docker), ("apptainer", apptainer))
            if i % 2 == 0
            else (("apptainer", apptainer), ("docker", docker))
        ):
            spec = SandboxSpec(f"bench-{name}-{i}", work / f"s-{name}-{i}", ca)
            times[name].append(await start_stop(rt, task, spec))
            if limits:
                for purpose in ("agent", "verifier"):
                    spec = SandboxSpec(f"bench-{name}-{purpose}-{i}", work / f"s-{name}-{purpose}-{i}", ca,
                                       purpose=purpose)  # fmt: skip
                    before = await start_as_before(rt, task, dataclasses.replace(spec, name=spec.name + "-b"))
                    after = await start_stop(rt, task, spec)
                    times.setdefault(f"{name} {purpose} before", []).append(before)
                    times.setdefault(f"{name} {purpose} after", []).append(after)
            if disk:
                for purpose in ("agent", "verifier"):
                    spec = SandboxSpec(f"bench-{name}-d{purpose}-{i}", work / f"s-{name}-d{purpose}-{i}", ca,
                                       purpose=purpose)  # fmt: skip
                    (spec.session_dir / "home" / ".config").mkdir(parents=True)  # a recipe's files
                    (spec.session_dir / "home" / ".config" / "settings.json").write_text("{}")
                    before = await start_before_disk(
                        rt, task, dataclasses.replace(spec, name=spec.name + "-b")
                    )
                    cpus.setdefault(f"{name} {purpose} disk before", []).append(CPU[-1])
                    after = await start_stop(rt, task, spec)
                    cpus.setdefault(f"{name} {purpose} disk after", []).append(CPU[-1])
                    times.setdefault(f"{name} {purpose} disk before", []).append(before)
                    times.setdefault(f"{name} {purpose} disk after", []).append(after)
    med = {k: statistics.median(v) for k, v in times.items()}
    for k, v in times.items():
        print(
            f"{k:26s} start: median {med[k] * 1000:.0f} ms (min {min(v) * 1000:.0f}, max {max(v) * 1000:.0f}) over {len(v)}"
            + (f"; CPU median {statistics.median(cpus[k]) * 1000:.0f} ms" if k in cpus else "")
        )
    print(f"apptainer / docker: {med['apptainer'] / med['docker']:.2f}x")
    if limits:
        for name in ("docker", "apptainer"):
            for purpose in ("agent", "verifier"):
                after, before = med[f"{name} {purpose} after"], med[f"{name} {purpose} before"]
                print(
                    f"{name} {purpose}: after / before the limits and kernel options: {after / before:.2f}x"
                )
    if disk:
        for name in ("docker", "apptainer"):
            for purpose in ("agent", "verifier"):
                k = f"{name} {purpose} disk"
                wall = med[f"{k} after"] / med[f"{k} before"]
                c_after, c_before = (
                    statistics.median(cpus[f"{k} after"]),
                    statistics.median(cpus[f"{k} before"]),
                )
                # (under 20 ms: os.times' ticks, and Docker's work is the daemon's, not counted here)
                c = f"{c_after / c_before:.2f}x" if c_before >= 0.02 else "not measured here"
                print(
                    f"{name} {purpose}: after / before seccomp and the bounded HOME: wall {wall:.2f}x, CPU {c}"
                )


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument(
        "--convert", action="store_true", help="convert into an empty SIF cache first, and time it"
    )
    ap.add_argument("--limits", action="store_true", help="also time starts as before the limits (ratio)")
    ap.add_argument(
        "--disk", action="store_true", help="also time starts as before seccomp and the bounded HOME (ratio)"
    )
    args = ap.parse_args()
    asyncio.run(main(args.rounds, args.convert, args.limits, args.disk))
