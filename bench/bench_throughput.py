"""Turns per second through one proxy: many concurrent sessions, each a growing conversation.

Each simulated harness (its own proxy credentials, so its own session) sends a streamed
Anthropic request, echoes the reply with a tool result, and goes on for --turns turns. The
baseline is the same number of /generate calls with the same input ids, at the same
concurrency, straight to the fake SGLang backend, measured in the same run.

    .venv/bin/python bench/bench_throughput.py [--sessions 16] [--turns 10] [--context 2000]
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

import httpx

from polar_mitm.backends.fake import FakeBackendConfig, start_fake_backend
from polar_mitm.backends.policy import PolicyConfig
from polar_mitm.backends.tokenizer_build import ensure_tokenizer
from polar_mitm.runtime.proxy import PolarProxy, ProxyConfig
from polar_mitm.store.db import read_turns

URL = "https://api.anthropic.com/v1/messages"
BASH = {"name": "Bash", "description": "Run a command", "input_schema": {"type": "object", "properties": {}}}
SCRIPT = [{"match": "", "tool_call": {"name": "Bash", "arguments": {"command": "ls"}}}]


async def session(proxy: PolarProxy, sid: str, turns: int, system: str) -> None:
    host, port = proxy.url.removeprefix("http://").split(":")
    async with httpx.AsyncClient(
        proxy=f"http://{sid}:x@{host}:{port}", verify=str(proxy.ca.cert), timeout=300
    ) as c:
        msgs: list[dict] = [{"role": "user", "content": f"session {sid}: start"}]
        for _ in range(turns):
            r = await c.post(
                URL,
                json={"model": "m", "max_tokens": 64, "system": system, "tools": [BASH], "messages": msgs},
            )
            content = r.json()["content"]
            use = next(b for b in content if b["type"] == "tool_use")
            msgs += [
                {"role": "assistant", "content": content},
                {
                    "role": "user",
                    "content": [{"type": "tool_result", "tool_use_id": use["id"], "content": "ok"}],
                },
            ]


async def direct(backend: str, prompts: list[list[int]], concurrency: int) -> float:
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=300) as c:

        async def one(ids: list[int]) -> None:
            async with sem:
                await c.post(
                    backend + "/generate",
                    json={
                        "input_ids": ids,
                        "sampling_params": {"max_new_tokens": 64},
                        "return_logprob": True,
                    },
                )

        t0 = time.perf_counter()
        await asyncio.gather(*(one(p) for p in prompts))
        return time.perf_counter() - t0


async def run(sessions: int, turns: int, context: int) -> None:
    tok_dir = ensure_tokenizer("qwen")
    tmp = Path(tempfile.mkdtemp(prefix="polar-bench-"))
    runner, backend = await start_fake_backend(
        FakeBackendConfig(tokenizer_path=str(tok_dir), script=SCRIPT, context_length=400_000)
    )
    proxy = PolarProxy(
        ProxyConfig(
            db=str(tmp / "bench.sqlite"),
            certs_dir=tmp / "certs",
            policy=PolicyConfig(backend_url=backend, tokenizer=str(tok_dir)),
        )
    )
    await proxy.start()
    system = "You are a coding agent working in a large repository. " * max(1, context // 11)
    try:
        t0 = time.perf_counter()
        await asyncio.gather(*(session(proxy, f"s{i}", turns, system) for i in range(sessions)))
        through = time.perf_counter() - t0
        prompts = [t.prompt_ids for t in read_turns(proxy.config.db)]
        straight = await direct(backend, prompts, sessions)
    finally:
        await proxy.stop()
        await runner.cleanup()
    n = sessions * turns
    assert len(prompts) == n, f"expected {n} turns, stored {len(prompts)}"
    print(f"{sessions} concurrent sessions × {turns} turns, ~{context}-token system prompt ({n} turns)")
    print("| path | seconds | turns/s | ratio |")
    print("|---|---|---|---|")
    print(f"| direct /generate | {straight:.2f} | {n / straight:.1f} | 1.00× |")
    print(f"| through polar-mitm | {through:.2f} | {n / through:.1f} | {through / straight:.2f}× time |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sessions", type=int, default=16)
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--context", type=int, default=2000, help="approximate system prompt tokens")
    a = ap.parse_args()
    asyncio.run(run(a.sessions, a.turns, a.context))


if __name__ == "__main__":
    main()
