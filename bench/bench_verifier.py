"""What the supervised verifier costs per sample, and the rollout process's memory per sample in
flight while artefacts are scored.

The example Harbor tasks (examples/tasks) x --samples, solved by a one-line `--harness-cmd` in a
hardened Docker sandbox, each scored in a fresh verifier container. Four modes, alternated round
by round in one run:
- `plain`: a fresh verifier from the task's image with the workdir copied in, unsupervised (the
  tests run, the reward read);
- `copied`: the same, supervised, the tests copied in (the verifier before the read-only inputs:
  the baseline the ratios are to);
- `separate`: supervised, the tests and the canary shown read-only from a pristine host copy;
- `shared`: Harbor's default: the verifier started from a snapshot (`docker commit`) of the halted
  agent container, the tests read-only.
Per sample: the scoring stage's wall time (from the halt of the agent's container to its verdict). Also the process's peak RSS over its RSS
before, divided by the samples scored at once (--postrun-workers), with an artefact of
--artefact-mb in each workdir.

    .venv/bin/python bench/bench_verifier.py [--samples 8] [--rounds 2] [--artefact-mb 200]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _procs import start_fake  # noqa: E402

from polar_mitm.backends.tokenizer_build import ensure_tokenizer  # noqa: E402
from polar_mitm.policy.config import PolicyConfig  # noqa: E402
from polar_mitm.proxy.embedded import PolarProxy, ProxyConfig  # noqa: E402
from polar_mitm.rollout.pipeline import Pipeline, RolloutOptions  # noqa: E402
from polar_mitm.sandbox.docker import DockerRuntime  # noqa: E402
from polar_mitm.tasks import load_tasks  # noqa: E402

TASKS = Path(__file__).resolve().parent.parent / "examples" / "tasks"


class Copied(DockerRuntime):
    """The Docker runtime verifying as before the read-only inputs and the shared mode: the tests
    copied in, the workdir into a container from the task's image."""

    mounts_inputs = False
    snapshots = False


class Unsupervised(Copied):
    """... with its verifier's supervision off too."""

    async def start(self, task, spec):
        sb = await super().start(task, spec)
        sb.supervises = False
        return sb


class Separate(DockerRuntime):
    snapshots = False  # the workdir into a container from the task's image, the inputs read-only


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


async def one(proxy, runtime, tasks, opts, work: Path) -> tuple[list[float], float]:
    base, peak = rss_mb(), 0.0

    async def watch():
        nonlocal peak
        while True:
            peak = max(peak, rss_mb())
            await asyncio.sleep(0.05)

    watcher = asyncio.create_task(watch())
    try:
        result = await Pipeline(opts, proxy, runtime, work_dir=work).run(tasks)
    finally:
        watcher.cancel()
    bad = [s for s in result.samples if s.status != "completed"]
    if bad:
        sys.exit(f"bench_verifier: a sample did not complete: {bad[0].status} {bad[0].cause}")
    return [s.timings["scoring"] for s in result.samples], peak - base


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=8, help="samples per round and mode")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--artefact-mb", type=int, default=200)
    ap.add_argument("--postrun-workers", type=int, default=4)
    a = ap.parse_args()
    tok = ensure_tokenizer("qwen")
    tasks = load_tasks([TASKS])
    per_task = max(1, a.samples // len(tasks))
    solve = f"echo 42 > /app/answer.txt; dd if=/dev/zero of=/app/artefact.bin bs=1M count={a.artefact_mb} status=none"
    opts = RolloutOptions(
        harness="claude-code",
        harness_cmd=["sh", "-c", solve, "sh", "{instruction}"],
        samples=per_task,
        run_workers=a.postrun_workers,
        postrun_workers=a.postrun_workers,
        retries=0,
    )
    modes = {"plain": Unsupervised, "copied": Copied, "separate": Separate, "shared": DockerRuntime}
    times: dict[str, list[float]] = {m: [] for m in modes}
    rss: dict[str, list[float]] = {m: [] for m in modes}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        engine = start_fake(work, tokenizer_path=str(tok))
        proxy = PolarProxy(
            ProxyConfig(
                db=str(work / "bench.sqlite"),
                certs_dir=work / "certs",
                policy=PolicyConfig(backend_url=engine.url, tokenizer=str(tok)),
            )
        )
        await proxy.start()
        t0 = time.perf_counter()
        try:
            for r in range(a.rounds):
                for mode, make in modes.items():
                    t, grew = await one(proxy, make(), tasks, opts, work / f"{mode}-{r}")
                    times[mode] += t
                    rss[mode].append(grew)
        finally:
            await proxy.stop()
            engine.stop()
    n = len(times["plain"])
    print(
        f"{n} samples per mode ({len(tasks)} tasks x {per_task} x {a.rounds} rounds), "
        f"{a.postrun_workers} scored at once, a {a.artefact_mb} MB artefact each; {time.perf_counter() - t0:.0f} s"
    )
    print("| mode | scoring wall time per sample, median [min-max] s | peak RSS growth / sample in flight |")
    print("|---|---|---|")
    for mode in times:
        t = times[mode]
        per = max(rss[mode]) / a.postrun_workers
        print(f"| {mode} | {statistics.median(t):.2f} [{min(t):.2f}-{max(t):.2f}] | {per:.1f} MB |")
    base = statistics.median(times["copied"])
    for mode in modes:
        print(f"{mode} / copied, median scoring time: {statistics.median(times[mode]) / base:.2f}x")


if __name__ == "__main__":
    asyncio.run(main())
