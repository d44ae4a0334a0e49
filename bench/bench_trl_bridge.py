"""The TRL bridge's own cost per group against reading the same groups' parquet, in one run.

Synthetic groups shaped like agent rollouts (`--groups` × `--samples` rows, each a prompt of
`--prompt` tokens and a prefix-merged response of `--response` tokens, a fifth of them tool
results with loss_mask 0, one failed sample per group) are held as the client holds them
(`Group` of `Sample`). The bridge's cost is `build_fields` (the rows built and handed to TRL:
prompt ids, completion ids, logprobs, env_mask, rewards); the reference is reading the same rows
from their parquet bytes (`pq.read_table`, and `read_table(...).to_pylist()`, which yields Python
lists as the bridge does). Prints ms per group and the ratios.

    .venv/bin/python bench/bench_trl_bridge.py                 # 8 groups × 8 samples, a few seconds
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from polar_mitm.api import SampleView  # noqa: E402
from polar_mitm.bridges.trl import build_fields  # noqa: E402
from polar_mitm.client import Group, Sample  # noqa: E402


def make_rows(groups: int, samples: int, prompt: int, response: int, seed: int = 0) -> list[list[dict]]:
    rng = np.random.default_rng(seed)
    out = []
    for g in range(groups):
        p = rng.integers(0, 151_000, prompt).tolist()
        rows = []
        for s in range(samples):
            mask = np.ones(response, dtype=np.int8)
            for start in range(response // 5, response, response // 3 or 1):  # tool results
                mask[start : start + response // 15] = 0
            lp = np.where(mask == 1, -rng.random(response).astype(np.float32), 0.0).astype(np.float32)
            rows.append(
                {
                    "trajectory_id": f"t{g}-{s}", "session_id": f"s{g}-{s}", "task_id": f"g{g}", "group_id": f"g{g}",
                    "sample_index": s, "prompt_ids": p, "response_ids": rng.integers(0, 151_000, response).tolist(),
                    "loss_mask": mask.tolist(), "response_logprobs": lp.tolist(), "num_turns": 4,
                    "reward": float(s % 2), "status": "failed" if s == samples - 1 else "completed",
                    "metadata": json.dumps({"weight_versions": ["3"]}),
                }
            )  # fmt: skip
        out.append(rows)
    return out


def best(f, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        f()
        times.append(time.perf_counter() - t)
    return min(times) if repeat < 5 else statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=8000)
    ap.add_argument("--response", type=int, default=4000)
    ap.add_argument("--repeat", type=int, default=5)
    a = ap.parse_args()
    rows = make_rows(a.groups, a.samples, a.prompt, a.response)
    groups = [
        Group(
            task_id=f"g{g}",
            state="done",
            samples=[Sample.from_row(r, g) for r in rs],
            index=g,
            outcomes=[
                SampleView(index=r["sample_index"], state="finished", status=r["status"], reward=r["reward"])
                for r in rs
            ],
        )  # fmt: skip
        for g, rs in enumerate(rows)
    ]
    blobs = []
    for rs in rows:
        buf = io.BytesIO()
        pq.write_table(pa.Table.from_pylist(rs), buf)
        blobs.append(buf.getvalue())

    bridge = best(lambda: build_fields(groups, a.samples, 0), a.repeat)
    read = best(lambda: [pq.read_table(io.BytesIO(b)) for b in blobs], a.repeat)
    read_lists = best(lambda: [pq.read_table(io.BytesIO(b)).to_pylist() for b in blobs], a.repeat)
    n = a.groups
    tokens = a.groups * a.samples * (a.prompt + a.response)
    print(
        f"{a.groups} groups × {a.samples} samples, {a.prompt} prompt + {a.response} response tokens each ({tokens:,} tokens)"
    )
    print(f"bridge (build_fields, rows handed to TRL)   {bridge / n * 1e3:8.2f} ms/group")
    print(f"parquet read_table                          {read / n * 1e3:8.2f} ms/group")
    print(f"parquet read_table + to_pylist              {read_lists / n * 1e3:8.2f} ms/group")
    print(f"ratio bridge / read_table                   {bridge / read:8.2f}×")
    print(f"ratio bridge / read_table + to_pylist       {bridge / read_lists:8.2f}×")


if __name__ == "__main__":
    main()
