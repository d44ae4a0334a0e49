"""vLLM's OpenAI-compatible completions API, spoken in its own names (render mode on vLLM); the
module is an `EngineAPI`.

`POST /v1/completions` with the prompt as token ids, `return_token_ids` (vLLM >= 0.10.2:
`choices[].token_ids`, `prompt_token_ids`), `logprobs` (`choices[].logprobs.token_logprobs`, the
sampled tokens' logprobs), delta streaming; its `finish_reason` / `stop_reason` are read into
SGLang's finish-reason shape, so the policy handles both engines alike. vLLM's replies name no
weight version: where it serves `GET /weight_info` (`VLLM_SERVER_DEV_MODE=1`), `weight_version`
reads the one it serves now (the policy decides when, `polar_mitm.policy.versions`). Its model card is `/v1/models`; what its logprobs are of is asked of `/server_info`, or
probed with one token.
"""

from __future__ import annotations

import json
import os
from typing import Any

from polar_mitm import jsontext
from polar_mitm.backends import logprobs
from polar_mitm.backends.engine_api import (
    Fetch,
    GenerateState,
    ModelInfo,
    positive,
    shared_params,
    status_error,
    unreadable,
)
from polar_mitm.neutral import ProviderError, Sampling

NAME = "vllm"
GENERATE_PATH = "/v1/completions"
VERSION_IN_REPLY = False  # `weight_version` reads it (GET /weight_info)
VERSION_IN_CHAT_REPLY = False
HEALTH_PATH = "/health"
# Seconds the one-token probe of vLLM's logprobs mode may take at least (see `logprobs_mode`).
PROBE_S = 60.0


def sampling_params(s: Sampling, *, default_max_tokens: int) -> dict[str, Any]:
    """Neutral sampling settings in vLLM's completion-request names (with the token capture:
    `return_token_ids`, the sampled tokens' `logprobs`)."""
    out: dict[str, Any] = {
        "max_tokens": s.max_tokens if s.max_tokens is not None else default_max_tokens,
        "logprobs": 0,  # the sampled token's logprob, no alternatives
        "return_token_ids": True,
        "skip_special_tokens": False,  # special tokens such as <tool_call> stay in the text
        **shared_params(s),
    }
    if s.json_schema is not None:
        out["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "reply", "schema": s.json_schema},
        }
    return out


def body(ids: bytes, params: dict[str, Any], stream: bool) -> bytes:
    """The /v1/completions request body around already serialized prompt ids."""
    extra = jsontext.dumps({**params, "stream": stream})
    return b'{"prompt":[' + ids + b"]," + extra[1:]


def finish(choice: dict[str, Any]) -> dict[str, Any] | None:
    """vLLM's finish reason in SGLang's shape (`stop_reason`: the stop string or token id; None
    for EOS)."""
    fr = choice.get("finish_reason")
    if fr is None:
        return None
    if fr == "stop":
        return {"type": "stop", "matched": choice.get("stop_reason")}
    if fr == "abort":
        return {"type": "abort", "message": "aborted by the engine"}
    return {"type": str(fr)}


def raise_error(obj: dict[str, Any]) -> None:
    """Raise the error a vLLM reply (or streamed chunk) carries, if it is one: its
    `ErrorResponse` (`{"error": {"message", "type", "param", "code"}}`)."""
    if "error" in obj or obj.get("object") == "error":
        err = obj.get("error", obj)
        message = err.get("message", err) if isinstance(err, dict) else err
        code = err.get("code") if isinstance(err, dict) else None
        if code in (400, 422):
            raise ProviderError("invalid_request", f"policy backend rejected the request: {message}", 400)
        raise ProviderError("api_error", f"policy backend error: {message}", 500)


def add(
    state: GenerateState,
    usage: Any,
    choice: dict[str, Any] | None,
    text: str,
    ids: list[int],
    lps: list[float],
) -> str:
    """Add one read vLLM output (its usage, and its choice's text, sampled ids and their
    logprobs) to `state`; returns the text it adds. vLLM's outputs are deltas, whole replies
    and streamed chunks alike."""
    if isinstance(usage, dict) and usage:
        state.prompt_tokens = usage.get("prompt_tokens", state.prompt_tokens)
        details = usage.get("prompt_tokens_details") or {}
        state.cached_tokens = details.get("cached_tokens", state.cached_tokens)
    if choice is None:
        return ""
    if len(lps) != len(ids):
        raise ProviderError(
            "api_error",
            f"policy backend returned {len(ids)} token ids but {len(lps)} logprobs; is logprobs supported?",
            502,
        )
    state.output_ids.extend(ids)
    state.output_logprobs.extend(lps)
    state._text.append(text)
    state.finish_reason = finish(choice)
    state.chunks += 1
    return text


def fold(state: GenerateState, payload: bytes) -> str:
    """Fold one vLLM /v1/completions output (a delta chunk, or the whole reply) into `state`;
    returns the text it adds. A chunk with no choices (the usage one) adds only the usage."""
    text, ids, lps = "", [], []
    try:
        obj = jsontext.loads(payload)
        raise_error(obj)
        usage = obj.get("usage") or {}
        choices = obj.get("choices") or []
        choice = choices[0] if choices else None
        if choice is not None:
            text = choice.get("text") or ""
            got = choice.get("token_ids")
            lps = [float(x) for x in (choice.get("logprobs") or {}).get("token_logprobs") or []]
            if not isinstance(got, list) or not isinstance(text, str):
                raise ProviderError(
                    "api_error",
                    "the vLLM backend returned no token_ids: it needs return_token_ids (vLLM >= 0.10.2)",
                    502,
                )
            ids = [int(i) for i in got]
    except ProviderError:
        raise
    except (ValueError, KeyError, TypeError, IndexError, AttributeError) as e:
        raise unreadable(payload) from e
    return add(state, usage, choice, text, ids, lps)


async def serves(fetch: Fetch, base: str) -> bool:
    """Whether the front at `base` is vLLM: its model card says so (`owned_by`)."""
    models = await fetch.get_json(base, "/v1/models")
    cards = models.get("data")
    return (
        isinstance(cards, list)
        and bool(cards)
        and isinstance(cards[0], dict)
        and cards[0].get("owned_by") == "vllm"
    )


async def model_info(fetch: Fetch, base: str, *, weight_info: bool = True) -> ModelInfo:
    """vLLM's model card (`/v1/models`): the model's path (`root`, a tokenizer directory when
    it is a local one) and `max_model_len`; vLLM streams deltas. The weight version it serves
    now, unless not `weight_info` (an API whose replies name it)."""
    models = await fetch.get_json(base, "/v1/models")
    try:
        card = models["data"][0]
        root = card.get("root") or card["id"]
    except (KeyError, IndexError, TypeError, AttributeError):
        raise ProviderError(
            "api_error", f"policy backend {base} answered no model card at /v1/models: is it vLLM?", 502
        ) from None
    return ModelInfo(
        model_path=str(card.get("id") or root),
        tokenizer_path=root if isinstance(root, str) and os.path.isdir(root) else None,
        context_length=positive(card.get("max_model_len")),
        incremental_streaming_output=True,
        front="vllm",
        server_info_from="engine",
        logprobs_mode=await logprobs_mode(fetch, base),
        weight_version=await weight_version(fetch, base) if weight_info else None,
    )


async def weight_version(fetch: Fetch, base: str) -> str | None:
    """The weight version the engine at `base` serves now (`GET /weight_info`); None where it
    serves none (404 without `VLLM_SERVER_DEV_MODE=1`). A timeout raises EngineTimeout."""
    status, text = await fetch.get_text(base, "/weight_info")
    if status == 404:
        return None
    if status != 200:
        raise status_error(status, text)
    try:
        version = json.loads(text)["weight_version"]
    except (ValueError, KeyError, TypeError):
        version = None
    if not isinstance(version, str):
        raise ProviderError(
            "api_error", f"policy backend {base} sent an unreadable /weight_info: {text[:200]!r}", 502
        )
    return version


async def logprobs_mode(fetch: Fetch, base: str) -> str | None:
    """vLLM's `--logprobs-mode` in our words: from `/server_info` where it is served
    (`VLLM_SERVER_DEV_MODE=1`), else from one sampled token at top_k 1, whose logprob is
    exactly 0 in the sampling distribution (one token kept) and that token's share of the
    model's distribution otherwise. None when neither tells. The token may be the engine's
    first since it started, which takes seconds more than an info call (vLLM CPU warms up
    then): it gets `PROBE_S` at least."""
    server = await fetch.get_json(base, "/server_info?config_format=json", optional=True)
    config = server.get("vllm_config")
    model = config.get("model_config") if isinstance(config, dict) else None
    named = model.get("logprobs_mode") if isinstance(model, dict) else None
    if isinstance(named, str):
        return logprobs.VLLM_MODES.get(named)
    probe = {"prompt": [0], "max_tokens": 1, "temperature": 1.0, "top_k": 1, "logprobs": 0}
    timeout = max(fetch.timeout, PROBE_S) if fetch.timeout else None
    reply = await fetch.post_json(base, "/v1/completions", probe, timeout=timeout)
    try:
        value = float(reply["choices"][0]["logprobs"]["token_logprobs"][0])
    except (ValueError, KeyError, IndexError, TypeError):
        return None
    return "sampling" if value == 0.0 else "raw" if value < 0.0 else None
