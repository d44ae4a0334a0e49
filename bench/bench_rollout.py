"""What the READY buffer buys, and what the pipeline itself costs per sample.

Sixteen samples whose sandbox takes --start-delay seconds to start and whose harness runs
--run-seconds, with --run-workers harnesses at a time:
- "just in time": each of --run-workers lanes starts a sandbox right before its run, then scores
  it and stops it (what a loop without a pipeline does);
- "pipeline": polar-mitm's INIT / READY / RUN / POSTRUN stages with the same RUN concurrency,
  sandboxes started ahead of time into the bounded READY buffer.
Both in the same run, on the same runtime (`local`, or `docker` with --docker: a real container
per sample plus the delay), so the ratio is what the buffer buys.

Then the pipeline's own cost: samples with an instant sandbox and a harness that exits at once,
through the pipeline vs the same runtime calls in a bare loop, per sample.

    .venv/bin/python bench/bench_rollout.py [--samples 16] [--start-delay 3] [--run-seconds 1] [--docker]
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

from polar_mitm.backends.tokenizer_build import ensure_tokenizer
from polar_mitm.fake import FakeBackendConfig, start_fake_backend
from polar_mitm.policy import PolicyConfig
from polar_mitm.proxy.embedded import PolarProxy, ProxyConfig
from polar_mitm.rollout.evaluators import HarnessOutcome, evaluate
from polar_mitm.rollout.pipeline import Pipeline, RolloutOptions
from polar_mitm.sandbox.base import SandboxSpec
from polar_mitm.sandbox.tempdir import TempdirRuntime
from polar_mitm.tasks.model import EvaluatorSpec, Task


def slow(runtime_cls, delay: float):
    class Slow(runtime_cls):  # type: ignore[misc, valid-type]
        async def start(self, task, spec):
            await asyncio.sleep(delay)
            return await super().start(task, spec)

    return Slow()


def make_runtime(docker: bool, delay: float):
    if docker:
        from polar_mitm.sandbox.docker import DockerRuntime

        return slow(DockerRuntime, delay)
    return slow(TempdirRuntime, delay)


def tasks(n: int, image: str | None) -> list[Task]:
    return [
        Task(
            id=f"t{i}", instruction="x", image=image, evaluator=EvaluatorSpec(kind="command", command="true")
        )
        for i in range(n)
    ]


async def just_in_time(proxy, runtime, tasks_, run_cmd: list[str], lanes: int, work: Path) -> float:
    queue: asyncio.Queue[Task] = asyncio.Queue()
    for t in tasks_:
        queue.put_nowait(t)

    async def lane(k: int) -> None:
        n = 0
        while not queue.empty():
            t = queue.get_nowait()
            n += 1
            d = work / f"jit-{k}-{n}"
            d.mkdir(parents=True)
            sb = await runtime.start(
                t, SandboxSpec(name=f"polar-bench-{k}-{n}-{time.time_ns()}", session_dir=d, ca=proxy.ca)
            )
            try:
                r = await sb.exec(run_cmd)
                await evaluate(t, sb, HarnessOutcome(r.exit_code))
            finally:
                await sb.stop()

    t0 = time.perf_counter()
    await asyncio.gather(*(lane(k) for k in range(lanes)))
    return time.perf_counter() - t0


async def pipeline(proxy, runtime, tasks_, run_cmd: list[str], lanes: int, work: Path) -> float:
    opts = RolloutOptions(
        harness="claude-code",
        runtime=runtime.name,
        harness_cmd=[*run_cmd, "{instruction}"],
        run_workers=lanes,
    )
    p = Pipeline(opts, proxy, runtime, work_dir=work)
    t0 = time.perf_counter()
    await p.run(tasks_)
    return time.perf_counter() - t0


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--start-delay", type=float, default=3.0)
    ap.add_argument("--run-seconds", type=float, default=1.0)
    ap.add_argument("--run-workers", type=int, default=2)
    ap.add_argument("--docker", action="store_true")
    ap.add_argument("--image", default="polar-mitm/rollout-base:bookworm")
    a = ap.parse_args()
    tok = ensure_tokenizer("tiny")
    runner, url = await start_fake_backend(FakeBackendConfig(tokenizer_path=str(tok)))
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        proxy = PolarProxy(
            ProxyConfig(db=str(work / "bench.sqlite"), certs_dir=work / "certs", token="bench",
                        policy=PolicyConfig(backend_url=url, tokenizer=str(tok)))
        )  # fmt: skip
        await proxy.start()
        image = a.image if a.docker else None
        kind = "docker" if a.docker else "local"
        try:
            run = ["sh", "-c", f"sleep {a.run_seconds}"]
            rt = make_runtime(a.docker, a.start_delay)
            jit = await just_in_time(proxy, rt, tasks(a.samples, image), run, a.run_workers, work / "jit")
            pipe = await pipeline(proxy, rt, tasks(a.samples, image), run, a.run_workers, work / "pipe")
            print(
                f"{a.samples} samples · {kind} runtime · sandbox start {a.start_delay:.1f} s · run {a.run_seconds:.1f} s"
                f" · {a.run_workers} harnesses at a time"
            )
            print("| schedule | wall s | ratio |")
            print("|---|---|---|")
            print(f"| just in time (start before each run) | {jit:.2f} | 1.00× |")
            print(f"| pipeline (INIT ahead, READY buffer) | {pipe:.2f} | {pipe / jit:.2f}× |")

            n = a.samples * 4
            fast = make_runtime(a.docker, 0.0)
            bare = await just_in_time(proxy, fast, tasks(n, image), ["true"], a.run_workers, work / "bare")
            piped = await pipeline(proxy, fast, tasks(n, image), ["true"], a.run_workers, work / "piped")
            print()
            print(f"pipeline overhead: {n} samples, instant sandbox start, harness `true`")
            print("| path | ms per sample |")
            print("|---|---|")
            print(f"| bare loop (start, exec, score, stop) | {1000 * bare / n:.1f} |")
            print(f"| pipeline (+ session, store records, stages) | {1000 * piped / n:.1f} |")
            print(f"| overhead | {1000 * (piped - bare) / n:.1f} |")
        finally:
            await proxy.stop()
            await runner.cleanup()


if __name__ == "__main__":
    asyncio.run(main())
