"""Per-turn overhead of the proxy: a turn through polar-mitm vs. the same input ids sent straight
to the backend, at ~1k and ~64k-token contexts, on turn 1 and on turn 50 of a conversation.

Everything runs in this process on loopback (fake SGLang backend, mitmproxy, gateway, SQLite);
figures are medians over --reps and are reported as ratios against the direct baseline measured
in the same run, because the machines are shared and noisy.

    .venv/bin/python bench/bench_turn_overhead.py [--reps 5] [--contexts 1000,64000]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from polar_mitm.backends.tokenizer import Tokenizer
from polar_mitm.backends.tokenizer_build import ensure_tokenizer
from polar_mitm.fake import FakeBackendConfig, start_fake_backend
from polar_mitm.policy import PolicyConfig
from polar_mitm.providers import anthropic
from polar_mitm.proxy.embedded import PolarProxy, ProxyConfig
from polar_mitm.store.reader import read_turns

URL = "https://api.anthropic.com/v1/messages"
BASH = {"name": "Bash", "description": "Run a command", "input_schema": {"type": "object", "properties": {}}}
# Every turn calls a tool, so a conversation can be driven to any depth.
SCRIPT = [{"match": "", "tool_call": {"name": "Bash", "arguments": {"command": "ls"}}}]


def filler(tok: Tokenizer, tokens: int) -> str:
    unit = "The quick brown fox jumps over the lazy dog while the proxy records every token. "
    per = len(tok.encode(unit))
    return unit * max(1, tokens // per)


async def timed_stream(client: httpx.AsyncClient, url: str, **kw) -> tuple[float, bytes]:
    t0 = time.perf_counter()
    body = b""
    async with client.stream("POST", url, **kw) as r:
        async for chunk in r.aiter_bytes():
            body += chunk
    return time.perf_counter() - t0, body


async def direct(backend: str, ids: list[int], sp: dict) -> float:
    async with httpx.AsyncClient(timeout=120) as c:
        t, _ = await timed_stream(
            c,
            backend + "/generate",
            json={"input_ids": ids, "sampling_params": sp, "return_logprob": True, "stream": True},
        )
        return t


async def run(reps: int, contexts: list[int], turns_deep: int) -> None:
    tok_dir = ensure_tokenizer("qwen")
    tok = Tokenizer.load(tok_dir)
    tmp = Path(tempfile.mkdtemp(prefix="polar-bench-"))
    runner, backend = await start_fake_backend(
        FakeBackendConfig(tokenizer_path=str(tok_dir), script=SCRIPT, context_length=400_000)
    )
    proxy = PolarProxy(
        ProxyConfig(
            db=str(tmp / "bench.sqlite"),
            certs_dir=tmp / "certs",
            default_session="bench",
            policy=PolicyConfig(backend_url=backend, tokenizer=str(tok_dir)),
        )
    )
    await proxy.start()
    await proxy.store.ensure_session("bench")
    client = httpx.AsyncClient(proxy=proxy.url, verify=str(proxy.ca.cert), timeout=300)
    rows = []
    try:
        for ctx in contexts:
            system = filler(tok, ctx)
            # Turn 1, repeated: each is a fresh conversation with the same prompt.
            for label, n_turns in (("turn 1", 1), (f"turn {turns_deep}", turns_deep)):
                msgs: list[dict] = [{"role": "user", "content": "start"}]
                # Build the conversation up to the measured turn (not timed).
                for _ in range(n_turns - 1):
                    r = await client.post(
                        URL,
                        json={
                            "model": "m",
                            "max_tokens": 64,
                            "system": system,
                            "tools": [BASH],
                            "messages": msgs,
                        },
                    )
                    content = r.json()["content"]
                    use = [b for b in content if b["type"] == "tool_use"][0]
                    msgs += [
                        {"role": "assistant", "content": content},
                        {
                            "role": "user",
                            "content": [
                                {"type": "tool_result", "tool_use_id": use["id"], "content": "file1\nfile2"}
                            ],
                        },
                    ]
                body = {
                    "model": "m",
                    "max_tokens": 64,
                    "system": system,
                    "tools": [BASH],
                    "messages": msgs,
                    "stream": True,
                }
                through, straight, render = [], [], []
                for _ in range(reps):
                    t, _ = await timed_stream(client, URL, json=body)
                    through.append(t)
                    last = list(read_turns(proxy.config.db))[-1]
                    straight.append(await direct(backend, last.prompt_ids, {"max_new_tokens": 64}))
                    req = anthropic.parse_request(body)
                    t0 = time.perf_counter()
                    await proxy.policy.prompt(req, "bench")
                    render.append(time.perf_counter() - t0)
                rows.append(
                    (
                        ctx,
                        label,
                        len(last.prompt_ids),
                        statistics.median(straight),
                        statistics.median(through),
                        statistics.median(render),
                    )
                )
                print(f"  measured {label} at ~{ctx} tokens", flush=True)
    finally:
        await client.aclose()
        await proxy.stop()
        await runner.cleanup()

    print()
    print(
        "| context | turn | prompt tokens | direct ms | through proxy ms | overhead ms | ratio | prompt build ms |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for ctx, label, n, d, p, r in rows:
        print(
            f"| ~{ctx // 1000}k | {label} | {n} | {d * 1000:.1f} | {p * 1000:.1f} | {(p - d) * 1000:.1f} | "
            f"{p / d:.2f}x | {r * 1000:.1f} |"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--contexts", default="1000,64000")
    ap.add_argument("--turns", type=int, default=50, help="depth of the later measured turn")
    a = ap.parse_args()
    asyncio.run(run(a.reps, [int(x) for x in a.contexts.split(",")], a.turns))


if __name__ == "__main__":
    main()
