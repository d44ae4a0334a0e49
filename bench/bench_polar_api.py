"""The Polar door's cost per poll (`serve --polar-api`), against `/v1`, in one run.

A Polar client polls `GET /rollout/task/{id}`, whose `TaskStatus` carries every finished
sample's `SessionResult` with its traces (token ids, mask, logprobs); a `/v1` client polls
`GET /v1/tasks/{id}` (states only) and reads `GET /v1/tasks/{id}/results` (the rows) once. This
times each on a finished task of `--samples` samples (submitted through the Polar door, its rows
written to the store as a node reports them: one row per sample of `--prompt` + `--response`
tokens, Claude Code's size by default), through the same server and HTTP client, and prints the
Polar poll's time as a ratio of each /v1 one.

    .venv/bin/python bench/bench_polar_api.py [--samples 16] [--polls 50]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from polar_mitm.service.config import ServerConfig
from polar_mitm.service.server import RolloutServer

TOKEN = "bench-token"


def row(task_id: str, idx: int, prompt: int, response: int) -> dict:
    rng = random.Random(idx)
    return {
        "trajectory_id": f"{task_id}-{idx}",
        "session_id": f"s{idx}",
        "task_id": task_id,
        "prompt_ids": [rng.randrange(150_000) for _ in range(prompt)],
        "response_ids": [rng.randrange(150_000) for _ in range(response)],
        "loss_mask": [1 if i % 3 else 0 for i in range(response)],
        "response_logprobs": [-rng.random() if i % 3 else 0.0 for i in range(response)],
        "num_turns": 20,
        "turn_ids": [f"turn{i}" for i in range(20)],
        "finish_reason": "stop",
        "reward": 1.0,
        "metadata": json.dumps({"weight_versions": ["0"]}),
        "role": "main",
        "parent_id": None,
        "status": "completed",
    }


async def timed(h: httpx.AsyncClient, path: str, polls: int) -> tuple[float, int]:
    """Median ms per GET, and the reply's size."""
    times, size = [], 0
    for _ in range(polls):
        t0 = time.perf_counter()
        r = await h.get(path)
        body = r.content
        times.append((time.perf_counter() - t0) * 1000)
        assert r.status_code == 200, r.text[:200]
        size = len(body)
    return statistics.median(times), size


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--polls", type=int, default=50)
    ap.add_argument("--prompt", type=int, default=20_000)
    ap.add_argument("--response", type=int, default=6_000)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        server = RolloutServer(ServerConfig(db=Path(d) / "s.sqlite", token=TOKEN, polar_api=True))
        await server.start()
        try:
            async with httpx.AsyncClient(
                base_url=server.url, headers={"authorization": f"Bearer {TOKEN}"}
            ) as h:
                body = {
                    "task_id": "g",
                    "instruction": "x",
                    "num_samples": args.samples,
                    "agent": {"harness": "claude_code"},
                    "runtime": {"image": "img"},
                    "metadata": {"group_id": 1},
                }
                assert (await h.post(f"{server.polar_url}/rollout/task/submit", json=body)).status_code == 200
                for i in range(args.samples):
                    server.store.finish_sample(
                        "g", i, None, status="completed", cause=None, reward=1.0,
                        timings={"starting": 1.0, "running": 30.0, "scoring": 2.0}, weight_versions=["0"],
                        session_id=f"s{i}", rows=[row("g", i, args.prompt, args.response)],
                    )  # fmt: skip
                server.store.set_task_state("g", "done")
                polar_ms, polar_size = await timed(h, f"{server.polar_url}/rollout/task/g", args.polls)
                view_ms, view_size = await timed(h, "/v1/tasks/g", args.polls)
                rows_ms, rows_size = await timed(h, "/v1/tasks/g/results", args.polls)
        finally:
            await server.stop()
    print(f"{args.samples} samples, {args.prompt}+{args.response} tokens each; median of {args.polls} polls")
    print(f"  GET /v1/tasks/g          {view_ms:8.2f} ms  {view_size / 1e6:7.2f} MB")
    print(f"  GET /v1/tasks/g/results  {rows_ms:8.2f} ms  {rows_size / 1e6:7.2f} MB")
    print(f"  GET /rollout/task/g      {polar_ms:8.2f} ms  {polar_size / 1e6:7.2f} MB   (Polar's TaskStatus)")
    print(
        f"  Polar poll / v1 results poll: {polar_ms / rows_ms:.2f}x;  / v1 status poll: {polar_ms / view_ms:.1f}x"
    )


if __name__ == "__main__":
    asyncio.run(main())
