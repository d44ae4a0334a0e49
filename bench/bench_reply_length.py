"""Proxy cost against the length of a reply: is it linear?

A harness asks for one streamed Anthropic reply of n sampled tokens through `polar-mitm proxy`,
for n from 64 to 8,192, from two backends, each in its own process:

- `cumulative`: the fake SGLang backend with SGLang's default streaming (every chunk repeats
  everything so far); a scripted text cut at max_tokens;
- `incremental`: the same reply replayed as SGLang's `--incremental-streaming-output` chunks, one
  a token, by a replay server whose cost per chunk is constant (the fake decodes the whole reply
  for every chunk, so its own cost would grow with n and pace long replies differently);
- `cumulative-stream`: the fake again, with the proxy told to stream its cumulative chunks
  (`--backend-stream stream`); quadratic by nature, so keep its lengths short.

The proxy's CPU per turn is read from /proc; the direct baseline replays the same /generate
request to the backend, in the same run. Printed per length: the proxy's CPU per sampled token,
its marginal CPU per token between consecutive lengths (flat if the cost is linear), and the added
latency at the end of the reply (through the proxy minus direct). `--proxy-arg` passes options to
`polar-mitm proxy`; `--profile` records the proxy with py-spy during the longest replies.

    .venv/bin/python bench/bench_reply_length.py [--lengths 64,512,2048,4096,8192] [--reps 3]
        [--backends cumulative,incremental] [--proxy-arg=--chunk-interval --proxy-arg=0]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path

import httpx
from _procs import Proc, Profile, ensure_ca, start_fake, start_proxy, start_replay, workdir

from polar_mitm.backends.tokenizer import Tokenizer
from polar_mitm.backends.tokenizer_build import ensure_tokenizer

URL = "https://api.anthropic.com/v1/messages"
HEADERS = {"content-type": "application/json"}
PROMPT = "<|im_start|>user\nWrite.<|im_end|>\n<|im_start|>assistant\n"


async def timed(client: httpx.AsyncClient, url: str, content: bytes) -> tuple[float, bytes]:
    t0 = time.perf_counter()
    chunks = []
    async with client.stream("POST", url, content=content, headers=HEADERS) as r:
        async for chunk in r.aiter_bytes():
            chunks.append(chunk)
    return time.perf_counter() - t0, b"".join(chunks)


def incremental_streams(tok: Tokenizer, final: dict, lengths: list[int]) -> dict[int, dict]:
    """For each n: SGLang's incremental chunks (one a token) of the first n tokens of a finished
    /generate output, and that output cut at n, whole."""
    ids = final["output_ids"]
    lps = final["meta_info"]["output_token_logprobs"]
    texts = [""] + [tok.decode(ids[:k]).rstrip("\ufffd") for k in range(1, max(lengths) + 1)]
    meta = {"id": "replay", "prompt_tokens": final["meta_info"]["prompt_tokens"], "weight_version": "0"}
    out = {}
    for n in lengths:
        chunks = []
        for k in range(1, n + 1):
            m = {
                **meta,
                "finish_reason": {"type": "length", "length": n} if k == n else None,
                "output_token_logprobs": [lps[k - 1]],
            }
            chunks.append(
                json.dumps(
                    {"text": texts[k][len(texts[k - 1]) :], "output_ids": [ids[k - 1]], "meta_info": m}
                )
            )
        m = {**meta, "finish_reason": {"type": "length", "length": n}, "output_token_logprobs": lps[:n]}
        out[n] = {
            "chunks": chunks,
            "whole": json.dumps({"text": texts[n], "output_ids": ids[:n], "meta_info": m}),
        }
    return out


async def start_backend(tmp: Path, tok_dir: Path, kind: str, lengths: list[int]) -> tuple[Proc, Proc]:
    """(the backend the proxy talks to, the fake backend behind the replay if any)."""
    tok = Tokenizer.load(tok_dir)
    unit = "The proxy keeps every sampled token exactly as the policy produced it. "
    reply = unit * (2 * max(lengths) // len(tok.encode(unit)) + 2)  # repeated, a unit encodes shorter
    fake = start_fake(
        tmp, tokenizer_path=str(tok_dir), script=[{"match": "", "text": reply}], context_length=400_000
    )
    if kind != "incremental":
        return fake, fake
    async with httpx.AsyncClient(timeout=600) as c:
        body = {"input_ids": tok.encode(PROMPT), "sampling_params": {"max_new_tokens": max(lengths)}}
        final = (await c.post(fake.url + "/generate", json={**body, "return_logprob": True})).json()
    info = {
        "tokenizer_path": str(tok_dir),
        "tool_call_parser": "qwen25",
        "reasoning_parser": "qwen3",
        "context_length": 400_000,
        "incremental_streaming_output": True,
    }
    return start_replay(tmp, incremental_streams(tok, final, lengths), info), fake


async def measure(tmp: Path, tok_dir: Path, ca: Path, kind: str, lengths, reps, proxy_args, profile):
    backend, fake = await start_backend(tmp, tok_dir, kind, lengths)
    args = [*proxy_args, *(["--backend-stream", "stream"] if kind == "cumulative-stream" else [])]
    proxy = start_proxy(tmp, backend.url, str(tok_dir), *args)
    through = httpx.AsyncClient(
        proxy=proxy.url.replace("http://", "http://len:x@"), verify=str(ca), timeout=900
    )
    direct = httpx.AsyncClient(timeout=900)
    rows = []
    try:
        for n in lengths:
            body = {
                "model": "m",
                "max_tokens": n,
                "system": "You write long answers.",
                "messages": [{"role": "user", "content": f"Write {n} tokens."}],
                "stream": True,
            }
            raw = json.dumps(body).encode()
            await timed(through, URL, raw)  # warm
            last = (await direct.get(fake.url + "/_fake/requests?last=1")).json()["requests"]
            if backend is fake:
                sent = last[-1]["body"]  # the very request the proxy sent
            else:  # the replay answers any prompt: the same request, as the proxy streams it
                sent = {"input_ids": [1], "sampling_params": {"max_new_tokens": n}, "stream": True}
            generate = json.dumps(sent).encode()
            lat_through, lat_direct, cpu = [], [], []
            longest = profile and n == lengths[-1]
            prof = Profile(proxy.pid, tmp / f"profile-{n}-{kind}.txt") if longest else None
            if prof:
                prof.__enter__()
            try:
                for _ in range(reps):
                    c0 = proxy.cpu()
                    t, out = await timed(through, URL, raw)
                    cpu.append(proxy.cpu() - c0)
                    lat_through.append(t)
                    t, _ = await timed(direct, backend.url + "/generate", generate)
                    lat_direct.append(t)
            finally:
                if prof:
                    prof.__exit__(None, None, None)
                    prof.print_top(40)
            assert b"message_stop" in out, out[-500:]
            med = statistics.median
            rows.append((n, bool(sent.get("stream")), med(lat_direct), med(lat_through), med(cpu)))
            print(f"  {kind} backend, {n} tokens measured", flush=True)
    finally:
        await through.aclose()
        await direct.aclose()
        proxy.stop()
        backend.stop()
        fake.stop()
    return rows


def table(title: str, rows) -> None:
    print(f"\n{title}")
    print(
        "| reply tokens | backend streams | direct ms | through proxy ms | added ms | proxy CPU ms |"
        " CPU µs/token | marginal µs/token |"
    )
    print("|---|---|---|---|---|---|---|---|")
    prev = None
    for n, streamed, d, p, c in rows:
        marginal = f"{(c - prev[1]) / (n - prev[0]) * 1e6:.1f}" if prev else "–"
        print(
            f"| {n:,} | {'yes' if streamed else 'no: whole reply'} | {d * 1000:.1f} | {p * 1000:.1f} |"
            f" {(p - d) * 1000:.1f} | {c * 1000:.1f} | {c / n * 1e6:.1f} | {marginal} |"
        )
        prev = (n, c)
    if len(rows) >= 3:
        (n0, _, _, _, c0), (n1, _, _, _, c1) = rows[0], rows[1]
        (m0, _, _, _, e0), (m1, _, _, _, e1) = rows[-2], rows[-1]
        first, last = (c1 - c0) / (n1 - n0), (e1 - e0) / (m1 - m0)
        print(f"marginal CPU per token, longest step vs shortest step: {last / first:.2f}× (1 = linear)")


async def run(
    lengths: list[int], reps: int, backends: list[str], proxy_args: list[str], profile: bool
) -> None:
    tmp = workdir("polar-bench-len-")
    tok_dir = ensure_tokenizer("qwen")
    ca = ensure_ca(tmp)
    results = {
        kind: await measure(tmp, tok_dir, ca, kind, lengths, reps, proxy_args, profile) for kind in backends
    }
    for kind, rows in results.items():
        args = " ".join(proxy_args) or "defaults"
        table(f"{kind} backend (proxy options: {args}), medians of {reps}", rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="64,512,2048,4096,8192")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--backends", default="cumulative,incremental", help="also: cumulative-stream")
    ap.add_argument("--proxy-arg", action="append", default=[], help="a `polar-mitm proxy` argument")
    ap.add_argument("--profile", action="store_true", help="py-spy record the proxy on the longest replies")
    a = ap.parse_args()
    lengths = [int(x) for x in a.lengths.split(",")]
    asyncio.run(run(lengths, a.reps, a.backends.split(","), a.proxy_arg, a.profile))


if __name__ == "__main__":
    main()
