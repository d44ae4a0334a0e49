"""A sample's outcomes, and which of them are trained: one definition for the pipeline, the
store, the service, the client and the trainer bridges.

- `completed`: the harness ended and the evaluator scored it;
- `agent_timeout`: the harness overran its time; its turns are trained with reward 0;
- `failed`, `cancelled`, `retried`: masked in exports (loss_mask 0, reward 0), never dropped.
"""

from __future__ import annotations

TRAINABLE = frozenset({"completed", "agent_timeout"})
FINAL = frozenset({*TRAINABLE, "failed", "cancelled", "retried"})


def trainable(status: str | None) -> bool:
    return status in TRAINABLE
