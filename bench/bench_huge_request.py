"""What one huge request costs everyone else: the stall it causes to a concurrent small request
(as a ratio to the small request alone), and the proxy's memory before, during and after it.

The fake SGLang backend and `polar-mitm proxy` run in processes of their own (the proxy's RSS is
read from /proc, its worker processes' apart); this process is the harnesses: one sends a request
with `--mb` megabytes of text in one user message (a 20 MB paste, a log file read whole), while
another sends small requests back to back until it is answered.

    .venv/bin/python bench/bench_huge_request.py [--mb 20] [--context 32768] [--small 20]
    .venv/bin/python bench/bench_huge_request.py --messages 70000   # many short messages instead

`--context` is the policy's context length (the fake backend's `/get_server_info`): 32768 makes
the 20 MB request one that cannot fit; 262144 one whose byte length alone does not prove that,
so it must be tokenized; `--mb 1.5 --context 1000000` one that fits and is answered.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import threading
import time
from pathlib import Path

import httpx
from _procs import Proc, ensure_ca, start_fake, start_proxy, workdir

from polar_mitm.backends.tokenizer_build import ensure_tokenizer

URL = "https://api.anthropic.com/v1/messages"
SMALL = {"model": "m", "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}]}
WORDS = (
    "the of and to in is was for that on with as by at from his her an which or be are this had not "
    "but were they have one all their there been has when who will more no if out so said what up its "
    "about into than them can only other new some could time these two may then do first any my now "
    "such like our over man me even most made after also did many before must through back years "
    "where much your way well down should because each just those people how too little state good "
    "very make world still own see men work long get here between both life being under never day "
    "error: warning: line file src/main.py 0x7f3a 404 200 GET POST ./build --verbose {} [] () ;"
).split()


def text_of(megabytes: float) -> str:
    """English-like text with log noise (about 4-5 bytes per token), reproducible."""
    rng = random.Random(0)
    n = int(megabytes * 1_000_000)
    out, size = [], 0
    while size < n:
        line = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 16))) + "\n"
        out.append(line)
        size += len(line)
    return "".join(out)[:n]


def rss_mb(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def children_rss_mb(pid: int) -> float:
    """RSS of the process's descendants (the tokenizer's worker processes)."""
    total = 0.0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            kids = (task / "children").read_text().split()
        except OSError:
            continue
        for kid in kids:
            total += rss_mb(int(kid)) + children_rss_mb(int(kid))
    return total


class Sampler(threading.Thread):
    """The proxy's RSS (and its workers') every 20 ms, with the peaks since the last `mark`."""

    def __init__(self, proc: Proc):
        super().__init__(daemon=True)
        self.pid = proc.pid
        self.peak = self.peak_workers = 0.0
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.wait(0.02):
            self.peak = max(self.peak, rss_mb(self.pid))
            self.peak_workers = max(self.peak_workers, children_rss_mb(self.pid))

    def mark(self) -> None:
        self.peak = self.peak_workers = 0.0


async def timed(client: httpx.AsyncClient, body: dict) -> tuple[float, int]:
    t0 = time.perf_counter()
    r = await client.post(URL, json=body)
    return time.perf_counter() - t0, r.status_code


def many_messages(n: int) -> list[dict]:
    """`n` short messages, user and assistant in turn, ending with a user's."""
    msgs = [{"role": ("user", "assistant")[i % 2], "content": f"message {i}"} for i in range(n)]
    return msgs if n % 2 else msgs[:-1]


async def main(megabytes: float, context: int, small_n: int, messages: int = 0) -> None:
    tmp = workdir("polar-bench-huge-")
    tok = ensure_tokenizer("qwen")
    ca = ensure_ca(tmp)
    fake = start_fake(tmp, tokenizer_path=str(tok), context_length=context)
    proxy = start_proxy(tmp, fake.url, str(tok))
    sampler = Sampler(proxy)
    sampler.start()
    huge = {"model": "m", "max_tokens": 16, "messages": [{"role": "user", "content": text_of(megabytes)}]}
    if messages:
        huge["messages"] = many_messages(messages)
    try:
        async with httpx.AsyncClient(proxy=proxy.url, verify=str(ca), timeout=900) as client:
            for _ in range(5):  # warm-up: tokenizer loaded, connections open
                await timed(client, SMALL)
            alone = [(await timed(client, SMALL))[0] for _ in range(small_n)]
            rss_before = rss_mb(proxy.pid)
            sampler.mark()

            t0 = time.perf_counter()
            big = asyncio.create_task(timed(client, huge))
            during: list[float] = []
            while not big.done() or not during:
                during.append((await timed(client, SMALL))[0])
            big_s, big_status = await big
            big_wall = time.perf_counter() - t0
            peak, peak_workers = sampler.peak, sampler.peak_workers

            await asyncio.sleep(3)
            for _ in range(small_n):
                await timed(client, SMALL)
            rss_after = rss_mb(proxy.pid)
            workers_after = children_rss_mb(proxy.pid)
    finally:
        sampler.stop.set()
        proxy.stop()
        fake.stop()

    base = statistics.median(alone)
    what = f"{messages:,} messages" if messages else f"{megabytes:g} MB of text"
    print(f"\nhuge request: {what}, policy context {context:,} tokens")
    print(f"  answer: HTTP {big_status} after {big_s:.2f} s (wall {big_wall:.2f} s)")
    print(f"  small request alone: median {base * 1000:.1f} ms over {len(alone)}")
    print(
        f"  small requests during it: {len(during)}, median {statistics.median(during) * 1000:.1f} ms "
        f"({statistics.median(during) / base:.1f}x), worst {max(during) * 1000:.1f} ms "
        f"({max(during) / base:.1f}x)"
    )
    print(
        f"  proxy RSS: before {rss_before:.0f} MB, peak during {peak:.0f} MB, after {rss_after:.0f} MB"
        f"; worker processes: peak {peak_workers:.0f} MB, after {workers_after:.0f} MB"
    )


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=float, default=20.0, help="megabytes of text in the huge request")
    ap.add_argument("--context", type=int, default=32768, help="the policy's context length")
    ap.add_argument("--small", type=int, default=20, help="small requests timed alone and after")
    ap.add_argument("--messages", type=int, default=0, help="instead: this many short messages")
    args = ap.parse_args()
    asyncio.run(main(args.mb, args.context, args.small, args.messages))
