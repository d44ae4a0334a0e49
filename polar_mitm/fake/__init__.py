"""A fake SGLang policy server: SGLang's native HTTP API without a GPU or a model.

`polar-mitm fake-backend` serves it for demos and users' CI, and every test and benchmark of the
proxy talks to it, so it answers the way SGLang's HTTP server does (checked against SGLang 0.5.x:
`srt/entrypoints/http_server.py`, `srt/managers/tokenizer_manager.py`, `srt/managers/io_struct.py`,
`srt/managers/schedule_batch.py`, `srt/managers/detokenizer_manager.py`,
`srt/sampling/sampling_params.py`, `srt/entrypoints/openai/{protocol,serving_chat,sse_utils}.py`
and the generated JSON contract `sglang/api/v1/api_types.py`).
Each module documents the part of that API it serves:

- `server.py`: the aiohttp app, `POST /generate` (its exact output and streaming shapes), the info
  and control endpoints, the `/_fake/` admin endpoints, and the entry points (`create_app`,
  `start_fake_backend`, `serve`).
- `chat.py`: `POST /v1/chat/completions` and its output parsing (qwen3 reasoning, qwen25 tools).
- `vllm.py`: vLLM's own mode (`api="vllm"`): `POST /v1/completions` with token-id prompts,
  `return_token_ids` and `logprobs`, delta streaming, and vLLM's model card (checked against vLLM's
  `entrypoints/openai/completion/protocol.py`).
- `contract.py`: what SGLang accepts (its JSON contract gate, `SamplingParams` verification as
  `GenParams`) and the shapes of its error bodies.
- `serving.py`: what both generation endpoints share: a generation released over time, faults,
  and the /generate output with its logprobs.
- `engine.py`: generation to the end with SGLang's stop logic and detokenization (pure).
- `script.py`, `json_schema.py`, `model.py`: the scripted model's rules and replies, the minimal
  schema-valid instances of fake constrained decoding, and the seeded random model (all pure).
- `config.py`, `state.py`: what a server is told (`FakeBackendConfig`) and what it remembers
  (`FakeBackendState`, at `app[STATE]`).

Two models stand behind it. `scripted` (the default) picks its reply by ordered `Rule`s over the
prompt and writes it the way a Qwen model does (`<tool_call>\\n{...}\\n</tool_call>`, then
`<|im_end|>`), with deterministic float32 logprobs; `random` is a tiny seeded numpy model whose
logprobs are true log-softmax values of the distribution it samples from (after temperature and
before top-k/top-p truncation, as SGLang's sampler reports them). A `random` request with
`sampling_seed` is reproducible by itself; without one, the k-th request for a prompt draws the
k-th sample, so a group of identical requests differs and a fresh server replays the sequence.
With `json_schema` both models answer a minimal schema-valid instance (fake constrained
decoding). Admin endpoints under `/_fake/` (`fault`, `requests`, `reset`, `state`) inject faults
and show what clients sent.
"""

from __future__ import annotations

from polar_mitm.fake.chat import ParsedOutput, parse_output
from polar_mitm.fake.config import FakeBackendConfig
from polar_mitm.fake.contract import (
    ContractError,
    GenParams,
    check_generate_body,
    check_sampling_params,
)
from polar_mitm.fake.engine import Engine, Generation
from polar_mitm.fake.json_schema import minimal_json_instance
from polar_mitm.fake.model import RandomModel, Step, log_softmax, random_vocab, truncation_mask
from polar_mitm.fake.script import (
    DEFAULT_SCRIPT,
    DEFAULT_TEXT,
    SHELL_TOOL_NAMES,
    Rule,
    ToolCallSpec,
    chatml_messages,
    declared_tools,
    expand_groups,
    find_shell_tool,
    format_tool_call,
    is_code_mode_exec,
    last_message_text,
    load_script,
    scripted_logprob,
    scripted_reply,
    shell_arguments,
)
from polar_mitm.fake.server import SGLANG_VERSION_EMULATED, create_app, serve, start_fake_backend
from polar_mitm.fake.state import STATE, FakeBackendState, Fault, FaultMode

__all__ = [
    "DEFAULT_SCRIPT",
    "DEFAULT_TEXT",
    "SGLANG_VERSION_EMULATED",
    "SHELL_TOOL_NAMES",
    "STATE",
    "ContractError",
    "Engine",
    "FakeBackendConfig",
    "FakeBackendState",
    "Fault",
    "FaultMode",
    "GenParams",
    "Generation",
    "ParsedOutput",
    "RandomModel",
    "Rule",
    "Step",
    "ToolCallSpec",
    "chatml_messages",
    "check_generate_body",
    "check_sampling_params",
    "create_app",
    "declared_tools",
    "expand_groups",
    "find_shell_tool",
    "format_tool_call",
    "is_code_mode_exec",
    "last_message_text",
    "load_script",
    "log_softmax",
    "minimal_json_instance",
    "parse_output",
    "random_vocab",
    "scripted_logprob",
    "scripted_reply",
    "serve",
    "shell_arguments",
    "start_fake_backend",
    "truncation_mask",
]
