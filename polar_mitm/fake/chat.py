"""SGLang's OpenAI-compatible chat endpoint, and the parsing of what it generates.

`POST /v1/chat/completions` renders the messages with the tokenizer's chat template, generates
with the same engine, and answers OpenAI's shape with SGLang's extras: `reasoning_content`,
`tool_calls` parsed from `<tool_call>` blocks (`qwen25`, ids `call_<24 hex>`, finish `tool_calls`),
`matched_stop`, `metadata.weight_version`, and for token-exact capture `return_token_ids`
(`choices[].prompt_token_ids` / `response_token_ids`), `return_prompt_token_ids`,
`return_meta_info` (`choices[].meta_info`, the /generate meta_info) — those three are refused
with streaming, as in SGLang — and `return_input_ids_in_sglext` / `return_output_ids_in_sglext`
(`sglext.input_ids`, `sglext.output_ids`, also as a trailing stream chunk). Streams: a role chunk,
reasoning/content/tool-call deltas, a finish chunk with `matched_stop`, the optional sglext and
`stream_options.include_usage` chunks, then `[DONE]`.

`parse_output` splits generated text as SGLang's qwen3 reasoning parser and qwen25 tool parser do,
both for the whole text and for a growing one while streaming.
"""

from __future__ import annotations

import contextlib
import json
import re
import time
import uuid
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from polar_mitm.fake.contract import (
    GenParams,
    _bad_request_validation,
    _json,
    _openai_error,
    _read_json,
    _sse,
)
from polar_mitm.fake.serving import _drop, _Handlers, _Item
from polar_mitm.fake.state import FaultMode

# --------------------------------------------------------------------------------------------
# Output parsing for /v1/chat/completions (SGLang's qwen25 tool parser + qwen3 reasoning parser)
# --------------------------------------------------------------------------------------------

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"
_TOOL_BLOCK = re.compile(r"<tool_call>\n(.*?)\n</tool_call>", re.DOTALL)


@dataclass
class ParsedOutput:
    reasoning: str | None
    content: str
    tool_calls: list[tuple[str, str]]  # (name, arguments JSON)


def _held_back(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def parse_output(
    text: str, *, reasoning: bool, tools: bool, final: bool, hold: bool | None = None
) -> ParsedOutput:
    """Split generated text into reasoning, content and complete tool calls, as SGLang's qwen3
    reasoning parser and qwen25 tool parser do.

    `final` strips the parts the way SGLang's non-streaming parse does. `hold` (default: not
    `final`) treats the text as a prefix of a growing text: partial tags at its end are held back,
    so that on a growing text the parts only ever grow.
    """
    hold = (not final) if hold is None else hold
    reasoning_text: str | None = None
    rest = text
    split = False
    if reasoning:
        lead = text.lstrip()
        if lead.startswith(THINK_OPEN) or (final and THINK_CLOSE in text):
            split = True
            body = lead[len(THINK_OPEN) :] if lead.startswith(THINK_OPEN) else lead
            if THINK_CLOSE in body:
                reasoning_text, rest = body.split(THINK_CLOSE, 1)
                rest = rest.lstrip()
            else:
                reasoning_text = body[: len(body) - _held_back(body, THINK_CLOSE)] if hold else body
                rest = ""
            reasoning_text = reasoning_text.strip() if final else reasoning_text.lstrip()
        elif hold and lead and THINK_OPEN.startswith(lead):
            return ParsedOutput(None, "", [])
    calls: list[tuple[str, str]] = []
    if tools:
        idx = rest.find(TOOL_OPEN)
        if idx != -1:
            split = True
            for body in _TOOL_BLOCK.findall(rest):
                try:
                    obj = json.loads(body.strip())
                except ValueError:
                    continue
                if isinstance(obj, dict) and isinstance(obj.get("name"), str):
                    args = obj.get("arguments", obj.get("parameters", {}))
                    args_json = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
                    calls.append((obj["name"], args_json))
            rest = rest[:idx]
        elif hold:
            rest = rest[: len(rest) - _held_back(rest, TOOL_OPEN)]
    if final and split:
        rest = rest.strip()
    if final and not reasoning_text:
        reasoning_text = None
    return ParsedOutput(reasoning_text, rest, calls)


# --------------------------------------------------------------------------------------------
# The endpoint
# --------------------------------------------------------------------------------------------


class _ChatCompletions(_Handlers):
    """`POST /v1/chat/completions`."""

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body, raw, err = await _read_json(request)
        self._log(request, raw)
        if err is not None:
            return err
        if not isinstance(body, dict) or not isinstance(body.get("messages"), list) or not body["messages"]:
            return _bad_request_validation(
                "1 validation error:\n  messages: Field required (a non-empty list)"
            )
        stream = bool(body.get("stream"))
        fault = self.s.take_fault(request.path)
        if fault is not None and (replaced := await self._fault_response(fault, stream)) is not None:
            return replaced
        if stream:
            for flag in ("return_prompt_token_ids", "return_token_ids", "return_meta_info"):
                if body.get(flag):
                    return _openai_error(
                        f"{flag} is not supported with streaming. Please set stream=false when using {flag}=true."
                    )
        try:
            item, tools_active = self._chat_item(body)
        except (ValueError, TypeError) as e:
            return _openai_error(str(e))
        model = str(body.get("model") or "default")
        if not stream:
            if fault == "drop_midstream":
                return await self._drop_body(request, item)
            out = await self._run_to_end(item, fault)
            return _json(self._chat_response(body, item, out, model, tools_active))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
        await resp.prepare(request)
        try:
            async with contextlib.aclosing(
                self._chat_stream(body, item, fault, model, tools_active)
            ) as chunks:
                async for chunk in chunks:
                    await resp.write(chunk)
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
        except ConnectionResetError:
            _drop(request)
        return resp

    def _chat_item(self, body: dict[str, Any]) -> tuple[_Item, bool]:
        """The chat request as one generation (ChatCompletionRequest.to_sampling_params)."""
        tok = self.s.tokenizer
        tools = body.get("tools") or None
        tool_choice = body.get("tool_choice") or ("auto" if tools else "none")
        tools_active = bool(tools) and tool_choice != "none" and self.s.config.tool_call_parser is not None
        if body.get("input_ids") is not None:
            prompt_ids = [int(t) for t in body["input_ids"]]
        else:
            messages = [_template_message(m) for m in body["messages"]]
            kwargs = dict(body.get("chat_template_kwargs") or {})
            try:
                prompt = tok.render(messages, tools=tools if tool_choice != "none" else None, **kwargs)
            except Exception as e:  # a template that refuses the messages is the caller's bad request
                raise ValueError(f"Failed to apply the chat template: {e}") from e
            prompt_ids = tok.encode(prompt)
        self._check_prompt(prompt_ids)
        sp: dict[str, Any] = {
            "max_new_tokens": body.get("max_completion_tokens") or body.get("max_tokens"),
            "temperature": body.get("temperature"),
            "top_p": body.get("top_p"),
            "top_k": body.get("top_k"),
            "min_p": body.get("min_p"),
            "stop": body.get("stop"),
            "stop_token_ids": body.get("stop_token_ids"),
            "frequency_penalty": body.get("frequency_penalty"),
            "presence_penalty": body.get("presence_penalty"),
            "repetition_penalty": body.get("repetition_penalty"),
            "min_new_tokens": body.get("min_tokens"),
            "n": body.get("n"),
            "ignore_eos": body.get("ignore_eos"),
            "no_stop_trim": body.get("no_stop_trim"),
            # SGLang keeps special tokens in the text when tools are in play.
            "skip_special_tokens": False if tools_active else body.get("skip_special_tokens"),
            "logit_bias": body.get("logit_bias"),
            "sampling_seed": body.get("seed"),
        }
        if sp["max_new_tokens"] is None:
            sp.pop("max_new_tokens")
            sp["max_new_tokens"] = None  # the rest of the context, as SGLang does
        rf = body.get("response_format")
        if isinstance(rf, dict) and rf.get("type") == "json_schema":
            js = rf.get("json_schema") or {}
            sp["json_schema"] = json.dumps(js.get("schema", {}))
        elif isinstance(rf, dict) and rf.get("type") == "json_object":
            sp["json_schema"] = '{"type": "object"}'
        params = GenParams.from_sglang(
            {k: v for k, v in sp.items() if v is not None or k == "max_new_tokens"}, tok.vocab_size
        )
        if params.n != 1:
            raise ValueError("the fake backend's /v1/chat/completions supports n=1 only")
        logprobs = bool(body.get("logprobs"))
        item = _Item(
            rid=str(body.get("rid") or uuid.uuid4().hex),
            prompt_ids=prompt_ids,
            params=params,
            return_logprob=logprobs or bool(body.get("return_meta_info")),
            top_logprobs_num=int(body.get("top_logprobs") or 0) if logprobs else 0,
            return_text_in_logprobs=True,
            return_prompt_token_ids=bool(
                body.get("return_prompt_token_ids")
                or body.get("return_token_ids")
                or body.get("return_input_ids_in_sglext")
            ),
        )
        return item, tools_active

    def _parse(
        self, text: str, tools_active: bool, body: dict[str, Any], *, final: bool, hold: bool
    ) -> ParsedOutput:
        reasoning = (
            self.s.config.reasoning_parser is not None and body.get("separate_reasoning", True) is not False
        )
        return parse_output(text, reasoning=reasoning, tools=tools_active, final=final, hold=hold)

    def _choice_logprobs(self, entries: list[list[Any]], tops: list[Any] | None) -> dict[str, Any]:
        content = []
        for i, (lp, tid, text) in enumerate(entries):
            token = text if text is not None else self.s.tokenizer.decode([tid])
            top = []
            for tlp, ttid, ttext in tops[i] if tops and i < len(tops) and tops[i] else []:
                t = ttext if ttext is not None else self.s.tokenizer.decode([ttid])
                top.append({"token": t, "bytes": list(t.encode()), "logprob": tlp})
            content.append(
                {"token": token, "bytes": list(token.encode()), "logprob": lp, "top_logprobs": top}
            )
        return {"content": content}

    @staticmethod
    def _usage(meta: dict[str, Any]) -> dict[str, Any]:
        prompt, completion = meta["prompt_tokens"], meta["completion_tokens"]
        reasoning = meta.get("reasoning_tokens", 0)
        return {
            "prompt_tokens": prompt,
            "total_tokens": prompt + completion,
            "completion_tokens": completion,
            "prompt_tokens_details": None,
            "reasoning_tokens": reasoning,
            "completion_tokens_details": {"reasoning_tokens": reasoning} if reasoning else None,
        }

    @staticmethod
    def _sglext(body: dict[str, Any], item: _Item, output_ids: list[int]) -> dict[str, Any] | None:
        want_in, want_out = (
            bool(body.get("return_input_ids_in_sglext")),
            bool(body.get("return_output_ids_in_sglext")),
        )
        if not (want_in or want_out):
            return None
        return {
            "routed_experts": None,
            "cached_tokens_details": None,
            "spec_tokens_details": None,
            "input_ids": list(item.prompt_ids) if want_in else None,
            "output_ids": [list(output_ids)] if want_out else None,
        }

    def _chat_response(
        self, body: dict[str, Any], item: _Item, out: dict[str, Any], model: str, tools_active: bool
    ) -> dict[str, Any]:
        meta = out["meta_info"]
        finish = dict(meta["finish_reason"])
        parsed = self._parse(out["text"], tools_active, body, final=True, hold=False)
        message: dict[str, Any] = {
            "role": "assistant",
            "content": parsed.content,
            "reasoning_content": parsed.reasoning,
        }
        if parsed.tool_calls:
            message["tool_calls"] = [
                {"id": _call_id(), "index": i, "type": "function", "function": {"name": n, "arguments": a}}
                for i, (n, a) in enumerate(parsed.tool_calls)
            ]
            if finish["type"] == "stop":
                finish = {"type": "tool_calls", "matched": None}
        choice: dict[str, Any] = {
            "index": 0,
            "message": message,
            "logprobs": (
                self._choice_logprobs(meta["output_token_logprobs"], meta.get("output_top_logprobs"))
                if body.get("logprobs")
                else None
            ),
            "finish_reason": finish["type"],
            "matched_stop": finish.get("matched"),
        }
        if body.get("return_prompt_token_ids") or body.get("return_token_ids"):
            choice["prompt_token_ids"] = out.get("prompt_token_ids")
        if body.get("return_token_ids"):
            choice["response_token_ids"] = out["output_ids"]
        if body.get("return_meta_info"):
            choice["meta_info"] = meta
        response: dict[str, Any] = {
            "id": meta["id"],
            "object": "chat.completion",
            "created": int(time.time()),
            "model": model,
            "choices": [choice],
            "usage": self._usage(meta),
            "metadata": {"weight_version": meta["weight_version"]},
        }
        if (sglext := self._sglext(body, item, out["output_ids"])) is not None:
            response["sglext"] = sglext
        return response

    async def _chat_stream(
        self, body: dict[str, Any], item: _Item, fault: FaultMode | None, model: str, tools_active: bool
    ) -> AsyncGenerator[bytes, None]:
        chunks = _Chunks(item.rid, model)
        opts = body.get("stream_options")
        include_usage = isinstance(opts, dict) and bool(opts.get("include_usage"))
        started = time.perf_counter()
        gen = self._start(item)
        prev = ParsedOutput(None, "", [])
        sent_lp = 0
        last: dict[str, Any] | None = None
        try:
            async for k, finish in self._steps(item, gen, fault):
                out = self._output(item, gen, k, finish, started)
                if out is None:
                    continue
                if last is None:
                    yield chunks.delta({"role": "assistant", "content": ""})
                last = out
                lp = None
                if body.get("logprobs") and k > sent_lp:
                    meta = out["meta_info"]
                    tops = meta.get("output_top_logprobs")
                    lp = self._choice_logprobs(
                        meta["output_token_logprobs"][sent_lp:k], tops[sent_lp:k] if tops else None
                    )
                    sent_lp = k
                cur = self._parse(out["text"], tools_active, body, final=False, hold=finish is None)
                for chunk in chunks.step(prev, cur, lp):
                    yield chunk
                if cur.content.startswith(prev.content):
                    prev = cur
                else:
                    prev = ParsedOutput(cur.reasoning, prev.content, cur.tool_calls)
        finally:
            self.s.in_flight.pop(item.rid, None)
        assert last is not None
        meta = last["meta_info"]
        finish = meta["finish_reason"]
        ftype = "tool_calls" if prev.tool_calls and finish["type"] == "stop" else finish["type"]
        yield chunks.delta({}, finish=ftype, matched=None if ftype == "tool_calls" else finish.get("matched"))
        if (sglext := self._sglext(body, item, last["output_ids"])) is not None:
            yield chunks.model([], sglext=sglext)
        if include_usage:
            yield chunks.model([], usage=self._usage(meta))


class _Chunks:
    """The chunks of one streamed chat completion, in SGLang's shapes."""

    def __init__(self, rid: str, model: str):
        self.head = {
            "id": rid,
            "object": "chat.completion.chunk",
            "created": int(time.time()),
            "model": model,
        }

    def delta(
        self, delta: dict[str, Any], logprobs: Any = None, finish: str | None = None, matched: Any = None
    ) -> bytes:
        # sse_utils.build_sse_content: `reasoning_content` always present, role/content when set.
        d = {"reasoning_content": delta.get("reasoning_content")}
        d.update({k: delta[k] for k in ("role", "content") if delta.get(k) is not None})
        choice = {
            "index": 0,
            "delta": d,
            "logprobs": logprobs,
            "finish_reason": finish,
            "matched_stop": matched,
        }
        return _sse({**self.head, "choices": [choice]})

    def model(self, choices: list[dict[str, Any]], **extra: Any) -> bytes:
        # ChatCompletionStreamResponse.model_dump_json(): every field, nulls included.
        return _sse({**self.head, "choices": choices, "usage": extra.pop("usage", None), **extra})

    def step(self, prev: ParsedOutput, cur: ParsedOutput, lp: Any) -> list[bytes]:
        """The chunks of what `cur` adds to `prev` (reasoning, content, new tool calls); the
        step's logprobs go with the first, or alone when nothing was added."""
        out = []
        if new := (cur.reasoning or "")[len(prev.reasoning or "") :]:
            out.append(self.delta({"reasoning_content": new}, logprobs=lp))
            lp = None
        if cur.content.startswith(prev.content) and (new := cur.content[len(prev.content) :]):
            out.append(self.delta({"content": new}, logprobs=lp))
            lp = None
        for i in range(len(prev.tool_calls), len(cur.tool_calls)):
            name, args = cur.tool_calls[i]
            for call in (
                {
                    "id": _call_id(),
                    "index": i,
                    "type": "function",
                    "function": {"name": name, "arguments": ""},
                },
                {
                    "id": None,
                    "index": i,
                    "type": "function",
                    "function": {"name": None, "arguments": args},
                },
            ):
                delta = {
                    "role": None,
                    "content": None,
                    "reasoning_content": None,
                    "tool_calls": [call],
                }
                choice = {
                    "index": 0,
                    "delta": delta,
                    "logprobs": lp,
                    "finish_reason": None,
                    "matched_stop": None,
                }
                out.append(self.model([choice]))
                lp = None
        if lp is not None:
            out.append(self.delta({}, logprobs=lp))
        return out


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _template_message(m: Any) -> dict[str, Any]:
    """An OpenAI chat message as Hugging Face chat templates expect it."""
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise ValueError("each message must be an object with a string `role`")
    out = dict(m)
    if out["role"] == "developer":
        out["role"] = "system"
    content = out.get("content")
    if isinstance(content, list):
        out["content"] = "".join(
            p.get("text", "")
            for p in content
            if isinstance(p, dict) and p.get("type") in ("text", "input_text")
        )
    elif content is None:
        out["content"] = ""
    calls = out.get("tool_calls")
    if isinstance(calls, list):
        fixed = []
        for c in calls:
            c = dict(c)
            fn = dict(c.get("function") or {})
            if isinstance(fn.get("arguments"), str):
                try:
                    fn["arguments"] = json.loads(fn["arguments"])
                except ValueError:
                    pass
            c["function"] = fn
            fixed.append(c)
        out["tool_calls"] = fixed
    return out
