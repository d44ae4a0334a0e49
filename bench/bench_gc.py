"""The cyclic garbage collector's pauses in a proxy process, with and without `long_lived_heap`.

Two `polar-mitm proxy` processes against one fake backend, each answering the same growing
tool-calling conversation (a ~`--context`-token system prompt, one tool call and its result a
turn, keep-alive), turn by turn in alternation: `before` with `long_lived_heap` turned into a
no-op (the collector as Python sets it: thresholds 700/10/10, nothing frozen), `after` as the
CLI runs it. Each process records every collection after it started listening (`gc.callbacks`)
and writes them out when it stops. Printed per variant: collections of each generation, their
time in all and the longest, the proxy's CPU per turn (from /proc) and each turn's latency
(median, p99, longest), and the ratios after/before.

    .venv/bin/python bench/bench_gc.py [--turns 300] [--context 1000]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path

import httpx
from _procs import Proc, ensure_ca, start_fake, start_proxy, workdir
from bench_floor import BASH, SCRIPT, URL, filler

from polar_mitm.backends.tokenizer import Tokenizer
from polar_mitm.backends.tokenizer_build import ensure_tokenizer

# Runs `python -m polar_mitm proxy ...` with the collector watched from the moment it listens.
_WRAP = """
import asyncio, atexit, gc, json, runpy, sys, time
out, keep = sys.argv[1], sys.argv[2] == "1"
del sys.argv[1:3]
from polar_mitm.proxy import embedded
if not keep:
    embedded.long_lived_heap = lambda: None
pauses = {0: [], 1: [], 2: []}
began = {}
def watch(phase, info):
    g = info["generation"]
    if phase == "start":
        began[g] = time.perf_counter()
    elif g in began:
        pauses[g].append(time.perf_counter() - began.pop(g))
start = embedded.PolarProxy.start
async def started(self):
    port = await start(self)
    gc.callbacks.append(watch)
    return port
embedded.PolarProxy.start = started
atexit.register(lambda: open(out, "w").write(json.dumps({"pauses": pauses, "threshold": gc.get_threshold()})))
sys.argv[0] = "polar-mitm"
runpy.run_module("polar_mitm", run_name="__main__", alter_sys=True)
"""


def start_watched(tmp: Path, name: str, keep: bool, backend: str, tokenizer: str) -> tuple[Proc, Path]:
    out = tmp / f"gc-{name}.json"
    launcher = [sys.executable, "-c", _WRAP, str(out), "1" if keep else "0"]
    return start_proxy(tmp, backend, tokenizer, db=str(tmp / f"{name}.sqlite"), launcher=launcher), out


async def run(turns: int, context: int) -> None:
    tmp = workdir("polar-bench-gc-")
    tok_dir = ensure_tokenizer("qwen")
    tok = Tokenizer.load(tok_dir)
    ca = ensure_ca(tmp)
    system = filler(tok, context)
    fake = start_fake(tmp, tokenizer_path=str(tok_dir), script=SCRIPT, context_length=400_000)
    variants = {"before": False, "after": True}
    procs = {name: start_watched(tmp, name, keep, fake.url, str(tok_dir)) for name, keep in variants.items()}
    clients = {
        name: httpx.AsyncClient(proxy=p.url.replace("http://", "http://gc:x@"), verify=str(ca), timeout=300)
        for name, (p, _) in procs.items()
    }
    msgs: dict[str, list[dict]] = {name: [{"role": "user", "content": "start"}] for name in variants}
    times: dict[str, list[float]] = {name: [] for name in variants}
    cpu = {name: 0.0 for name in variants}
    try:
        for _ in range(turns):
            for name, client in clients.items():
                body = {
                    "model": "m",
                    "max_tokens": 64,
                    "system": system,
                    "tools": [BASH],
                    "messages": msgs[name],
                }
                c0 = procs[name][0].cpu()
                t0 = time.perf_counter()
                r = await client.post(URL, json=body)
                times[name].append(time.perf_counter() - t0)
                cpu[name] += procs[name][0].cpu() - c0
                r.raise_for_status()
                call = next(b for b in r.json()["content"] if b["type"] == "tool_use")
                result = {"type": "tool_result", "tool_use_id": call["id"], "content": "file1\nfile2"}
                msgs[name] += [
                    {"role": "assistant", "content": [call]},
                    {"role": "user", "content": [result]},
                ]
    finally:
        for client in clients.values():
            await client.aclose()
        for p, _ in procs.values():
            p.stop()
        fake.stop()
    rows = {}
    for name, (_, out) in procs.items():
        data = json.loads(out.read_text())
        pauses = {int(g): v for g, v in data["pauses"].items()}
        every = [x for v in pauses.values() for x in v]
        lat = sorted(times[name])
        rows[name] = {
            "counts": "/".join(str(len(pauses[g])) for g in (0, 1, 2)),
            "gc_ms": sum(every) * 1000,
            "longest": max(every, default=0.0) * 1000,
            "cpu": cpu[name] / turns * 1000,
            "p50": statistics.median(lat) * 1000,
            "p99": lat[min(len(lat) - 1, round(0.99 * (len(lat) - 1)))] * 1000,
            "max": lat[-1] * 1000,
            "threshold": data["threshold"],
        }
    print()
    print(
        f"{turns} turns each, ~{context}-token system prompt, the conversation growing a tool call a turn"
        f" (to {len(msgs['after'])} messages); load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}"
    )
    print(
        "| variant | thresholds | collections gen0/1/2 | collector ms in all | longest pause ms |"
        " proxy CPU ms a turn | latency ms median / p99 / longest |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, r in rows.items():
        print(
            f"| {name} | {'/'.join(map(str, r['threshold']))} | {r['counts']} | {r['gc_ms']:.1f} |"
            f" {r['longest']:.1f} | {r['cpu']:.2f} | {r['p50']:.1f} / {r['p99']:.1f} / {r['max']:.1f} |"
        )
    b, a = rows["before"], rows["after"]

    def ratio(k: str) -> str:
        return f"{a[k] / b[k]:.2f}×" if b[k] else "—"

    print(
        f"after/before: collector time {ratio('gc_ms')}, longest pause {ratio('longest')},"
        f" CPU a turn {ratio('cpu')}, p99 latency {ratio('p99')}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--turns", type=int, default=300)
    ap.add_argument("--context", type=int, default=1000, help="tokens of the system prompt")
    a = ap.parse_args()
    asyncio.run(run(a.turns, a.context))


if __name__ == "__main__":
    main()
