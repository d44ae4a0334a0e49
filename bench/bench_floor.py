"""Added latency per turn against the architecture's floor: polar-mitm vs. bare mitmdump.

Four paths, measured interleaved in the same run, at each context size:

- polar-mitm: a streamed Anthropic request through `polar-mitm proxy` to an engine;
- its direct baseline: the very /generate body the proxy sent (its bytes), straight to the engine;
- bare mitmdump (its default addons, quiet) intercepting the same HTTPS request and forwarding it
  (map_remote) to a trivial aiohttp server that answers polar-mitm's own reply bytes;
- its direct baseline: the same request straight to the trivial server.

So the floor is what mitmdump costs for the same bytes in both directions: the harness's request
as polar-mitm received it, and polar-mitm's reply as the harness received it. Every client keeps
its connection alive. The engine (`--engine replay`, the default) is as trivial as mitmdump's
server: it reads the /generate body as JSON and answers the fake SGLang backend's reply bytes for
that request, captured once, at once. `--engine fake` puts the fake backend itself there (the
bench's definition before 2026-12-03), which decodes the whole prompt on every request (~20 ms at
32k tokens on a 2-core machine): the proxy's work that overlaps the engine's then costs no
latency, and the ratio at long contexts reads lower than the proxy's own cost. Two
measurements, both printed:

- `grow`: later turns of a conversation (from --turn on, each measured turn echoing the one
  before, as a harness does): every polar-mitm turn is a new one, extending the last;
- `replay`: the conversation built through the proxy to --turn, then that same request sent
  again and again (a harness retrying a turn; every answer is a new branch from the same point).

Each proxy runs in its own process, so its CPU per turn is read from /proc as well. The figure
of the issue is the ratio of added latencies: (polar-mitm − its direct) / (mitmdump − its direct);
the goal is ≤ 1.5×. `--profile` records the polar-mitm process with py-spy (`--gil`: the thread holding
the GIL) during its turns and prints where its CPU goes.

    .venv/bin/python bench/bench_floor.py [--reps 30] [--contexts 1000,32000] [--turn 10]
        [--modes grow,replay] [--engine replay|fake] [--profile]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import time
from pathlib import Path

import httpx
from _procs import (
    Proc,
    Profile,
    ensure_ca,
    start_fake,
    start_mitmdump,
    start_proxy,
    start_replay,
    start_trivial,
    workdir,
)

from polar_mitm.backends.tokenizer import Tokenizer
from polar_mitm.backends.tokenizer_build import ensure_tokenizer

HOST = "api.anthropic.com"
URL = f"https://{HOST}/v1/messages"
BASH = {"name": "Bash", "description": "Run a command", "input_schema": {"type": "object", "properties": {}}}
SCRIPT = [{"match": "", "tool_call": {"name": "Bash", "arguments": {"command": "ls"}}}]
MAX_TOKENS = 64  # every request's; the policy sends it as max_new_tokens


def filler(tok: Tokenizer, tokens: int) -> str:
    unit = "The quick brown fox jumps over the lazy dog while the proxy records every token. "
    return unit * max(1, tokens // len(tok.encode(unit)))


async def timed(client: httpx.AsyncClient, url: str, **kw) -> tuple[float, bytes]:
    t0 = time.perf_counter()
    chunks = []
    async with client.stream("POST", url, **kw) as r:
        async for chunk in r.aiter_bytes():
            chunks.append(chunk)
    return time.perf_counter() - t0, b"".join(chunks)


async def conversation(client: httpx.AsyncClient, system: str, turns: int) -> list[dict]:
    """Messages of a conversation `turns - 1` tool calls deep (built through the proxy)."""
    msgs: list[dict] = [{"role": "user", "content": "start"}]
    for _ in range(turns - 1):
        r = await client.post(
            URL,
            json={
                "model": "m",
                "max_tokens": MAX_TOKENS,
                "system": system,
                "tools": [BASH],
                "messages": msgs,
            },
        )
        content = r.json()["content"]
        use = next(b for b in content if b["type"] == "tool_use")
        msgs += [
            {"role": "assistant", "content": content},
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": use["id"], "content": "file1\nfile2"}],
            },
        ]
    return msgs


async def measure_context(
    tmp: Path,
    tok: Tokenizer,
    fake: Proc,
    engine: Proc,
    polar: Proc,
    ca: Path,
    ctx: int,
    turn: int,
    reps: int,
    profile: bool,
    mode: str,
) -> dict:
    system = filler(tok, ctx)
    # One session per context and mode so the conversations do not meet.
    proxy_url = polar.url.replace("http://", f"http://floor{ctx}{mode}:x@")
    through = httpx.AsyncClient(proxy=proxy_url, verify=str(ca), timeout=300)
    msgs = await conversation(through, system, turn)
    headers = {"content-type": "application/json"}

    def request() -> bytes:
        body = {
            "model": "m",
            "max_tokens": MAX_TOKENS,
            "system": system,
            "tools": [BASH],
            "messages": msgs,
            "stream": True,
        }
        return json.dumps(body).encode()

    def echo(reply: bytes) -> None:
        """The conversation goes on: the reply's tool call and its result (as a harness would)."""
        call_id = re.search(rb'"id": ?"(toolu_[^"]+)"', reply).group(1).decode()
        use = {"type": "tool_use", "id": call_id, "name": "Bash", "input": {"command": "ls"}}
        result = {"type": "tool_result", "tool_use_id": call_id, "content": "file1\nfile2"}
        msgs.extend([{"role": "assistant", "content": [use]}, {"role": "user", "content": [result]}])

    raw = request()
    _, reply = await timed(through, URL, content=raw, headers=headers)
    if mode == "grow":
        echo(reply)
    trivial = start_trivial(tmp, reply)
    mitm = start_mitmdump(tmp, HOST, trivial.url)
    via_mitm = httpx.AsyncClient(proxy=mitm.url, verify=str(ca), timeout=300)
    direct = httpx.AsyncClient(timeout=300)
    sent = {"body": b""}

    async def polar_turn() -> tuple[float, bytes]:
        """A later turn through polar-mitm; the next one echoes its reply (grow) or is the same
        request again (replay)."""
        sent["raw"] = request() if mode == "grow" else raw
        t, reply = await timed(through, URL, content=sent["raw"], headers=headers)
        if mode == "grow":
            echo(reply)
        if engine is fake:  # its log holds the body as read: written again, as compactly
            last = (await direct.get(fake.url + "/_fake/requests?last=1")).json()["requests"][-1]["body"]
            sent["body"] = json.dumps(last, separators=(",", ":")).encode()
        else:
            sent["body"] = (await direct.get(engine.url + "/_replay/last")).content
        sent["tokens"] = len(json.loads(sent["body"])["input_ids"])
        return t, reply

    paths = {
        "polar": polar_turn,
        "fake direct": lambda: timed(direct, engine.url + "/generate", content=sent["body"], headers=headers),
        "mitmdump": lambda: timed(via_mitm, URL, content=sent["raw"], headers=headers),
        "trivial direct": lambda: timed(
            direct, trivial.url + "/v1/messages", content=sent["raw"], headers=headers
        ),
    }
    cpu_of = {"polar": polar, "mitmdump": mitm}
    times: dict[str, list[float]] = {k: [] for k in paths}
    cpu: dict[str, float] = {k: 0.0 for k in cpu_of}
    try:
        for _ in range(3):  # warm: connections, caches
            for go in paths.values():
                await go()
        prof = Profile(polar.pid, tmp / f"profile-{ctx}-{mode}.txt", gil=True) if profile else None
        if prof:
            prof.__enter__()
        try:
            for _ in range(reps):
                for name, go in paths.items():
                    proc = cpu_of.get(name)
                    c0 = proc.cpu() if proc else 0.0
                    t, _ = await go()
                    c1 = proc.cpu() if proc else 0.0
                    times[name].append(t)
                    cpu[name] = cpu.get(name, 0.0) + c1 - c0
        finally:
            if prof:
                prof.__exit__(None, None, None)
                prof.print_top()
    finally:
        for c in (through, via_mitm, direct):
            await c.aclose()
        mitm.stop()
        trivial.stop()
    prompt_tokens = sent["tokens"]
    raw = sent["raw"]
    med = {k: statistics.median(v) * 1000 for k, v in times.items()}
    # The spread of the added latencies: each rep's pair of paths, quartiles over the reps.
    added = {
        "polar": [a - b for a, b in zip(times["polar"], times["fake direct"], strict=True)],
        "mitmdump": [a - b for a, b in zip(times["mitmdump"], times["trivial direct"], strict=True)],
    }
    spread = {k: statistics.quantiles([x * 1000 for x in v], n=4) for k, v in added.items()}
    return {
        "mode": mode,
        "ctx": ctx,
        "prompt_tokens": prompt_tokens,
        "request_bytes": len(raw),
        "reply_bytes": len(reply),
        "med": med,
        "cpu": {k: v / reps * 1000 for k, v in cpu.items()},
        "spread": spread,
    }


async def start_replay_engine(tmp: Path, fake: Proc, tok: Tokenizer) -> Proc:
    """The replay engine: the fake backend's whole reply (the script's tool call, with logprobs)
    to a /generate request as polar-mitm sends it, answered to every request at once."""
    async with httpx.AsyncClient(timeout=60) as c:
        ids = tok.encode("<|im_start|>user\nstart<|im_end|>\n<|im_start|>assistant\n")
        body = {"input_ids": ids, "sampling_params": {"max_new_tokens": MAX_TOKENS}, "return_logprob": True}
        whole = (await c.post(fake.url + "/generate", json=body)).text
        info = {
            **(await c.get(fake.url + "/get_server_info")).json(),
            **(await c.get(fake.url + "/model_info")).json(),
        }
    info["incremental_streaming_output"] = False  # as the fake: the proxy asks for the whole reply
    return start_replay(tmp, {MAX_TOKENS: {"whole": whole, "chunks": [whole]}}, info)


async def run(
    reps: int,
    contexts: list[int],
    turn: int,
    profile: bool,
    proxy_args: list[str],
    modes: list[str],
    engine_kind: str,
) -> None:
    tmp = workdir("polar-bench-floor-")
    tok_dir = ensure_tokenizer("qwen")
    tok = Tokenizer.load(tok_dir)
    ca = ensure_ca(tmp)
    fake = start_fake(tmp, tokenizer_path=str(tok_dir), script=SCRIPT, context_length=400_000)
    engine = fake if engine_kind == "fake" else await start_replay_engine(tmp, fake, tok)
    polar = start_proxy(tmp, engine.url, str(tok_dir), *proxy_args)
    rows = []
    try:
        for ctx in contexts:
            for mode in modes:
                rows.append(
                    await measure_context(tmp, tok, fake, engine, polar, ca, ctx, turn, reps, profile, mode)
                )
                print(f"  measured ~{ctx} tokens, {mode}", flush=True)
    finally:
        polar.stop()
        if engine is not fake:
            engine.stop()
        fake.stop()
    print()
    print(
        f"engine: {engine_kind}; turn {turn} of a conversation, keep-alive, medians of {reps} (ms), added: median of the"
        f" paths' medians [quartiles of each rep's pair]; CPU is the proxy process's per turn;"
        f" load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}"
    )
    print(
        "| mode | context | prompt tokens | request KB | reply KB | engine direct | polar-mitm | polar added |"
        " polar CPU | trivial direct | mitmdump | mitmdump added | mitmdump CPU | added ratio |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        m, c, q = r["med"], r["cpu"], r["spread"]
        pa, ma = m["polar"] - m["fake direct"], m["mitmdump"] - m["trivial direct"]
        print(
            f"| {r['mode']} | ~{r['ctx'] // 1000}k | {r['prompt_tokens']:,} | {r['request_bytes'] / 1024:.0f} |"
            f" {r['reply_bytes'] / 1024:.1f} | {m['fake direct']:.1f} | {m['polar']:.1f} |"
            f" {pa:.1f} [{q['polar'][0]:.1f}–{q['polar'][2]:.1f}] | {c['polar']:.1f} |"
            f" {m['trivial direct']:.1f} | {m['mitmdump']:.1f} |"
            f" {ma:.1f} [{q['mitmdump'][0]:.1f}–{q['mitmdump'][2]:.1f}] | {c['mitmdump']:.1f} |"
            f" {pa / ma:.2f}× |"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--contexts", default="1000,32000")
    ap.add_argument("--turn", type=int, default=10, help="the measured turn of the conversation")
    ap.add_argument("--profile", action="store_true", help="py-spy record the polar-mitm process")
    ap.add_argument("--proxy-arg", action="append", default=[], help="extra `polar-mitm proxy` argument")
    ap.add_argument(
        "--modes", default="grow,replay", help="grow: every turn a new one; replay: the same turn again"
    )
    ap.add_argument("--engine", choices=("replay", "fake"), default="replay", help="what polar-mitm talks to")
    a = ap.parse_args()
    modes = [m for m in a.modes.split(",") if m]
    if not set(modes) <= {"grow", "replay"}:
        ap.error("--modes: grow and/or replay")
    asyncio.run(
        run(a.reps, [int(x) for x in a.contexts.split(",")], a.turn, a.profile, a.proxy_arg, modes, a.engine)
    )


if __name__ == "__main__":
    main()
