"""SGLang's native API (`/generate`, `/model_info`, `/get_server_info`), spoken to an engine
directly or through SGLang's router (`sglang-router`); the module is an `EngineAPI`.

Only SGLang's own names go over the wire: `input_ids`, `sampling_params` with SGLang keys
(unknown keys are a 400 there), `return_logprob`; we read `output_ids`,
`meta_info.output_token_logprobs`, `meta_info.finish_reason` and `meta_info.weight_version`, and
keep them exactly. Chunks stream cumulative state by default and increments with
`--incremental-streaming-output`; both fold alike.
"""

from __future__ import annotations

import json
from typing import Any

from polar_mitm import jsontext
from polar_mitm.backends import logprobs
from polar_mitm.backends.engine_api import (
    Fetch,
    GenerateState,
    ModelInfo,
    NoWorkers,
    positive,
    shared_params,
    status_error,
    unreadable,
)
from polar_mitm.neutral import ProviderError, Sampling

NAME = "sglang"
GENERATE_PATH = "/generate"
VERSION_IN_REPLY = True  # meta_info.weight_version, in /generate's replies and chat completions
VERSION_IN_CHAT_REPLY = True
HEALTH_PATH = "/health_generate"  # one token through the scheduler (/health: the HTTP process is up)


class NotSGLang(ProviderError):
    """The front answers neither /model_info nor /get_model_info: not SGLang's API (another
    engine's, or not an engine's root URL)."""

    def __init__(self, base: str):
        super().__init__(
            "api_error",
            f"policy backend {base} answered 404 for /model_info and /get_model_info: is --backend an "
            "SGLang server's (or router's) root URL?",
            502,
        )


def sampling_params(s: Sampling, *, default_max_tokens: int) -> dict[str, Any]:
    """Map neutral sampling settings to SGLang's names; unknown keys are a 400 there."""
    out: dict[str, Any] = {
        "max_new_tokens": s.max_tokens if s.max_tokens is not None else default_max_tokens,
        **shared_params(s),
    }
    if s.json_schema is not None:
        out["json_schema"] = json.dumps(s.json_schema)
    # Special tokens such as <tool_call> must survive in `text` for the output parsers; SGLang
    # keeps added non-special tokens either way, and the ids are what we train on.
    return out


def body(ids: bytes, params: dict[str, Any], stream: bool) -> bytes:
    """The /generate request body around already serialized input ids."""
    return b"".join(
        (
            b'{"input_ids":[',
            ids,
            b'],"sampling_params":',
            jsontext.dumps(params),
            b',"return_logprob":true,"stream":',
            b"true}" if stream else b"false}",
        )
    )


def fold(state: GenerateState, payload: bytes) -> str:
    """Fold one /generate output (a streamed chunk, or the whole reply) into `state`; returns the
    text it adds."""
    try:
        obj = jsontext.loads(payload)
        meta = obj.get("meta_info") or {}
        if "error" in obj and "text" not in obj:
            err = obj["error"]
            code = err.get("code") if isinstance(err, dict) else None
            message = err.get("message", err) if isinstance(err, dict) else err
            if code in (400, 422):
                raise ProviderError("invalid_request", f"policy backend rejected the request: {message}", 400)
            raise ProviderError("api_error", f"policy backend error: {message}", 500)
        text = obj["text"]
        ids = obj["output_ids"]
        lps = [float(t[0]) for t in meta.get("output_token_logprobs") or []]
        if not isinstance(ids, list) or not isinstance(text, str):
            raise TypeError("output_ids is not a list or text is not a string")
    except ProviderError:
        raise
    except (ValueError, KeyError, TypeError, IndexError, AttributeError) as e:
        raise unreadable(payload) from e
    # SGLang streams cumulative state by default and increments with --incremental-streaming-output;
    # accept both, deciding once at the second chunk unless the server said which.
    if state.chunks == 1 and state.cumulative is None:
        acc = state.output_ids
        state.cumulative = len(ids) > len(acc) and ids[: len(acc)] == acc
    if state.chunks == 0 or state.cumulative:
        prev = state.text
        added = text[len(prev) :] if text.startswith(prev) else text
        state.output_ids, state.output_logprobs = ids, lps
        state._text[:] = [text]
    else:
        added = text
        state.output_ids.extend(ids)
        state.output_logprobs.extend(lps)
        state._text.append(text)
    if len(state.output_logprobs) != len(state.output_ids):
        raise ProviderError(
            "api_error",
            f"policy backend returned {len(state.output_ids)} output ids but {len(state.output_logprobs)} "
            "logprobs; is return_logprob supported?",
            502,
        )
    state.finish_reason = meta.get("finish_reason")
    state.weight_version = meta.get("weight_version", state.weight_version)
    state.prompt_tokens = meta.get("prompt_tokens", state.prompt_tokens)
    state.cached_tokens = meta.get("cached_tokens", state.cached_tokens)
    state.chunks += 1
    return added


async def model_info(fetch: Fetch, base: str) -> ModelInfo:
    """What an SGLang engine or router at `base` serves.

    An engine answers /model_info (older SGLang only /get_model_info) and /get_server_info.
    SGLang's router answers /get_model_info from a worker, but /get_server_info is its own
    (`router_manager`, `workers_count`): the context length and the streaming mode come from a
    worker it lists at /workers. Raises NoWorkers while the router has none, NotSGLang when the
    front answers neither model-info path."""
    server = await fetch.get_json(base, "/get_server_info")
    info_from = "engine"
    workers: list[str] = []
    if server.get("router_manager"):
        listed = await fetch.get_json(base, "/workers")
        workers = [
            w["url"]
            for w in listed.get("workers") or []
            if isinstance(w, dict) and isinstance(w.get("url"), str) and w.get("is_healthy", True)
        ]
        if not workers:
            raise NoWorkers(base)
        server, info_from = {}, ""
        for worker in workers:  # the first that tells (a worker may sit behind its own key)
            server = await fetch.get_json(worker.rstrip("/"), "/get_server_info", optional=True)
            if server and not server.get("router_manager"):
                info_from = worker
                break
    info = await _model_info(fetch, base)
    info.logprobs_mode = logprobs.SGLANG_MODE
    if workers:
        info.front, info.workers = "router", workers
    info.server_info_from = info_from if server else ""
    if isinstance(server.get("incremental_streaming_output"), bool):
        info.incremental_streaming_output = server["incremental_streaming_output"]
    if info.context_length is None:
        info.context_length = positive(server.get("context_length"))
    if info.context_length is None:
        models = await fetch.get_json(base, "/v1/models", optional=True)
        try:
            info.context_length = positive(models["data"][0].get("max_model_len"))
        except (KeyError, IndexError, TypeError, AttributeError):
            pass
    return info


async def _model_info(fetch: Fetch, base: str) -> ModelInfo:
    """/model_info, else /get_model_info (SGLang's older name, and the router's only one)."""
    for path in ("/model_info", "/get_model_info"):
        status, text = await fetch.get_text(base, path)
        if status == 404:
            continue
        if status == 503 and "no_workers" in text:
            raise NoWorkers(base)
        if status != 200:
            raise status_error(status, text)
        try:
            return ModelInfo.model_validate_json(text)
        except ValueError as e:
            raise ProviderError(
                "api_error", f"policy backend {base} sent an unreadable {path}: {e}", 502
            ) from None
    raise NotSGLang(base)


async def weight_version(fetch: Fetch, base: str) -> str | None:
    """The weight version the engine at `base` serves now (its model info's `weight_version`)."""
    return (await _model_info(fetch, base)).weight_version
