"""polar-mitm's own share of a node's CPU in a rollout of real Claude Code in Docker.

--samples samples of the example Harbor tasks (examples/tasks), --run-workers harnesses at a time,
each in a hardened Docker sandbox (no network, its channel to the proxy), scored in a fresh
container. The fake engine runs in its own process, so its CPU is counted apart (on a real node
the engine is on the GPU machine). Measured over the rollout, from /proc:

- polar-mitm: this process (proxy, gateway, store, pipeline, channels, verifier orchestration),
  less what a node pays once at its first model call (loading the tokenizer, finding its longest
  token: ~1.4 s of CPU on this machine), which is timed before the rollout and printed apart;
- the node: every core's busy time (/proc/stat) less the engine's; what is not ours is the
  harnesses, the sandboxes, dockerd / containerd and the rest of the machine.

Prints polar-mitm's share of the node's CPU (issue 22's goal: at most 5 %).

    .venv/bin/python bench/bench_rollout_cpu.py [--samples 16] [--run-workers 4]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _procs import start_fake  # noqa: E402

from polar_mitm.backends.tokenizer_build import ensure_tokenizer  # noqa: E402
from polar_mitm.policy import PolicyConfig  # noqa: E402
from polar_mitm.proxy.embedded import PolarProxy, ProxyConfig  # noqa: E402
from polar_mitm.rollout.pipeline import Pipeline, RolloutOptions  # noqa: E402
from polar_mitm.sandbox import make_runtime  # noqa: E402
from polar_mitm.tasks import load_tasks  # noqa: E402

TASKS = Path(__file__).resolve().parent.parent / "examples" / "tasks"
TICK = os.sysconf("SC_CLK_TCK")


def machine_busy() -> float:
    """Seconds of CPU every core has spent busy (not idle or waiting) since boot."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]
    return (sum(fields[:8]) - idle) / TICK


def own_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=16, help="samples in all (spread over the example tasks)")
    ap.add_argument("--run-workers", type=int, default=4)
    a = ap.parse_args()
    if shutil.which("claude") is None:
        sys.exit("bench_rollout_cpu: Claude Code is not installed (bash scripts/install.sh)")
    tok = ensure_tokenizer("qwen")
    tasks = load_tasks([TASKS])
    per_task = max(1, a.samples // len(tasks))
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        engine = start_fake(work, tokenizer_path=str(tok))
        proxy = PolarProxy(
            ProxyConfig(
                db=str(work / "bench.sqlite"),
                certs_dir=work / "certs",
                policy=PolicyConfig(backend_url=engine.url, tokenizer=str(tok), tool_parser="qwen25"),
            )
        )
        await proxy.start()
        # What a node pays once, on its first model call: the tokenizer loaded, and its longest
        # token found (for refusing what cannot fit). Timed apart, before the rollout.
        start0 = own_cpu()
        assert proxy.policy is not None and proxy.gateway is not None
        await proxy.policy.tokenizer()
        await proxy.gateway._bounds_read()
        start = own_cpu() - start0
        runtime = make_runtime("docker")
        await runtime.check()
        opts = RolloutOptions(harness="claude-code", samples=per_task, run_workers=a.run_workers)
        pipe = Pipeline(opts, proxy, runtime, work_dir=work / "samples")
        try:
            busy0, ours0, engine0, t0 = machine_busy(), own_cpu(), engine.cpu(), time.perf_counter()
            result = await pipe.run(tasks)
            busy, ours, eng, wall = (
                machine_busy() - busy0,
                own_cpu() - ours0,
                engine.cpu() - engine0,
                time.perf_counter() - t0,
            )
        finally:
            await proxy.stop()
            engine.stop()
    node = busy - eng
    outcomes: dict[str, int] = {}
    for s in result.samples:
        outcomes[s.status] = outcomes.get(s.status, 0) + 1
    n = len(result.samples)
    print(
        f"{n} samples of real Claude Code in Docker ({len(tasks)} tasks × {per_task}), {a.run_workers} at a time, "
        f"{wall:.1f} s; outcomes {outcomes}"
    )
    print("| CPU | seconds | per sample | share of the node |")
    print("|---|---|---|---|")
    print(
        f"| polar-mitm (proxy, pipeline, channels, scoring orchestration) | {ours:.2f} | {ours / n:.3f} | {ours / node:.1%} |"
    )
    print(
        f"| harnesses, sandboxes, Docker and the rest | {node - ours:.2f} | {(node - ours) / n:.3f} | {(node - ours) / node:.1%} |"
    )
    print(f"| the node in all (every core busy, less the engine) | {node:.2f} | {node / n:.3f} | 100% |")
    print(
        f"| polar-mitm's one-time start, before the rollout (tokenizer, its longest token) | {start:.2f} |"
        f" {start / n:.3f} | with it: {(ours + start) / (node + start):.1%} |"
    )
    print(f"| the fake engine (apart: on the GPU machine in a real setup) | {eng:.2f} | {eng / n:.3f} | – |")


if __name__ == "__main__":
    asyncio.run(main())
