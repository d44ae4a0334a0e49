"""The fake in vLLM's own mode (`FakeBackendConfig.api = "vllm"`): vLLM's OpenAI-compatible
completions endpoint as a token-in, token-out client (polar-mitm's render mode on vLLM) uses it.

Checked against vLLM's `entrypoints/openai/completion/protocol.py` (`CompletionRequest`,
`CompletionResponse`, `CompletionStreamResponse`, `CompletionLogProbs`):

- `POST /v1/completions` takes `prompt` as a list of token ids (or a string), `max_tokens`
  (default 16), `temperature`, `top_p`, `top_k` (0 or -1: off), `stop`, `stop_token_ids`,
  `logprobs` (an int: alternatives per token; 0 gives the sampled token's alone),
  `return_token_ids`, `skip_special_tokens`, `stream`, `stream_options.include_usage`.
- Its answer: `choices[0]` with `text`, `logprobs` (`tokens`, `token_logprobs`, `top_logprobs`,
  `text_offset`), `finish_reason` (`stop`, `length`, `abort`), `stop_reason` (the stop string or
  stop token id; None for EOS), and with `return_token_ids` `token_ids` (the sampled ids, the EOS
  included) and `prompt_token_ids`; `usage` with `prompt_tokens_details.cached_tokens` (as with
  vLLM's `--enable-prompt-tokens-details`).
- Streaming is SSE of delta chunks (vLLM's `RequestOutputKind.DELTA`): each chunk's `text`,
  `token_ids` and `logprobs` hold only what is new, `prompt_token_ids` only in the first; then a
  usage chunk with no choices when `include_usage`, then `data: [DONE]`.
- Errors are vLLM's `ErrorResponse`: `{"error": {"message", "type", "param", "code"}}`.
- `GET /v1/models` has `owned_by: "vllm"`, `root` and `max_model_len`; `GET /health` is 200 and
  empty; `GET /version`. No SGLang endpoint answers in this mode; replies name no weight version.
- `POST /inference/v1/generate` (vLLM's token-in, token-out endpoint, `--enable-scale-out`;
  checked against vLLM 0.32's `entrypoints/scale_out/token_in_token_out/`: `GenerateRequest`,
  `GenerateTextResponse`, `GenerateTextStreamResponse`) takes `token_ids` and `sampling_params`
  in `SamplingParams`' names (`max_tokens`, default: up to the context's end), `output_mode`
  (the fake serves "text" only), `stream`, `stream_options.include_usage`. Its answer:
  `request_id`, `choices[0]` with `text`, `token_ids`, `logprobs.content[]` (`token`, `logprob`,
  `bytes`, `top_logprobs`: the sampled token first), `finish_reason`, `stop_reason` and
  `weight_versions` (spans `{"version", "start", "end"}` over the output tokens, on the last
  output only), `usage`, `output_mode`; no prompt ids. Streamed as delta chunks, a usage chunk
  with no choices, `data: [DONE]`. Without `vllm_scale_out`: 403 `PermissionDeniedError`, as vLLM
  without the flag.
- vLLM's development endpoints, served as with `VLLM_SERVER_DEV_MODE=1` unless `vllm_dev_mode` is
  off (then 404, as vLLM without it), checked against vLLM 0.32's `entrypoints/serve/dev/`
  routers: `GET /weight_info` → `{"weight_version"}`; `POST /update_weight_version
  {"new_version"}` → `{"success": true, "new_version"}`; `POST /pause?mode=abort|wait|keep` →
  `{"status": "paused"}` (abort: the generations under way end with `finish_reason` `abort`;
  wait: it answers once they finished; new ones wait until `/resume`; the fake's keep lets those
  under way finish, where vLLM freezes them); `POST /resume` → `{"status": "resumed"}`; `GET
  /is_paused` → `{"is_paused"}`; `POST /collective_rpc {"method": "reload_weights", "kwargs":
  {"weights_path"}}` loads the weights in place (`--mode hf`) → `{"results": [null]}`; `POST
  /reset_prefix_cache` empties the prefix cache → `{"success": true}`.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Callable
from typing import Any

from aiohttp import web

from polar_mitm.fake.contract import GenParams, _json, _read_json, _sse
from polar_mitm.fake.serving import _drop, _Handlers, _Item

VLLM_VERSION_EMULATED = "0.11.x"


def _error(
    message: str, status: int = 400, err_type: str = "BadRequestError", param: str | None = None
) -> web.Response:
    return _json({"error": {"message": message, "type": err_type, "param": param, "code": status}}, status)


class _Completions(_Handlers):
    """vLLM's /v1/completions over the fake's engine."""

    def _item(self, body: dict[str, Any]) -> _Item:
        tok = self.s.tokenizer
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            ids = tok.encode(prompt)
        elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            ids = list(prompt)
        else:
            raise ValueError("Either prompt or prompt_embeds must be provided and non-empty.")
        self._check_prompt(ids)
        top_k = body.get("top_k")
        sp = {
            "max_new_tokens": 16 if body.get("max_tokens") is None else body["max_tokens"],
            "temperature": body.get("temperature"),
            "top_p": body.get("top_p"),
            "top_k": -1 if top_k in (None, 0, -1) else top_k,
            "stop": body.get("stop"),
            "stop_token_ids": body.get("stop_token_ids"),
            "skip_special_tokens": body.get("skip_special_tokens", True),
            "sampling_seed": body.get("seed"),
        }
        params = GenParams.from_sglang(sp, tok.vocab_size)
        if (
            params.max_new_tokens is not None
            and params.max_new_tokens + len(ids) > self.s.config.context_length
        ):
            raise ValueError(
                f"This model's maximum context length is {self.s.config.context_length} tokens. However, you "
                f"requested {params.max_new_tokens + len(ids)} tokens ({len(ids)} in the messages, "
                f"{params.max_new_tokens} in the completion). Please reduce the length of the messages or "
                "completion."
            )
        logprobs = body.get("logprobs")
        if logprobs is not None and (not isinstance(logprobs, int) or (logprobs < 0 and logprobs != -1)):
            raise ValueError("`logprobs` must be a positive value or -1.")
        return _Item(
            rid=str(body.get("request_id") or uuid.uuid4().hex),
            prompt_ids=ids,
            params=params,
            return_logprob=logprobs is not None,
            top_logprobs_num=max(0, logprobs or 0),
        )

    def _choice(
        self, item: _Item, gen, start: int, k: int, finish: dict[str, Any] | None, text: str, body: dict
    ) -> dict[str, Any]:
        """The choice for tokens start..k (the whole reply, or one delta)."""
        tok = self.s.tokenizer
        ids = gen.output_ids[start:k]
        choice: dict[str, Any] = {"index": 0, "text": text, "logprobs": None}
        if item.return_logprob:
            choice["logprobs"] = {
                "text_offset": [],
                "token_logprobs": [gen.logprobs[i] for i in range(start, k)],
                "tokens": [tok.decode([t], skip_special_tokens=False) for t in ids],
                "top_logprobs": [
                    {tok.decode([t], skip_special_tokens=False): lp for lp, t in gen.top_logprobs[i]}
                    for i in range(start, k)
                ]
                if item.top_logprobs_num
                else None,
            }
        choice["finish_reason"] = None if finish is None else _finish_reason(finish)
        choice["stop_reason"] = None if finish is None else self._stop_reason(finish)
        if body.get("return_token_ids"):
            choice["token_ids"] = list(ids)
            if start == 0:
                choice["prompt_token_ids"] = list(item.prompt_ids)
        return choice

    def _stop_reason(self, finish: dict[str, Any]) -> int | str | None:
        matched = finish.get("matched")
        if finish.get("type") != "stop" or (isinstance(matched, int) and matched in self.s.engine.eos_ids):
            return None
        return matched

    def _usage(self, item: _Item, completion: int) -> dict[str, Any]:
        prompt = len(item.prompt_ids)
        return {
            "prompt_tokens": prompt,
            "total_tokens": prompt + completion,
            "completion_tokens": completion,
            "prompt_tokens_details": {"cached_tokens": item.cached_tokens},
        }

    def _head(self, item: _Item, body: dict[str, Any]) -> dict[str, Any]:
        """What every output of one reply starts with."""
        return {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": self.s.config.served_model_name or self.s.config.model_path,
        }

    def _whole(self, head: dict[str, Any], choice: dict[str, Any], item: _Item, k: int) -> dict[str, Any]:
        return {**head, "choices": [choice], "usage": self._usage(item, k)}

    def _chunk(self, head: dict[str, Any], choice: dict[str, Any]) -> dict[str, Any]:
        return {**head, "choices": [choice], "usage": None}

    def _usage_chunk(self, head: dict[str, Any], item: _Item, k: int) -> dict[str, Any]:
        return {**head, "choices": [], "usage": self._usage(item, k)}

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, self._item)

    async def _serve(
        self, request: web.Request, read: Callable[[dict[str, Any]], _Item]
    ) -> web.StreamResponse:
        """One generation request: its body read into an item by `read` (ValueError: a 400),
        answered whole or streamed in the shapes of `_head`, `_choice`, `_whole`, `_chunk` and
        `_usage_chunk`."""
        body, raw, err = await _read_json(request)
        self._log(request, raw)
        if err is not None:
            return err
        if not isinstance(body, dict):
            return _error("the request body is not a JSON object")
        try:
            item = read(body)
        except ValueError as e:
            return _error(str(e))
        stream = bool(body.get("stream"))
        fault = self.s.take_fault(request.path)
        if fault is not None and (replaced := await self._fault_response(fault, stream)) is not None:
            return replaced
        head = self._head(item, body)
        await self.s.resumed.wait()  # a paused engine (`/pause`) holds new generations
        gen = self._start(item)
        engine = self.s.engine
        if not stream:
            if fault == "drop_midstream":
                self.s.in_flight.pop(item.rid, None)
                return await self._drop_body(request, item)
            try:
                k, finish = 0, None
                async for step in self._steps(item, gen, fault):
                    k, finish = step  # the last step: the whole reply
            finally:
                self.s.in_flight.pop(item.rid, None)
            assert finish is not None
            text = self._final_text(item, gen, k, finish)
            return _json(self._whole(head, self._choice(item, gen, 0, k, finish, text, body), item, k))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
        await resp.prepare(request)
        sent_ids, sent_text = 0, ""
        try:
            try:
                async with contextlib.aclosing(self._steps(item, gen, fault)) as steps:
                    async for k, finish in steps:
                        if finish is None:
                            partial = engine.partial_text(gen.output_ids[:k], item.params)
                            if partial is None:
                                continue
                            text = partial
                        else:
                            text = self._final_text(item, gen, k, finish)
                        delta = text[len(sent_text) :] if text.startswith(sent_text) else text
                        choice = self._choice(item, gen, sent_ids, k, finish, delta, body)
                        await resp.write(_sse(self._chunk(head, choice)))
                        sent_ids, sent_text = k, text
            finally:
                self.s.in_flight.pop(item.rid, None)
            if (body.get("stream_options") or {}).get("include_usage"):
                await resp.write(_sse(self._usage_chunk(head, item, sent_ids)))
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
        except ConnectionResetError:
            _drop(request)
        return resp

    def _final_text(self, item: _Item, gen, k: int, finish: dict[str, Any]) -> str:
        if finish.get("type") == "abort":
            return self.s.tokenizer.decode(
                gen.output_ids[:k], skip_special_tokens=item.params.skip_special_tokens
            )
        return self.s.engine.output_text(gen, item.params)

    async def models(self, request: web.Request) -> web.Response:
        cfg = self.s.config
        card = {
            "id": cfg.served_model_name or cfg.model_path,
            "object": "model",
            "created": int(self.s.started_at),
            "owned_by": "vllm",
            "root": cfg.model_path,
            "parent": None,
            "max_model_len": cfg.context_length,
            "permission": [],
        }
        return _json({"object": "list", "data": [card]})

    async def version(self, request: web.Request) -> web.Response:
        return _json({"version": f"polar-mitm-fake (emulating vllm {VLLM_VERSION_EMULATED})"})


class _Generate(_Completions):
    """vLLM's token-in, token-out /inference/v1/generate (`--enable-scale-out`) over the fake's
    engine, in `output_mode` "text"; 403 when the fake runs without it (`vllm_scale_out`)."""

    def _generate_item(self, body: dict[str, Any]) -> _Item:
        ids, sp = body.get("token_ids"), body.get("sampling_params")
        if not isinstance(ids, list) or not ids:
            raise ValueError("1 validation error:\n  token_ids: List should have at least 1 item")
        if not isinstance(sp, dict):
            raise ValueError("1 validation error:\n  sampling_params: Field required")
        if body.get("output_mode", "tokens") != "text":
            raise ValueError("the fake serves output_mode 'text' only")
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
            raise ValueError("token_ids must not contain negative values")
        # Without max_tokens, vLLM generates up to the context's end (SamplingParams' 16 is not used).
        default = self.s.config.context_length - len(ids)
        flat = {**sp, "prompt": ids, "request_id": body.get("request_id")}
        flat["max_tokens"] = sp.get("max_tokens", default)
        return self._item(flat)

    async def generate(self, request: web.Request) -> web.StreamResponse:
        if not self.s.config.vllm_scale_out:
            self._log(request, await request.read())
            return _error(SCALE_OUT_OFF, 403, "PermissionDeniedError")
        return await self._serve(request, self._generate_item)

    def _head(self, item: _Item, body: dict[str, Any]) -> dict[str, Any]:
        return {"request_id": f"generate-tokens-{item.rid}"}

    def _choice(
        self, item: _Item, gen, start: int, k: int, finish: dict[str, Any] | None, text: str, body: dict
    ) -> dict[str, Any]:
        choice: dict[str, Any] = {
            "index": 0,
            "finish_reason": None if finish is None else _finish_reason(finish),
            "stop_reason": None if finish is None else self._stop_reason(finish),
            "token_ids": list(gen.output_ids[start:k]),
            "routed_experts": None,
            "sampling_mask": None,
            # Spans over the output tokens, on the last output only (the fake's weights never
            # change mid-reply: one span).
            "weight_versions": None
            if finish is None
            else [{"version": self.s.weight_version, "start": 0, "end": k}],
            "text": text,
            "logprobs": None,
        }
        if item.return_logprob:
            choice["logprobs"] = {"content": [self._logprob(item, gen, i) for i in range(start, k)]}
        return choice

    def _logprob(self, item: _Item, gen, i: int) -> dict[str, Any]:
        """One sampled token's entry: its text, logprob and bytes, and the sampled token then its
        best alternatives (at least the sampled one)."""
        tid, lp = gen.output_ids[i], gen.logprobs[i]
        top = [(lp, tid), *((a, t) for a, t in gen.top_logprobs[i] if t != tid)]
        return {
            **self._token(tid, lp),
            "top_logprobs": [self._token(t, a) for a, t in top[: max(item.top_logprobs_num, 1)]],
        }

    def _token(self, tid: int, lp: float) -> dict[str, Any]:
        token = self.s.tokenizer.decode([tid], skip_special_tokens=False)
        return {"token": token, "logprob": lp, "bytes": list(token.encode("utf-8", errors="replace"))}

    def _usage(self, item: _Item, completion: int) -> dict[str, Any]:
        return {**super()._usage(item, completion), "completion_tokens_details": None}

    def _whole(self, head: dict[str, Any], choice: dict[str, Any], item: _Item, k: int) -> dict[str, Any]:
        return {
            **head,
            "model": self.s.config.served_model_name or self.s.config.model_path,
            "created": int(time.time()),
            "usage": self._usage(item, k),
            "prompt_logprobs": None,
            "prompt_token_id_logprobs": None,
            "prompt_token_ids": None,
            "mm_placeholders": None,
            "metrics": None,
            "kv_transfer_params": None,
            "ec_transfer_params": None,
            "output_mode": "text",
            "choices": [choice],
        }

    def _chunk(self, head: dict[str, Any], choice: dict[str, Any]) -> dict[str, Any]:
        return {**head, "usage": None, "output_mode": "text", "choices": [choice]}

    def _usage_chunk(self, head: dict[str, Any], item: _Item, k: int) -> dict[str, Any]:
        usage = {key: v for key, v in self._usage(item, k).items() if v is not None}
        return {**head, "usage": usage, "output_mode": "text", "choices": []}


SCALE_OUT_OFF = "Scale-out endpoints are disabled. Restart vllm serve with --enable-scale-out to enable them."


class _Dev(_Handlers):
    """vLLM's development endpoints (`VLLM_SERVER_DEV_MODE=1`): what an RL trainer drives."""

    async def weight_info(self, request: web.Request) -> web.Response:
        self._log(request, b"")
        return _json({"weight_version": self.s.weight_version})

    async def update_weight_version(self, request: web.Request) -> web.Response:
        body, raw, err = await _read_json(request)
        self._log(request, raw)
        if err is not None:
            return err
        version = body.get("new_version") if isinstance(body, dict) else None
        if not isinstance(version, str):
            return _validation_error(
                {"type": "missing", "loc": "body.new_version", "msg": "Field required", "input": body}
            )
        self.s.weight_version = version
        return _json({"success": True, "new_version": version})

    async def pause(self, request: web.Request) -> web.Response:
        self._log(request, await request.read())
        mode = request.query.get("mode", "abort")
        if mode not in PAUSE_MODES:
            expected = "'abort', 'wait' or 'keep'"
            return _validation_error(
                {"type": "literal_error", "loc": "query.mode", "msg": f"Input should be {expected}",
                 "input": mode, "ctx": {"expected": expected}}
            )  # fmt: skip
        self.s.resumed.clear()
        if mode == "abort":
            for flight in self.s.in_flight.values():
                flight.aborted = True
        elif mode == "wait":
            while self.s.in_flight and not self.s.shutting_down.is_set():
                await asyncio.sleep(0.01)
        return _json({"status": "paused"})

    async def resume(self, request: web.Request) -> web.Response:
        self._log(request, await request.read())
        self.s.resumed.set()
        return _json({"status": "resumed"})

    async def is_paused(self, request: web.Request) -> web.Response:
        return _json({"is_paused": not self.s.resumed.is_set()})

    async def collective_rpc(self, request: web.Request) -> web.Response:
        body, raw, err = await _read_json(request)
        self._log(request, raw)
        if err is not None:
            return err
        method = body.get("method") if isinstance(body, dict) else None
        if method is None:
            return _error("Missing 'method' in request body", 400, "Bad Request")
        kwargs = body.get("kwargs") or {}
        path = kwargs.get("weights_path") if isinstance(kwargs, dict) else None
        if method != "reload_weights" or not isinstance(path, str):
            return _error(
                f"the fake serves collective_rpc reload_weights(weights_path) only: {method}",
                500,
                SERVER_ERROR,
            )
        engine = self.s.engine
        if self.s.config.mode != "hf":
            return _error("this fake backend has no weights (run it with --mode hf)", 500, SERVER_ERROR)
        try:
            engine.hf.load(path)  # type: ignore[attr-defined]  # HFEngine: mode hf
        except (OSError, ValueError, RuntimeError) as e:
            return _error(f"reload_weights failed: {e}", 500, SERVER_ERROR)
        return _json({"results": [None]})

    async def reset_prefix_cache(self, request: web.Request) -> web.Response:
        self._log(request, await request.read())
        self.s.prompt_cache.clear()
        return _json({"success": True})


PAUSE_MODES = ("abort", "wait", "keep")


SERVER_ERROR = "Internal Server Error"


def _validation_error(error: dict[str, Any]) -> web.Response:
    """vLLM's answer to a request FastAPI finds invalid: a 400 ErrorResponse naming the field."""
    return _error(f"1 validation error:\n  {error}", 400, "Bad Request", error["loc"])


def _finish_reason(finish: dict[str, Any]) -> str:
    kind = finish.get("type")
    return "abort" if kind == "abort" else "length" if kind == "length" else "stop"
