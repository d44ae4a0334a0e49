"""vLLM's token-in, token-out endpoint (`POST /inference/v1/generate`, vLLM >= 0.32 started with
`--enable-scale-out`; 403 without it); the module is an `EngineAPI` (`--backend-kind
vllm-generate`).

The request is `token_ids` and vLLM's own `sampling_params` (`SamplingParams`' names:
`max_tokens`, `temperature`, `top_p`, `top_k`, `stop`, `logprobs` 0 for the sampled token's
logprob alone, `skip_special_tokens` false, `structured_outputs.json` for a schema), with
`output_mode` "text" so that the reply holds the text the output parsers read beside the ids.
The reply (`choices[0]`: `text`, `token_ids`, `logprobs.content[].logprob`, `finish_reason`,
`stop_reason`) does not echo the prompt, and names the weights that sampled its tokens
(`weight_versions`, spans over the output tokens, on the last streamed chunk or the whole
reply): that is the turn's weight version, so no `/weight_info` is read. Streamed chunks are
deltas, as on `/v1/completions`, and fold with `vllm.add`; the finish reasons are read into
SGLang's shape by `vllm.finish`.

What the front serves is read as for `vllm` (`/v1/models`, `/server_info`), and one token is
generated here to see that the endpoint answers (and with which weight version).
"""

from __future__ import annotations

from typing import Any

from polar_mitm import jsontext
from polar_mitm.backends import vllm
from polar_mitm.backends.engine_api import (
    VLLM_SCALE_OUT,
    Fetch,
    GenerateState,
    ModelInfo,
    shared_params,
    span_version,
    status_error,
    unreadable,
)
from polar_mitm.neutral import ProviderError, Sampling

NAME = "vllm-generate"
GENERATE_PATH = "/inference/v1/generate"
VERSION_IN_REPLY = True  # `weight_versions` spans
VERSION_IN_CHAT_REPLY = False  # vLLM's /v1/chat/completions names none: `weight_version` reads it
weight_version = vllm.weight_version
HEALTH_PATH = vllm.HEALTH_PATH
# The one-token generation that shows the endpoint is open (`model_info`).
PROBE = {"token_ids": [0], "sampling_params": {"max_tokens": 1, "logprobs": 0}, "output_mode": "text"}


def sampling_params(s: Sampling, *, default_max_tokens: int) -> dict[str, Any]:
    """Neutral sampling settings in vLLM's `SamplingParams` names (with the sampled tokens'
    `logprobs`)."""
    out: dict[str, Any] = {
        "max_tokens": s.max_tokens if s.max_tokens is not None else default_max_tokens,
        "logprobs": 0,  # the sampled token's logprob, no alternatives
        "skip_special_tokens": False,  # special tokens such as <tool_call> stay in the text
        **shared_params(s),
    }
    if s.json_schema is not None:
        out["structured_outputs"] = {"json": s.json_schema}
    return out


def body(ids: bytes, params: dict[str, Any], stream: bool) -> bytes:
    """The /inference/v1/generate request body around already serialized prompt ids."""
    return b"".join(
        (
            b'{"token_ids":[',
            ids,
            b'],"sampling_params":',
            jsontext.dumps(params),
            b',"output_mode":"text","stream":',
            b'true,"stream_options":{"include_usage":true}}' if stream else b"false}",
        )
    )


def fold(state: GenerateState, payload: bytes) -> str:
    """Fold one /inference/v1/generate output (a delta chunk, or the whole reply) into `state`;
    returns the text it adds. The chunk with no choices (the usage one) adds only the usage; the
    one with weight version spans sets the turn's version."""
    text, ids, lps, version = "", [], [], None
    try:
        obj = jsontext.loads(payload)
        vllm.raise_error(obj)
        usage = obj.get("usage") or {}
        choices = obj.get("choices") or []
        choice = choices[0] if choices else None
        if choice is not None:
            text = choice.get("text")
            got = choice.get("token_ids")
            if not isinstance(got, list) or not isinstance(text, str):
                raise ProviderError(
                    "api_error",
                    "the vLLM backend returned no text or token_ids: /inference/v1/generate needs "
                    'output_mode "text" (vLLM >= 0.32)',
                    502,
                )
            ids = [int(i) for i in got]
            lps = [float(c["logprob"]) for c in (choice.get("logprobs") or {}).get("content") or []]
            version = span_version(choice.get("weight_versions"))
    except ProviderError:
        raise
    except (ValueError, KeyError, TypeError, IndexError, AttributeError) as e:
        raise unreadable(payload) from e
    added = vllm.add(state, usage, choice, text, ids, lps)
    if version is not None:
        state.weight_version = version
    return added


async def model_info(fetch: Fetch, base: str) -> ModelInfo:
    """What the vLLM engine at `base` serves (`vllm.model_info`), once one token generated at
    /inference/v1/generate shows the endpoint is open; the weight version is that token's."""
    info = await vllm.model_info(fetch, base, weight_info=False)
    timeout = max(fetch.timeout, vllm.PROBE_S) if fetch.timeout else None
    status, text = await fetch.post_text(base, GENERATE_PATH, PROBE, timeout=timeout)
    if status == 403 and "--enable-scale-out" in text:
        raise ProviderError(
            "api_error",
            f"the vLLM engine at {base} does not serve {GENERATE_PATH} ({VLLM_SCALE_OUT}), or use "
            "--backend-kind vllm",
            502,
        )
    if status == 404:
        raise ProviderError(
            "api_error",
            f"the vLLM engine at {base} has no {GENERATE_PATH} (vLLM >= 0.32 serves it): use --backend-kind vllm",
            502,
        )
    if status != 200:
        raise status_error(status, text)
    state = GenerateState()
    fold(state, text.encode())
    return info.model_copy(update={"weight_version": state.weight_version, "generate_path": GENERATE_PATH})
