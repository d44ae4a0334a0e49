"""What the two generation endpoints share: /generate (`server.py`) and /v1/chat/completions
(`chat.py`) both serve a `Generation` through `_Handlers`.

One generation as a request asks for it (`_Item`); starting it (cached tokens, in-flight
registration, its sampling draw); releasing its tokens over time (first-token and per-token
delays, `stream_interval`, aborts, the `abort` / `drop_midstream` faults); the faults that replace
a whole response; and the /generate output after k tokens (`text`, `output_ids`, `meta_info` with
logprobs), which the chat endpoint also returns as `meta_info`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from polar_mitm.fake.contract import GenParams, _dumps, _json
from polar_mitm.fake.engine import Generation
from polar_mitm.fake.script import scripted_logprob
from polar_mitm.fake.state import FakeBackendState, FaultMode, _InFlight

_ABORTED = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}


@dataclass
class _Item:
    """One generation of a (possibly batched) request."""

    rid: str
    prompt_ids: list[int]
    params: GenParams
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    return_text_in_logprobs: bool = False
    return_prompt_token_ids: bool = False
    sample_index: int = 0
    index: int = 0
    cached_tokens: int = 0


class _Handlers:
    """What the request handlers of both generation endpoints share; all state lives in
    `FakeBackendState`."""

    def __init__(self, state: FakeBackendState) -> None:
        self.s = state

    # --- bookkeeping --------------------------------------------------------------------------

    def _log(self, request: web.Request, raw: bytes) -> None:
        # Raw text, parsed only when read: a parsed 30k-token prompt costs ~1 MB of Python ints.
        s = self.s
        s.request_count += 1
        s.counts[request.path] += 1
        s.requests.append(
            {
                "n": s.request_count,
                "method": request.method,
                "path": request.path,
                "body": raw.decode("utf-8", errors="replace"),
                "time": time.time(),
                # The router's sticky-session key, as this engine received it (None: none sent).
                "routing_key": request.headers.get("X-SMG-Routing-Key"),
            }
        )
        while len(s.requests) > s.config.request_log_size:
            s.requests.popleft()

    async def _fault_response(self, fault: FaultMode, stream: bool) -> web.Response | None:
        """The response that replaces a normal one, or None for faults that act during generation."""
        if fault == "http500":
            return _json(
                {"error": {"message": "Internal server error (injected by the polar-mitm fake backend)"}}, 500
            )
        if fault == "garbage":
            if stream:
                return web.Response(body=b"data: {garbage\n\n", content_type="text/event-stream")
            return web.Response(body=b"\x00{not json at all\xff", content_type="application/json")
        if fault == "hang":  # a stuck scheduler: /health_generate waits while this holds
            self.s.hanging += 1
            try:
                await asyncio.wait_for(self.s.shutting_down.wait(), timeout=self.s.config.hang_seconds)
            except TimeoutError:
                pass
            finally:
                self.s.hanging -= 1
            return _json({"error": {"message": "hang fault released"}}, 503)
        return None

    # --- generation over time -----------------------------------------------------------------

    def _start(self, item: _Item) -> Generation:
        self.s.in_flight[item.rid] = _InFlight(item.rid)
        draw = self.s.next_draw(item.prompt_ids, item.params, item.sample_index)
        gen = self.s.engine.generate(item.prompt_ids, item.params, top_n=item.top_logprobs_num, draw=draw)
        item.cached_tokens = self.s.cached_tokens(item.prompt_ids, gen.output_ids)
        return gen

    async def _steps(
        self, item: _Item, gen: Generation, fault: FaultMode | None
    ) -> AsyncGenerator[tuple[int, dict[str, Any] | None], None]:
        """(tokens so far, finish reason or None) as the tokens are "generated": honors the delays,
        aborts, `stream_interval` and the abort / drop_midstream faults."""
        cfg = self.s.config
        flight = self.s.in_flight[item.rid]
        n = len(gen.output_ids)
        cut = n // 2 if fault in ("abort", "drop_midstream") else None
        if n == 0:
            yield 0, gen.finish_reason
            return
        for k in range(1, n + 1):
            delay = cfg.first_token_delay if k == 1 else cfg.token_delay
            if delay > 0:
                await asyncio.sleep(delay)
            if flight.aborted or (fault == "abort" and cut is not None and k > cut):
                yield k - 1, dict(_ABORTED)
                return
            if fault == "drop_midstream" and cut is not None and k > cut:
                raise ConnectionResetError("drop_midstream fault")
            if k == n:
                yield k, gen.finish_reason
            elif k % item.params.stream_interval == 0:
                yield k, None

    def _output(
        self, item: _Item, gen: Generation, k: int, finish: dict[str, Any] | None, started: float
    ) -> dict[str, Any] | None:
        """The cumulative /generate output after k tokens; None while SGLang would hold it back."""
        engine = self.s.engine
        ids = gen.output_ids[:k]
        if finish is None:
            text = engine.partial_text(ids, item.params)
            if text is None:
                return None
        elif finish["type"] == "abort":
            text = engine.tokenizer.decode(ids, skip_special_tokens=item.params.skip_special_tokens)
        else:
            text = engine.output_text(gen, item.params)
        meta: dict[str, Any] = {
            "id": item.rid,
            "finish_reason": finish,
            "prompt_tokens": len(item.prompt_ids),
            "weight_version": self.s.weight_version,
            "num_retractions": 0,
        }
        if item.return_logprob:
            meta["input_token_logprobs"] = self._input_logprobs(item)
            meta["output_token_logprobs"] = [
                [gen.logprobs[i], gen.output_ids[i], self._token_text(item, gen.output_ids[i])]
                for i in range(k)
            ]
            meta["output_token_logprobs_length"] = k
            if item.top_logprobs_num > 0:
                meta["input_top_logprobs"] = self._input_top_logprobs(item)
                meta["output_top_logprobs"] = [
                    [[lp, tid, self._token_text(item, tid)] for lp, tid in gen.top_logprobs[i]]
                    for i in range(k)
                ]
        meta["reasoning_tokens"] = engine.reasoning_tokens(ids)
        meta["completion_tokens"] = k
        meta["cached_tokens"] = item.cached_tokens
        if finish is not None:
            # SGLang 0.5.23: which weights sampled which tokens, in the last output only.
            meta["weight_versions"] = [{"version": self.s.weight_version, "start": 0, "end": k}]
        meta["dp_rank"] = None
        if finish is not None:
            meta["e2e_latency"] = time.perf_counter() - started
            meta["response_sent_to_client_ts"] = time.time()
        out: dict[str, Any] = {"text": text, "output_ids": list(ids), "meta_info": meta}
        if item.return_prompt_token_ids:
            out["prompt_token_ids"] = list(item.prompt_ids)
        return out

    def _token_text(self, item: _Item, tid: int) -> str | None:
        if not item.return_text_in_logprobs:
            return None
        return self.s.tokenizer.decode([tid], skip_special_tokens=False)

    def _prompt_logprob(self, pos: int, tid: int) -> float:
        return scripted_logprob(self.s.config.seed ^ 0x5EED, pos, tid)

    def _input_logprobs(self, item: _Item) -> list[list[Any]]:
        # From logprob_start_len on; the first entry has no logprob (nothing precedes it).
        start = item.logprob_start_len
        if start < 0:
            return []
        return [
            [None if pos == start else self._prompt_logprob(pos, tid), tid, self._token_text(item, tid)]
            for pos, tid in enumerate(item.prompt_ids)
            if pos >= start
        ]

    def _input_top_logprobs(self, item: _Item) -> list[Any]:
        start = item.logprob_start_len
        if start < 0:
            return []
        return [
            None if pos == start else [[self._prompt_logprob(pos, tid), tid, self._token_text(item, tid)]]
            for pos, tid in enumerate(item.prompt_ids)
            if pos >= start
        ]

    async def _run_to_end(self, item: _Item, fault: FaultMode | None) -> dict[str, Any]:
        started = time.perf_counter()
        gen = self._start(item)
        try:
            last: dict[str, Any] | None = None
            async for k, finish in self._steps(item, gen, fault):
                if finish is not None:
                    last = self._output(item, gen, k, finish, started)
            assert last is not None
            return last
        finally:
            self.s.in_flight.pop(item.rid, None)

    # --- checks and dropped connections -------------------------------------------------------

    def _check_prompt(self, prompt: Sequence[int]) -> None:
        vocab = self.s.tokenizer.vocab_size
        if not prompt:
            raise ValueError("input_ids cannot be empty.")
        bad = next((t for t in prompt if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(
                f"input_ids contains out-of-vocabulary token id {bad}; valid range is [0, {vocab})."
            )
        if len(prompt) >= self.s.config.context_length:
            raise ValueError(
                f"The input ({len(prompt)} tokens) is longer than the model's context length "
                f"({self.s.config.context_length} tokens)."
            )

    async def _drop_body(self, request: web.Request, item: _Item) -> web.StreamResponse:
        data = _dumps(await self._run_to_end(item, None)).encode()
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        resp.content_length = len(data)
        await resp.prepare(request)
        await resp.write(data[: len(data) // 2])
        _drop(request)
        return resp


def _drop(request: web.Request) -> None:
    """Cut the connection without finishing the response (a backend crash, seen from outside)."""
    transport = request.transport
    if transport is not None:
        transport.abort()
