"""The policy: a neutral request in, a stream of neutral events out, every turn stored.

Rooms, in the order a turn passes them: `config` (PolicyConfig, TurnContext), `discovery` (what
the engines are: model info, tokenizer, parsers), `gate` (the weight-sync pause), `prompt`
(render, splice and their caches), `generate` (the one wait-and-ping loop, render and chat mode),
`record` (the stored Turn). `Policy` (`facade`) wires them together."""

from polar_mitm.policy.config import PolicyConfig, TurnContext
from polar_mitm.policy.facade import Policy

__all__ = ["Policy", "PolicyConfig", "TurnContext"]
