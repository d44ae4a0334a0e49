"""Session affinity over several engines: the share of prompt tokens an engine serves from its
prefix cache, against one engine holding every conversation (the ideal), and the router's added
latency per turn against a direct engine — in one run.

4 fake engines (each its own process, each simulating its own prefix cache: `cached_tokens` is
the longest prefix of the prompt that engine has seen), 32 concurrent conversations of 10 turns
each (a shared system prompt, a task of their own, replies spliced back token for token) through
polar-mitm's policy and gateway, in front of:

- `ideal`: one engine serving every conversation (every prefix it could reuse is there; the
  shared system prompt is computed once, not once per engine);
- `manual + key`: SGLang's router (`sglang-router`, `--policy manual`) pinning our routing key;
- `cache_aware`, `round_robin`: the router's other policies;
- `--backend x4`: the four engines without a router (rendezvous hashing of the key).

The figure is each mode's cached share over the ideal's (goal for the affinity modes: >= 0.95).
Then `--latency-turns` sequential turns of one conversation, alternating between one engine
directly and the same engine behind the router: the router's added latency as a ratio.

    PYTHONPATH=$PWD .venv/bin/python bench/bench_engines.py [--conversations 32] [--turns 10]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

from _procs import start_fake, workdir

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from polar_mitm.backends.tokenizer_build import ensure_tokenizer  # noqa: E402
from polar_mitm.policy import Policy, PolicyConfig  # noqa: E402
from polar_mitm.proxy.gateway import Gateway  # noqa: E402
from polar_mitm.store.writer import Store  # noqa: E402
from tests.support.rig import GatewayRig  # noqa: E402
from tests.support.routers import Router  # noqa: E402

SYSTEM = "You are a coding agent working in a large repository; follow the house rules carefully. " * 40
ENGINES = 4


class Driver:
    """The gateway over a Policy over `url`, storing to a fresh SQLite file."""

    def __init__(self, tmp: Path, tok: Path, url: str):
        self.tmp, self.tok, self.url = tmp, tok, url

    async def __aenter__(self) -> Driver:
        from aiohttp.test_utils import TestClient, TestServer

        self.store = await Store.open(self.tmp / f"bench-{time.monotonic_ns()}.sqlite")
        await self.store.ensure_session("s-bench")
        self.policy = Policy(PolicyConfig(backend_url=self.url, tokenizer=str(self.tok)), self.store)
        self.client = TestClient(TestServer(Gateway(self.policy, default_session="s-bench").app()))
        await self.client.start_server()
        self.rig = GatewayRig(self.client, None, self.store)
        return self

    async def __aexit__(self, *exc) -> None:
        await self.client.close()
        await self.policy.close()
        await self.store.close()

    async def turn(self, messages: list[dict]) -> dict:
        body = {"model": "claude-sonnet-4-5", "max_tokens": 64, "system": SYSTEM, "messages": messages}
        status, _, raw = await self.rig.post("anthropic", body)
        reply = json.loads(raw)
        if status != 200:
            raise RuntimeError(f"turn failed ({status}): {raw[:300]!r}")
        return reply


def step_output(c: int, t: int) -> str:
    """What a tool printed at step t of conversation c: a few hundred tokens of its own, as agent
    contexts grow by tool output every turn."""
    lines = "".join(f"line {i} of the log of step {t} in conversation {c}: ok. " for i in range(25))
    return f"Step {t} printed:\n{lines}\nNow the next step, please."


async def conversation(d: Driver, c: int, turns: int, usage: list[tuple[int, int]]) -> None:
    task = f"Task {c}: " + f"refactor module number {c} and keep its tests passing. " * 8
    messages = [{"role": "user", "content": task}]
    for t in range(turns):
        reply = await d.turn(messages)
        u = reply["usage"]
        cached = u.get("cache_read_input_tokens", 0)
        usage.append((u["input_tokens"] + cached, cached))
        messages += [
            {"role": "assistant", "content": reply["content"]},
            {"role": "user", "content": step_output(c, t)},
        ]


async def cached_share(tmp: Path, tok: Path, url: str, conversations: int, turns: int) -> tuple[float, float]:
    """(cached prompt tokens / prompt tokens, seconds) over `conversations` concurrent ones."""
    usage: list[tuple[int, int]] = []
    t0 = time.perf_counter()
    async with Driver(tmp, tok, url) as d:
        await asyncio.gather(*(conversation(d, c, turns, usage) for c in range(conversations)))
    return sum(c for _, c in usage) / sum(p for p, _ in usage), time.perf_counter() - t0


def reset(engines) -> None:
    import urllib.request

    for e in engines:
        urllib.request.urlopen(urllib.request.Request(e.url + "/_fake/reset", method="POST"), timeout=10)


async def latency(tmp: Path, tok: Path, direct: str, routed: str, turns: int) -> tuple[float, float]:
    """Median seconds per turn, direct and through the router, alternating turn by turn."""
    times: dict[str, list[float]] = {direct: [], routed: []}
    async with Driver(tmp, tok, direct) as a, Driver(tmp, tok, routed) as b:
        msgs = {
            direct: [{"role": "user", "content": "say hi"}],
            routed: [{"role": "user", "content": "say hi"}],
        }
        for i in range(turns + 3):  # the first three of each: warm-up, not counted
            for d in (a, b) if i % 2 else (b, a):  # each goes first every other turn
                t0 = time.perf_counter()
                reply = await d.turn(msgs[d.url])
                if i >= 3:
                    times[d.url].append(time.perf_counter() - t0)
                msgs[d.url] = msgs[d.url][:1]  # the same one-turn prompt each time: the hop, not the growth
                del reply
    return statistics.median(times[direct]), statistics.median(times[routed])


async def main(conversations: int, turns: int, latency_turns: int) -> None:
    tmp = workdir("polar-bench-engines-")
    tok = ensure_tokenizer("qwen")
    engines = [
        start_fake(tmp, tokenizer_path=str(tok), model_path=str(tok), context_length=200_000)
        for _ in range(ENGINES)
    ]
    routers: list[Router] = []
    try:
        results: dict[str, tuple[float, float]] = {}
        results["ideal (1 engine)"] = await cached_share(tmp, tok, engines[0].url, conversations, turns)
        for policy in ("manual", "cache_aware", "round_robin"):
            reset(engines)
            router = Router(policy)
            routers.append(router)
            for e in engines:
                await asyncio.to_thread(router.add, e.url)
            name = "manual + key" if policy == "manual" else policy
            results[name] = await cached_share(tmp, tok, router.url, conversations, turns)
            router.stop()
        reset(engines)
        several = ",".join(e.url for e in engines)
        results[f"--backend x{ENGINES}"] = await cached_share(tmp, tok, several, conversations, turns)
        ideal = results["ideal (1 engine)"][0]
        print(f"{conversations} conversations x {turns} turns, {ENGINES} engines")
        print(f"{'mode':<20} {'cached share':>12} {'vs ideal':>9} {'wall s':>7}")
        for name, (share, wall) in results.items():
            print(f"{name:<20} {share:>12.3f} {share / ideal:>9.3f} {wall:>7.1f}")

        reset(engines)
        router = Router("manual")
        routers.append(router)
        await asyncio.to_thread(router.add, engines[1].url)
        d, r = await latency(tmp, tok, engines[1].url, router.url, latency_turns)
        print(
            f"per-turn latency over {latency_turns} turns: direct {d * 1000:.1f} ms, through the router "
            f"{r * 1000:.1f} ms: ratio {r / d:.3f} (+{(r - d) * 1000:.1f} ms)"
        )
    finally:
        for router in routers:
            router.stop()
        for e in engines:
            e.stop()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--conversations", type=int, default=32)
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--latency-turns", type=int, default=100)
    a = ap.parse_args()
    asyncio.run(main(a.conversations, a.turns, a.latency_turns))
