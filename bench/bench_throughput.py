"""Turns per second through one proxy, and through `proxy --workers N`, against bare mitmdump.

Many concurrent simulated harnesses (each its own proxy credentials, so its own session) send an
Anthropic request, echo the reply's tool call with its result, and go on for --turns turns. Paths,
measured in the same run with the same client code and concurrency:

- direct: the same /generate calls (the input ids polar-mitm sent) straight to the fake backend;
- polar-mitm, `proxy --workers 1` and `--workers N` (each in its own processes; instant backend);
- bare mitmdump (its default addons, quiet) intercepting the same HTTPS requests and forwarding
  them (map_remote) to a trivial server that answers polar-mitm's own reply bytes.

Issue 10's goals: one proxy ≥ 0.7× mitmdump's turns/s; N workers ≥ 1.6× one worker on 2 cores.
The client and the fake backend run on the same cores as the proxies, so the table also gives
each path's proxy CPU per turn (all its processes, from /proc).

    .venv/bin/python bench/bench_throughput.py [--sessions 64] [--turns 10] [--context 2000] [--workers 2] [--rounds 2] [--profile]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import time
from pathlib import Path

import httpx
from _procs import Proc, Profile, ensure_ca, start_fake, start_mitmdump, start_proxy, start_trivial, workdir

from polar_mitm.backends.tokenizer_build import ensure_tokenizer
from polar_mitm.store.reader import read_turns

HOST = "api.anthropic.com"
URL = f"https://{HOST}/v1/messages"
BASH = {"name": "Bash", "description": "Run a command", "input_schema": {"type": "object", "properties": {}}}
SCRIPT = [{"match": "", "tool_call": {"name": "Bash", "arguments": {"command": "ls"}}}]


async def session(proxy_url: str, ca: Path, sid: str, turns: int, system: str) -> bytes:
    """One harness's conversation; returns the first reply's bytes."""
    first = b""
    async with httpx.AsyncClient(
        proxy=proxy_url.replace("//", f"//{sid}:x@"), verify=str(ca), timeout=300
    ) as c:
        msgs: list[dict] = [{"role": "user", "content": "start"}]
        for _ in range(turns):
            r = await c.post(
                URL,
                json={"model": "m", "max_tokens": 64, "system": system, "tools": [BASH], "messages": msgs},
            )
            r.raise_for_status()
            first = first or r.content
            content = r.json()["content"]
            use = next(b for b in content if b["type"] == "tool_use")
            msgs += [
                {"role": "assistant", "content": content},
                {
                    "role": "user",
                    "content": [{"type": "tool_result", "tool_use_id": use["id"], "content": "ok"}],
                },
            ]
    return first


def tree_cpu(proc: Proc) -> dict[int, float]:
    """CPU seconds of a process and of each of its children (a --workers front and its workers),
    by pid."""
    pids = [proc.pid] + [
        int(p)
        for p in subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
    ]
    out = {}
    for pid in pids:
        total = 0
        for task in Path(f"/proc/{pid}/task").glob("*"):
            try:
                total += int((task / "schedstat").read_text().split()[0])
            except (OSError, ValueError, IndexError):
                pass
        out[pid] = total / 1e9
    return out


def spent(before: dict[int, float], after: dict[int, float]) -> tuple[float, float]:
    """(CPU seconds of all the processes, of the busiest one) between two `tree_cpu` readings."""
    each = [t - before.get(pid, 0.0) for pid, t in after.items()]
    return sum(each), max(each, default=0.0)


async def through(
    proxy: Proc, ca: Path, sessions: int, turns: int, system: str, tag: str, upstream: Proc | None = None
) -> tuple[float, float, float, float, float, bytes]:
    """Seconds; CPU seconds of the proxy, the client (this process) and the server behind the
    proxy; and of the proxy's busiest process, for every session's conversation through `proxy`."""
    cpu0, client0, up0 = tree_cpu(proxy), time.process_time(), upstream.cpu() if upstream else 0.0
    t0 = time.perf_counter()
    firsts = await asyncio.gather(
        *(session(proxy.url, ca, f"{tag}{i}", turns, system) for i in range(sessions))
    )
    secs = time.perf_counter() - t0
    up = upstream.cpu() - up0 if upstream else 0.0
    cpu, busiest = spent(cpu0, tree_cpu(proxy))
    return secs, cpu, time.process_time() - client0, up, busiest, firsts[0]


async def direct(backend: str, prompts: list[list[int]], concurrency: int) -> float:
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=300) as c:

        async def one(ids: list[int]) -> None:
            async with sem:
                r = await c.post(
                    backend + "/generate",
                    json={
                        "input_ids": ids,
                        "sampling_params": {"max_new_tokens": 64},
                        "return_logprob": True,
                    },
                )
                r.raise_for_status()

        t0 = time.perf_counter()
        await asyncio.gather(*(one(p) for p in prompts))
        return time.perf_counter() - t0


async def run(sessions: int, turns: int, context: int, workers: int, rounds: int, profile: bool) -> None:
    tok_dir = str(ensure_tokenizer("qwen"))
    tmp = workdir("polar-bench-throughput-")
    ca = ensure_ca(tmp)
    system = "You are a coding agent working in a large repository. " * max(1, context // 11)
    procs: list[Proc] = []
    n = sessions * turns
    rows: dict[str, list[tuple[float, float, float, float, float]]] = {}
    prof: Profile | None = None
    try:
        fake = start_fake(tmp, tokenizer_path=tok_dir, script=SCRIPT, context_length=400_000)
        procs.append(fake)
        one = start_proxy(tmp, fake.url, tok_dir, "--workers", "1", db=str(tmp / "one.sqlite"))
        procs.append(one)
        many = start_proxy(tmp, fake.url, tok_dir, "--workers", str(workers), db=str(tmp / "many.sqlite"))
        procs.append(many)
        # Warm-up conversations through each proxy, enough to reach every worker (tokenizer loaded,
        # CA leaf certificates made, the shared system prompt cached).
        *_, reply = await through(one, ca, 8, 2, system, "warm")
        await through(many, ca, 8, 2, system, "warm")
        trivial = start_trivial(tmp, reply, "application/json")
        mitm = start_mitmdump(tmp, HOST, trivial.url)
        procs += [trivial, mitm]
        await through(mitm, ca, 8, 2, system, "warm")
        for r in range(rounds):
            for name, proxy in (
                ("polar-mitm, 1 worker", one),
                (f"polar-mitm, {workers} workers", many),
                ("mitmdump", mitm),
            ):
                upstream = trivial if proxy is mitm else fake
                if profile and proxy is one and r == rounds - 1:
                    with Profile(one.pid, tmp / "one.pyspy") as prof:
                        got = await through(proxy, ca, sessions, turns, system, f"r{r}-", upstream)
                else:
                    got = await through(proxy, ca, sessions, turns, system, f"r{r}-", upstream)
                rows.setdefault(name, []).append(got[:5])
            prompts = [
                t.prompt_ids for t in read_turns(tmp / "one.sqlite") if t.session_id.startswith(f"r{r}-")
            ]
            assert len(prompts) == n, f"expected {n} turns, stored {len(prompts)}"
            client0, up0 = time.process_time(), fake.cpu()
            secs = await direct(fake.url, prompts, sessions)
            rows.setdefault("direct /generate", []).append(
                (secs, 0.0, time.process_time() - client0, fake.cpu() - up0, 0.0)
            )
    finally:
        for p in procs:
            p.stop()
    best = {k: min(v) for k, v in rows.items()}  # each path's fastest round
    tps = {k: n / v[0] for k, v in best.items()}
    print(
        f"{sessions} concurrent sessions × {turns} turns ({n} turns), ~{context}-token system prompt, "
        f"fastest of {rounds} rounds; CPU in ms per turn"
    )
    # What the proxy alone could carry, its processes each on a core of their own and the client
    # and server elsewhere: one process is busy for `busiest` of every n turns.
    bound = {k: n / v[4] for k, v in best.items() if v[4]}
    print(
        "| path | seconds | turns/s | proxy CPU | client CPU | server CPU | busiest proxy process CPU |"
        " turns/s its CPU allows | vs mitmdump | vs 1 worker |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for k, (secs, cpu, client, up, busiest) in best.items():
        ms = [f"{c / n * 1000:.1f}" if c else "–" for c in (cpu, client, up, busiest)]
        allows = f"{bound[k]:.0f}" if k in bound else "–"
        print(
            f"| {k} | {secs:.2f} | {tps[k]:.1f} | {' | '.join(ms)} | {allows} | {tps[k] / tps['mitmdump']:.2f}× |"
            f" {tps[k] / tps['polar-mitm, 1 worker']:.2f}× |"
        )
    one, many = "polar-mitm, 1 worker", f"polar-mitm, {workers} workers"
    print(
        f"\nturns/s the busiest proxy process's CPU allows, {workers} workers against 1: "
        f"{bound[many] / bound[one]:.2f}× (measured turns/s: {tps[many] / tps[one]:.2f}×, on {os.cpu_count()} cores "
        "shared with the client and the server)"
    )
    if prof is not None:
        prof.print_top(45)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sessions", type=int, default=64)
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--context", type=int, default=2000, help="approximate system prompt tokens")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--profile", action="store_true", help="py-spy the one-worker proxy in the last round")
    a = ap.parse_args()
    asyncio.run(run(a.sessions, a.turns, a.context, a.workers, a.rounds, a.profile))


if __name__ == "__main__":
    main()
