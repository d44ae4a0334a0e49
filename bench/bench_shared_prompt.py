"""Turn 1 of a new session whose system prompt and tools were seen before, against a never-seen one.

RL rollouts start thousands of sessions with the same system prompt and tools. Each measured turn is
turn 1 of a new session (its own proxy credentials) through `polar-mitm proxy` (its own process)
to the fake SGLang backend; `seen` sessions share one system prompt, `never seen` ones each start
theirs with a unique line, so nothing of it can be reused. The proxy's CPU per turn comes from
/proc; the direct baseline replays the very /generate body the proxy sent. The figure of the issue
is seen / never seen (goal: ≤ 0.25), interleaved in the same run.

    .venv/bin/python bench/bench_shared_prompt.py [--reps 10] [--context 30000]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
import uuid

import httpx
from _procs import ensure_ca, start_fake, start_proxy, workdir

from polar_mitm.backends.tokenizer import Tokenizer
from polar_mitm.backends.tokenizer_build import ensure_tokenizer

URL = "https://api.anthropic.com/v1/messages"
HEADERS = {"content-type": "application/json"}
BASH = {"name": "Bash", "description": "Run a command", "input_schema": {"type": "object", "properties": {}}}
TOOLS = [BASH] + [
    {
        "name": f"Tool{i}",
        "description": f"Tool number {i}: " + "does a thing. " * 20,
        "input_schema": BASH["input_schema"],
    }
    for i in range(10)
]
SCRIPT = [{"match": "", "tool_call": {"name": "Bash", "arguments": {"command": "ls"}}}]


async def timed(client: httpx.AsyncClient, url: str, content: bytes) -> float:
    t0 = time.perf_counter()
    async with client.stream("POST", url, content=content, headers=HEADERS) as r:
        async for _ in r.aiter_bytes():
            pass
    return time.perf_counter() - t0


async def run(reps: int, context: int) -> None:
    tmp = workdir("polar-bench-shared-")
    tok_dir = ensure_tokenizer("qwen")
    tok = Tokenizer.load(tok_dir)
    ca = ensure_ca(tmp)
    unit = "You are a coding agent working in a large repository; follow the house rules. "
    system = unit * (context // len(tok.encode(unit)))
    fake = start_fake(tmp, tokenizer_path=str(tok_dir), script=SCRIPT, context_length=400_000)
    proxy = start_proxy(tmp, fake.url, str(tok_dir))
    direct = httpx.AsyncClient(timeout=300)
    times: dict[str, list[float]] = {"seen": [], "never seen": []}
    cpu: dict[str, list[float]] = {"seen": [], "never seen": []}
    straight: dict[str, list[float]] = {"seen": [], "never seen": []}
    prompt_tokens = 0
    try:

        async def turn1(kind: str, n: int) -> tuple[float, float, bytes]:
            nonce = "" if kind == "seen" else f"Session {uuid.uuid4()}.\n"
            body = {
                "model": "m",
                "max_tokens": 64,
                "system": nonce + system,
                "tools": TOOLS,
                "messages": [{"role": "user", "content": f"task {n}: list the files"}],
                "stream": True,
            }
            session = f"{kind.replace(' ', '-')}-{n}"
            url = proxy.url.replace("http://", f"http://{session}:x@")
            async with httpx.AsyncClient(proxy=url, verify=str(ca), timeout=300) as c:
                c0 = proxy.cpu()
                t = await timed(c, URL, json.dumps(body).encode())
                used = proxy.cpu() - c0
            last = (await direct.get(fake.url + "/_fake/requests?last=1")).json()["requests"][-1]["body"]
            return t, used, json.dumps(last).encode()

        await turn1("seen", -1)  # the shared prompt is seen once before
        await turn1("never seen", -1)
        for n in range(reps):
            for kind in ("seen", "never seen"):
                t, used, sent = await turn1(kind, n)
                times[kind].append(t)
                cpu[kind].append(used)
                straight[kind].append(await timed(direct, fake.url + "/generate", sent))
                prompt_tokens = len(json.loads(sent)["input_ids"])
    finally:
        await direct.aclose()
        proxy.stop()
        fake.stop()
    med = {
        k: {n: statistics.median(v[k]) * 1000 for n, v in (("t", times), ("cpu", cpu), ("d", straight))}
        for k in times
    }
    print(
        f"\nturn 1 of a new session, {prompt_tokens:,}-token prompt ({len(TOOLS)} tools), medians of {reps} (ms)"
    )
    print("| system prompt and tools | direct | through proxy | added | proxy CPU |")
    print("|---|---|---|---|---|")
    for k, m in med.items():
        print(f"| {k} | {m['d']:.1f} | {m['t']:.1f} | {m['t'] - m['d']:.1f} | {m['cpu']:.1f} |")
    s, u = med["seen"], med["never seen"]
    print(
        f"seen / never seen: proxy CPU {s['cpu'] / u['cpu']:.2f}×, added latency "
        f"{(s['t'] - s['d']) / (u['t'] - u['d']):.2f}×, latency {s['t'] / u['t']:.2f}× (goal ≤ 0.25)"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--context", type=int, default=30000, help="approximate system prompt tokens")
    a = ap.parse_args()
    asyncio.run(run(a.reps, a.context))


if __name__ == "__main__":
    main()
