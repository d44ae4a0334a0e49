"""The policy: a neutral request in, a stream of neutral events out, every turn stored.

Rooms, in the order a turn passes them: `config` (PolicyConfig, TurnContext), `discovery` (what
the engines are: model info, tokenizer, parsers), `admission` (whether a prompt fits the
context, and the reply's max_tokens), `gate` (the weight-sync pause), `prompt` (render, splice
and their caches), `generate` (the one wait-and-ping loop, render and chat mode), `record` (the
stored Turn). `Policy` (`facade`) wires them together.

`Policy` is imported when first asked for, so `polar_mitm.policy.config` (what the command line
builds its options from) loads no engine client."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from polar_mitm.policy.config import PolicyConfig, TurnContext

if TYPE_CHECKING:
    from polar_mitm.policy.facade import Policy

__all__ = ["Policy", "PolicyConfig", "TurnContext"]


def __getattr__(name: str) -> Any:  # `from polar_mitm.policy import Policy`
    if name == "Policy":
        from polar_mitm.policy.facade import Policy

        return Policy
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
