"""Chat backend mode: the server renders the chat template, we still keep the engine's tokens.

For servers where the proxy should not render templates itself. The request goes to the
server's OpenAI-compatible `/v1/chat/completions` with the token-capture extras it supports
(SGLang: `return_prompt_token_ids`, `return_token_ids`, `return_meta_info`; vLLM:
`return_token_ids`), and the prompt ids, sampled ids and logprobs are read from the engine's
answer — never re-tokenized. Replies are not streamed token by token in this mode (SGLang
refuses the token-capture extras with streaming); the harness gets keep-alive pings meanwhile.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, Field

from polar_mitm.neutral import ChatRequest, FinishReason, ProviderError, ToolCall


class ChatResult(BaseModel):
    prompt_ids: list[int]
    output_ids: list[int]
    output_logprobs: list[float]
    text: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCall] = Field(default_factory=list)
    finish_reason: FinishReason = "stop"
    stop_sequence: str | None = None
    weight_version: str | None = None
    cached_tokens: int = 0
    reasoning_tokens: int = 0  # of output_ids, those of the reasoning block (the engine's count)


def chat_body(req: ChatRequest, max_tokens: int) -> dict[str, Any]:
    messages = []
    for m in req.messages:
        d = m.to_template()
        for c in d.get("tool_calls", []):
            if not isinstance(c["function"]["arguments"], str):
                c["function"]["arguments"] = json.dumps(c["function"]["arguments"], ensure_ascii=False)
        if "reasoning_content" in d and not d["reasoning_content"]:
            del d["reasoning_content"]
        messages.append(d)
    body: dict[str, Any] = {
        "model": req.model or "default",
        "messages": messages,
        "max_tokens": max_tokens,
        "stream": False,
        "logprobs": True,
        "return_prompt_token_ids": True,
        "return_token_ids": True,
        "return_meta_info": True,
    }
    if req.tools:
        body["tools"] = [t.to_template() for t in req.tools]
        if req.tool_choice is not None:
            body["tool_choice"] = (
                {"type": "function", "function": req.tool_choice}
                if isinstance(req.tool_choice, dict)
                else req.tool_choice
            )
    s = req.sampling
    for key, value in (("temperature", s.temperature), ("top_p", s.top_p), ("top_k", s.top_k)):
        if value is not None:
            body[key] = value
    if s.stop:
        body["stop"] = s.stop
    if s.json_schema is not None:
        body["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "reply", "schema": s.json_schema},
        }
    if req.thinking is not None:
        body["chat_template_kwargs"] = {"enable_thinking": req.thinking}
    return body


def parse_chat_result(data: Any) -> ChatResult:
    """Read ids and logprobs from an SGLang or vLLM chat completion; refuse when they are missing."""
    try:
        choice = data["choices"][0]
        msg = choice.get("message") or {}
    except (KeyError, IndexError, TypeError) as e:
        raise ProviderError("api_error", f"chat backend returned no choices: {str(data)[:300]}", 502) from e
    meta = choice.get("meta_info") or data.get("meta_info") or {}
    prompt_ids = choice.get("prompt_token_ids") or data.get("prompt_token_ids")
    triples = meta.get("output_token_logprobs")
    if triples:
        output_ids = [int(t[1]) for t in triples]
        logprobs = [float(t[0]) for t in triples]
    else:
        output_ids = choice.get("response_token_ids") or choice.get("token_ids")
        content = (choice.get("logprobs") or {}).get("content") or []
        logprobs = [float(c["logprob"]) for c in content]
    if prompt_ids is None or output_ids is None:
        raise ProviderError(
            "api_error",
            "chat backend did not return token ids; it must support return_prompt_token_ids/return_token_ids "
            "(SGLang) or return_token_ids (vLLM) — or use --backend-mode render",
            502,
        )
    if len(logprobs) != len(output_ids):
        raise ProviderError(
            "api_error",
            f"chat backend returned {len(output_ids)} output ids but {len(logprobs)} logprobs; "
            "is logprobs supported?",
            502,
        )
    calls = []
    for c in msg.get("tool_calls") or []:
        fn = c.get("function") or {}
        raw = fn.get("arguments") or "{}"
        try:
            args = json.loads(raw) if isinstance(raw, str) else raw
            calls.append(ToolCall(id=c.get("id") or "", name=fn.get("name", ""), arguments=args))
        except ValueError:
            calls.append(ToolCall(id=c.get("id") or "", name=fn.get("name", ""), raw=raw))
    fr = choice.get("finish_reason") or "stop"
    matched = choice.get("matched_stop")
    usage = data.get("usage") or {}
    details = usage.get("prompt_tokens_details") or {}
    return ChatResult(
        prompt_ids=[int(i) for i in prompt_ids],
        output_ids=[int(i) for i in output_ids],
        output_logprobs=logprobs,
        text=msg.get("content") or "",
        reasoning=msg.get("reasoning_content") or "",
        tool_calls=calls,
        finish_reason={"length": "length", "tool_calls": "tool_calls"}.get(fr, "stop"),
        stop_sequence=matched if isinstance(matched, str) else None,
        weight_version=meta.get("weight_version") or (data.get("metadata") or {}).get("weight_version"),
        cached_tokens=int(meta.get("cached_tokens") or details.get("cached_tokens") or 0),
        reasoning_tokens=int(
            usage.get("reasoning_tokens")
            or (usage.get("completion_tokens_details") or {}).get("reasoning_tokens")
            or 0
        ),
    )
