"""How many times one model call's handling in `proxy/gateway.py` reaches into the policy: every
attribute of the `Policy` read by code in gateway.py over one request, on the in-process gateway
rig with the fake backend (after a first call loaded the tokenizer). Issue 45 asked for at most
3; before the context admission moved into `policy/admission.py` it was 7 (max_request_bytes,
backend_mode twice, context_length twice, tokenizer, stream).

    PYTHONPATH=. .venv/bin/python bench/gateway_policy_calls.py
"""

from __future__ import annotations

import asyncio
import inspect
import tempfile
from pathlib import Path
from typing import Any

import polar_mitm.proxy.gateway as gateway
from polar_mitm.backends.tokenizer_build import ensure_tokenizer
from tests.support.helpers import VALID_REQUESTS
from tests.support.rig import start_gateway_rig

GATEWAY = Path(gateway.__file__).resolve()


class Counting:
    """The policy, noting each attribute that code in gateway.py reads (a config's too)."""

    def __init__(self, inner: Any, seen: list[str], prefix: str = ""):
        object.__setattr__(self, "_inner", inner)
        object.__setattr__(self, "_seen", seen)
        object.__setattr__(self, "_prefix", prefix)

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._inner, name)
        frame = inspect.currentframe()
        caller = frame.f_back if frame is not None else None
        if caller is not None and Path(caller.f_code.co_filename).resolve() == GATEWAY:
            if name == "config":  # counted by the field read from it
                return Counting(value, self._seen, "config.")
            self._seen.append(f"{self._prefix}{name} ({caller.f_code.co_name})")
        return value


async def count(style: str, body: dict[str, Any], context: int) -> list[str]:
    with tempfile.TemporaryDirectory() as tmp:
        rig, close = await start_gateway_rig(
            Path(tmp), ensure_tokenizer("qwen"), backend={"context_length": context}
        )
        try:
            assert (await rig.post(style, VALID_REQUESTS[style]))[0] == 200  # the tokenizer loaded
            seen: list[str] = []
            policy = rig.gateway.policy
            rig.gateway.policy = Counting(policy, seen)  # type: ignore[assignment]
            status, _, raw = await rig.post(style, body)
            rig.gateway.policy = policy
            assert status == 200, raw[:300]
            return seen
        finally:
            await close()


def main() -> None:
    long = {**VALID_REQUESTS["anthropic"], "messages": [{"role": "user", "content": "word " * 1000}]}
    for what, style, body, context in (
        ("anthropic", "anthropic", VALID_REQUESTS["anthropic"], 32768),
        ("openai-chat", "openai-chat", VALID_REQUESTS["openai-chat"], 32768),
        ("anthropic, 5,000 bytes of text, 4,096-token context", "anthropic", long, 4096),
    ):
        seen = asyncio.run(count(style, body, context))
        print(f"{what}: {len(seen)} ({', '.join(seen)})")


if __name__ == "__main__":
    main()
