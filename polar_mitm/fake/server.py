"""The fake server as an aiohttp app: `POST /generate`, the info and control endpoints, the
`/_fake/` admin endpoints, and the entry points (`create_app`, `start_fake_backend`, `serve`).

- `POST /generate` → `{"text", "output_ids", "meta_info": {"id", "finish_reason", "prompt_tokens",
  "weight_version", "num_retractions", ["input_token_logprobs", "output_token_logprobs",
  "output_token_logprobs_length", ("input_top_logprobs", "output_top_logprobs")], "reasoning_tokens",
  "completion_tokens", "cached_tokens", "e2e_latency", "response_sent_to_client_ts"}}`. A list of
  those for a batch (`input_ids` as a list of lists, `text` as a list, or `sampling_params.n > 1`).
  `finish_reason` is `{"type": "stop", "matched": <token id | stop string>}`,
  `{"type": "length", "length": max_new_tokens}` or
  `{"type": "abort", "message", "status_code", "err_type"}`; `None` on unfinished stream chunks.
  `output_ids` keep the matched stop token; `text` is decoded without it (and cut before a matched
  stop string) unless `no_stop_trim`. Logprob entries are `[logprob, token_id, text_or_null]`
  (text only with `return_text_in_logprobs`). With `logprob_start_len` unset (-1) the
  `input_token_logprobs` list is empty; from position k it starts with a `None` logprob.
- Streaming (`"stream": true`) is SSE, `data: {...}\\n\\n` per chunk and a final
  `data: [DONE]\\n\\n`. By default (SGLang's `incremental_streaming_output=False`) every chunk is
  CUMULATIVE: `text`, `output_ids` and `meta_info.output_token_logprobs` hold everything generated
  so far, and only the last chunk has a `finish_reason` and `e2e_latency`. `incremental_streaming_output`
  in the config switches to SGLang's delta chunks. Errors found after the stream started (SGLang
  validates inside its stream generator) arrive as a `data: {"error": {...}}` chunk, then `[DONE]`.
- `GET /model_info` (and the deprecated `/get_model_info`) has `model_path`, `served_model_name`,
  `tokenizer_path`, `is_generation`, `preferred_sampling_params`, `weight_version`,
  `reasoning_parser`, `tool_call_parser`, …; `POST /update_weight_version` takes
  `{"new_version", "abort_all_requests": true}` and answers `{"success", "message", "new_version"}`;
  `GET /health` and `/health_generate` are 200 with an empty body (`/health_generate` runs a token
  through the scheduler in SGLang, so it waits while a `hang` fault holds one: a stuck scheduler;
  `/health` answers anyway); `GET /v1/models` is OpenAI's list with `owned_by: "sglang"` and
  `max_model_len`; `POST /abort_request` takes `{"rid", "abort_all"}`.
- With `api_key` set (SGLang's `--api-key`), every path but `/health*`, `/metrics` and the
  `/_fake/` admin needs `Authorization: Bearer KEY`; others get 401 `{"error": "Unauthorized"}`
  (SGLang's `add_api_key_middleware`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncGenerator
from typing import Any

from aiohttp import web

from polar_mitm.backends.tokenizer import Tokenizer
from polar_mitm.fake.chat import _ChatCompletions
from polar_mitm.fake.config import FakeBackendConfig
from polar_mitm.fake.contract import (
    ContractError,
    GenParams,
    _bad_request_validation,
    _json,
    _read_json,
    _sse,
    check_generate_body,
)
from polar_mitm.fake.engine import Engine
from polar_mitm.fake.serving import _drop, _Handlers, _Item
from polar_mitm.fake.state import STATE, FakeBackendState, Fault, FaultMode
from polar_mitm.fake.vllm import _Completions, _Dev, _Generate

SGLANG_VERSION_EMULATED = "0.5.x"


class _Server(_Handlers):
    """/generate, the info and control endpoints, and the /_fake admin."""

    # --- /generate ----------------------------------------------------------------------------

    def _items(self, body: dict[str, Any]) -> tuple[list[_Item], bool]:
        """A /generate body as generations, and whether the answer is a list; raises ValueError
        with SGLang's messages."""
        tok = self.s.tokenizer
        input_ids, text = body.get("input_ids"), body.get("text")
        if input_ids is not None:
            batch = bool(input_ids) and isinstance(input_ids[0], list)
            prompts = [list(p) for p in input_ids] if batch else [list(input_ids)]
        elif text is not None:
            batch = isinstance(text, list)
            prompts = [tok.encode(t) for t in (text if batch else [text])]
        else:
            raise ValueError("Either text, input_ids or input_embeds should be provided.")
        for p in prompts:
            self._check_prompt(p)

        def per(name: str, i: int, default: Any) -> Any:
            v = body.get(name)
            if isinstance(v, list):
                v = v[i] if i < len(v) else None
            return default if v is None else v

        sps, rids = body.get("sampling_params"), body.get("rid")
        items: list[_Item] = []
        for i, prompt in enumerate(prompts):
            sp = (sps[i] if i < len(sps) else {}) if isinstance(sps, list) else (sps or {})
            params = GenParams.from_sglang(sp, tok.vocab_size)
            max_new = params.max_new_tokens
            if max_new is not None and max_new + len(prompt) > self.s.config.context_length:
                raise ValueError(
                    "Requested token count exceeds the model's maximum context length of "
                    f"{self.s.config.context_length} tokens. You requested a total of {max_new + len(prompt)} "
                    f"tokens: {len(prompt)} tokens from the input messages and {max_new} tokens for the "
                    "completion. Please reduce the number of tokens in the input messages or the completion "
                    "to fit within the limit."
                )
            return_logprob = bool(per("return_logprob", i, False))
            start = int(per("logprob_start_len", i, -1))
            if return_logprob and start > len(prompt):
                raise ValueError(
                    f"logprob_start_len={start} is higher than the number of input tokens "
                    f"{len(prompt)}. Please use a smaller logprob_start_len."
                )
            rid = (
                rids[i]
                if isinstance(rids, list) and i < len(rids)
                else (f"{rids}_{i}" if batch and rids else rids)
            )
            for j in range(params.n):
                if not isinstance(rid, str):
                    this_rid = uuid.uuid4().hex
                else:
                    this_rid = rid if params.n == 1 else f"{rid}_{j}"
                items.append(
                    _Item(
                        rid=this_rid,
                        prompt_ids=prompt,
                        params=params,
                        return_logprob=return_logprob,
                        logprob_start_len=start if return_logprob else -1,
                        top_logprobs_num=int(per("top_logprobs_num", i, 0)) if return_logprob else 0,
                        return_text_in_logprobs=bool(body.get("return_text_in_logprobs") or False),
                        return_prompt_token_ids=bool(body.get("return_prompt_token_ids") or False),
                        sample_index=j,
                        index=len(items),
                    )
                )
        return items, batch or len(items) > 1

    async def _stream_item(
        self, item: _Item, fault: FaultMode | None, tagged: bool
    ) -> AsyncGenerator[bytes, None]:
        started = time.perf_counter()
        gen = self._start(item)
        incremental = self.s.config.incremental_streaming_output
        sent_ids, sent_text = 0, ""
        try:
            async for k, finish in self._steps(item, gen, fault):
                out = self._output(item, gen, k, finish, started)
                if out is None:
                    continue
                if incremental:  # SGLang's --incremental-streaming-output: output-side deltas only
                    text = out["text"]
                    out["text"] = text[len(sent_text) :] if text.startswith(sent_text) else text
                    out["output_ids"] = out["output_ids"][sent_ids:]
                    meta = out["meta_info"]
                    for key in ("output_token_logprobs", "output_top_logprobs"):
                        if key in meta:
                            meta[key] = meta[key][sent_ids:]
                    sent_ids, sent_text = k, text
                if tagged:
                    out["index"] = item.index
                yield _sse(out)
        finally:
            self.s.in_flight.pop(item.rid, None)

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body, raw, err = await _read_json(request)
        self._log(request, raw)
        if err is not None:
            return err
        try:
            check_generate_body(body)
        except ContractError as e:
            return _json({"error": str(e)}, 400)
        stream = bool(body.get("stream"))
        fault = self.s.take_fault(request.path)
        if fault is not None and (replaced := await self._fault_response(fault, stream)) is not None:
            return replaced
        if not stream:
            try:
                items, batch = self._items(body)
            except ValueError as e:
                return _json({"error": {"message": str(e)}}, 400)
            if fault == "drop_midstream":
                return await self._drop_body(request, items[0])
            outs = [await self._run_to_end(item, fault) for item in items]
            return _json(outs if batch else outs[0])
        # SGLang validates a streamed request inside its stream: errors arrive as an SSE event.
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
        await resp.prepare(request)
        try:
            try:
                items, batch = self._items(body)
            except ValueError as e:
                error = {"message": str(e), "type": "invalid_request_error", "code": 400, "retryable": False}
                await resp.write(_sse({"error": error}))
            else:
                for item in items:
                    async with contextlib.aclosing(self._stream_item(item, fault, tagged=batch)) as chunks:
                        async for chunk in chunks:
                            await resp.write(chunk)
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
        except ConnectionResetError:
            _drop(request)
        return resp

    # --- info and control endpoints -----------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def health_generate(self, request: web.Request) -> web.Response:
        """SGLang runs one token through the scheduler: a stuck one (a `hang` fault holding a
        request) answers nothing until it frees."""
        while self.s.hanging and not self.s.shutting_down.is_set():
            await asyncio.sleep(0.05)
        return web.Response(status=200)

    async def model_info(self, request: web.Request) -> web.Response:
        cfg = self.s.config
        return _json(
            {
                "model_path": cfg.model_path,
                "served_model_name": cfg.served_model_name or cfg.model_path,
                "tokenizer_path": cfg.tokenizer_path,
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": self.s.weight_version,
                "load_format": "dummy",
                "reasoning_parser": cfg.reasoning_parser,
                "tool_call_parser": cfg.tool_call_parser,
                "disaggregation_mode": "null",
                "has_image_understanding": False,
                "has_audio_understanding": False,
                "model_type": "polar_mitm_fake",
                "architectures": ["PolarMitmFakeForCausalLM"],
            }
        )

    async def server_info(self, request: web.Request) -> web.Response:
        cfg = self.s.config
        return _json(
            {
                "model_path": cfg.model_path,
                "tokenizer_path": cfg.tokenizer_path,
                "served_model_name": cfg.served_model_name or cfg.model_path,
                "context_length": cfg.context_length,
                "tool_call_parser": cfg.tool_call_parser,
                "reasoning_parser": cfg.reasoning_parser,
                "weight_version": self.s.weight_version,
                "incremental_streaming_output": cfg.incremental_streaming_output,
                "random_seed": cfg.seed,
                "fake_mode": cfg.mode,
                "startup_time": self.s.started_at,
                "internal_states": [{}],
                "version": f"polar-mitm-fake (emulating sglang {SGLANG_VERSION_EMULATED})",
                "frontend": "python",
            }
        )

    async def models(self, request: web.Request) -> web.Response:
        name = self.s.config.served_model_name or self.s.config.model_path
        card = {
            "id": name,
            "object": "model",
            "created": int(self.s.started_at),
            "owned_by": "sglang",
            "root": name,
            "parent": None,
            "max_model_len": self.s.config.context_length,
        }
        return _json({"object": "list", "data": [card]})

    async def update_weight_version(self, request: web.Request) -> web.Response:
        body, raw, err = await _read_json(request)
        self._log(request, raw)
        if err is not None:
            return err
        if not isinstance(body, dict) or not isinstance(body.get("new_version"), str):
            return _bad_request_validation("1 validation error:\n  new_version: Field required (a string)")
        if body.get("abort_all_requests", True):  # SGLang's default aborts running requests
            for flight in self.s.in_flight.values():
                flight.aborted = True
        version = body["new_version"]
        self.s.weight_version = version
        return _json(
            {"success": True, "message": f"Weight version updated to {version}", "new_version": version}
        )

    async def abort_request(self, request: web.Request) -> web.Response:
        body, raw, err = await _read_json(request)
        self._log(request, raw)
        if err is not None:
            return err
        body = body if isinstance(body, dict) else {}
        rid = str(body.get("rid") or "")
        for key, flight in self.s.in_flight.items():
            if body.get("abort_all") or (rid and key.startswith(rid)):
                flight.aborted = True
        return web.Response(status=200)

    async def flush_cache(self, request: web.Request) -> web.Response:
        self.s.prompt_cache.clear()
        return web.Response(
            text="Cache flushed.\nPlease check backend logs for more details. (When there are running or waiting "
            "requests, the operation will not be performed.)\n"
        )

    # --- /_fake admin -------------------------------------------------------------------------

    async def fake_fault(self, request: web.Request) -> web.Response:
        try:
            fault = Fault.model_validate(await request.json())
        except (ValueError, TypeError) as e:
            return _json({"error": {"message": f"bad fault: {e}"}}, 400)
        if fault.count > 0:
            self.s.faults.append(fault)
        return _json({"success": True, "pending": [f.model_dump() for f in self.s.faults]})

    async def fake_requests(self, request: web.Request) -> web.Response:
        reqs, parsed = list(self.s.requests), []
        last = request.query.get("last", "")
        if last.isdigit():
            reqs = reqs[len(reqs) - int(last) :] if int(last) else []
        for r in reqs:
            try:
                r = r | {"body": json.loads(r["body"])}
            except ValueError:
                pass
            parsed.append(r)
        return _json({"count": self.s.request_count, "counts": dict(self.s.counts), "requests": parsed})

    async def fake_reset(self, request: web.Request) -> web.Response:
        s = self.s
        s.requests.clear()
        s.counts.clear()
        s.request_count = 0
        s.faults.clear()
        s.prompt_cache.clear()
        s.draws.clear()
        s.weight_version = s.config.weight_version
        s.resumed.set()
        return _json({"success": True})

    async def fake_state(self, request: web.Request) -> web.Response:
        return _json(
            {
                "mode": self.s.config.mode,
                "weight_version": self.s.weight_version,
                "request_count": self.s.request_count,
                "in_flight": sorted(self.s.in_flight),
                "pending_faults": [f.model_dump() for f in self.s.faults],
            }
        )


# --------------------------------------------------------------------------------------------
# Entry points
# --------------------------------------------------------------------------------------------


def _api_key_middleware(api_key: str | None):
    """SGLang's `--api-key` check: a bearer token on every path but health, metrics (and ours)."""

    @web.middleware
    async def check(request: web.Request, handler):
        path = request.path
        if (
            api_key is None
            or request.method == "OPTIONS"
            or path.startswith(("/health", "/metrics", "/_fake/"))
            or request.headers.get("Authorization") == f"Bearer {api_key}"
        ):
            return await handler(request)
        return _json({"error": "Unauthorized"}, 401)

    return check


def create_app(config: FakeBackendConfig) -> web.Application:
    """The fake server as an aiohttp application (state at `app[STATE]`)."""
    tokenizer = Tokenizer.load(config.tokenizer_path)
    if config.mode == "hf":  # torch and transformers only here: the [hf] extra
        from polar_mitm.fake.hf import HFEngine

        engine: Engine = HFEngine(config, tokenizer)
    else:
        engine = Engine(config, tokenizer)
    state = FakeBackendState(
        config=config,
        tokenizer=tokenizer,
        engine=engine,
        weight_version=config.weight_version,
    )
    if config.fail_next > 0:
        state.faults.append(Fault(mode="http500", count=config.fail_next))
    server, chat = _Server(state), _ChatCompletions(state)
    app = web.Application(client_max_size=1024**3, middlewares=[_api_key_middleware(config.api_key)])
    app[STATE] = state
    r = app.router
    if config.api == "vllm":  # vLLM's own endpoints only (`vllm.py`)
        completions = _Completions(state)
        r.add_post("/v1/completions", completions.completions)
        r.add_post("/inference/v1/generate", _Generate(state).generate)
        r.add_post("/v1/chat/completions", chat.chat)
        r.add_get("/v1/models", completions.models)
        r.add_get("/version", completions.version)
        r.add_get("/health", server.health)
        if config.vllm_dev_mode:
            dev = _Dev(state)
            r.add_get("/weight_info", dev.weight_info)
            r.add_post("/update_weight_version", dev.update_weight_version)
            r.add_post("/pause", dev.pause)
            r.add_post("/resume", dev.resume)
            r.add_get("/is_paused", dev.is_paused)
            r.add_post("/collective_rpc", dev.collective_rpc)
            r.add_post("/reset_prefix_cache", dev.reset_prefix_cache)
        _admin(r, server)
        app.on_shutdown.append(_on_shutdown)
        return app
    r.add_post("/generate", server.generate)
    r.add_put("/generate", server.generate)
    r.add_post("/v1/chat/completions", chat.chat)
    r.add_get("/health", server.health)
    r.add_get("/health_generate", server.health_generate)
    r.add_get("/model_info", server.model_info)
    r.add_get("/get_model_info", server.model_info)
    r.add_get("/server_info", server.server_info)
    r.add_get("/get_server_info", server.server_info)
    r.add_get("/v1/models", server.models)
    r.add_post("/update_weight_version", server.update_weight_version)
    if config.mode == "hf":
        from polar_mitm.fake.hf import update_weights_from_disk

        r.add_post("/update_weights_from_disk", update_weights_from_disk)
    r.add_post("/abort_request", server.abort_request)
    r.add_route("*", "/flush_cache", server.flush_cache)
    _admin(r, server)
    app.on_shutdown.append(_on_shutdown)
    return app


def _admin(r: web.UrlDispatcher, server: _Server) -> None:
    r.add_post("/_fake/fault", server.fake_fault)
    r.add_get("/_fake/requests", server.fake_requests)
    r.add_post("/_fake/reset", server.fake_reset)
    r.add_get("/_fake/state", server.fake_state)


async def _on_shutdown(app: web.Application) -> None:
    app[STATE].shutting_down.set()


async def start_fake_backend(
    config: FakeBackendConfig, host: str = "127.0.0.1", port: int = 0
) -> tuple[web.AppRunner, str]:
    """Start the server in the running event loop; returns the runner (`await runner.cleanup()`
    stops it) and the base URL."""
    runner = web.AppRunner(create_app(config), access_log=None, shutdown_timeout=1.0)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound_host, bound_port = runner.addresses[0][:2]
    shown = f"[{bound_host}]" if ":" in bound_host else bound_host
    return runner, f"http://{shown}:{bound_port}"


def serve(config: FakeBackendConfig, host: str = "127.0.0.1", port: int = 30000) -> None:
    """Run the server until interrupted; prints its URL once it is listening."""

    async def main() -> None:
        runner, url = await start_fake_backend(config, host, port)
        print(f"polar-mitm fake backend ({config.mode}, {config.api} API) listening on {url}", flush=True)
        try:
            await asyncio.Event().wait()
        finally:
            await runner.cleanup()

    try:
        asyncio.run(main())
    except KeyboardInterrupt:
        pass
