"""`FakeBackendConfig`: everything `polar-mitm fake-backend` can be told, as one pydantic model
(the CLI builds it, `create_app` takes it)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

from polar_mitm.fake.script import DEFAULT_SCRIPT, Rule


class FakeBackendConfig(BaseModel):
    """Everything `polar-mitm fake-backend` can be told."""

    model_config = ConfigDict(extra="forbid")

    tokenizer_path: str
    mode: Literal["scripted", "random", "hf"] = "scripted"  # hf: a real causal LM (`fake/hf.py`)
    model_dir: str | None = None  # mode hf: the Hugging Face model directory
    script: list[Rule] | None = None  # None: DEFAULT_SCRIPT
    seed: int = 0
    weight_version: str = "0"
    token_delay: float = 0.0  # seconds between generated tokens
    first_token_delay: float = 0.0  # seconds before the first token
    model_path: str = "polar-mitm/fake"
    served_model_name: str | None = None  # default: model_path
    tool_call_parser: str | None = "qwen25"
    reasoning_parser: str | None = "qwen3"
    context_length: int = 32768
    random_vocab_size: int = 2048  # ordinary token ids the random model draws from (plus eos)
    random_eos_probability: float = 1 / 24  # at temperature 1, before truncation
    incremental_streaming_output: bool = False  # SGLang's --incremental-streaming-output
    fail_next: int = 0  # the first N generation requests answer HTTP 500
    request_log_size: int = 100
    hang_seconds: float = 3600.0  # how long a "hang" fault holds a request open
    api_key: str | None = None  # SGLang's --api-key: calls without the bearer token get 401
    api: Literal["sglang", "vllm"] = "sglang"  # vllm: vLLM's /v1/completions and model card only
    # api vllm: its development endpoints (/weight_info, /pause, /collective_rpc, …), as
    # VLLM_SERVER_DEV_MODE=1 opens them; off: 404 there, as vLLM's default.
    vllm_dev_mode: bool = True
    # api vllm: its token-in, token-out /inference/v1/generate, as --enable-scale-out opens it;
    # off: 403 there, as vLLM's default.
    vllm_scale_out: bool = True

    def rules(self) -> list[Rule]:
        return list(self.script) if self.script is not None else list(DEFAULT_SCRIPT)
