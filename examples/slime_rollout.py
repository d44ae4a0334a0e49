"""polar-mitm as slime's rollout function.

In a slime training run:

    export POLAR_MITM_SERVER=http://127.0.0.1:8700 POLAR_MITM_HARNESS=claude-code
    python train.py ... --rollout-function-path polar_mitm.bridges.slime.generate_rollout

slime's data source hands out groups of Samples; put a task in each sample's metadata
(`metadata["polar_task"]`: a Task dict, or a Harbor directory path the service can read) or let the
prompt be the instruction. This script runs the same function without slime, with a two-group
stand-in data source, against a running service:

    polar-mitm serve --backend http://127.0.0.1:30000 --task-root tasks/ &
    python examples/slime_rollout.py tasks/answer-right tasks/answer-wrong --samples 4
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from enum import Enum
from types import SimpleNamespace
from typing import Any

from polar_mitm.bridges.slime import generate_rollout


@dataclass
class Sample:
    """The fields of slime's Sample that the rollout function fills (slime.utils.types.Sample)."""

    class Status(Enum):
        PENDING = "pending"
        COMPLETED = "completed"
        TRUNCATED = "truncated"
        ABORTED = "aborted"

    prompt: str = ""
    metadata: dict[str, Any] = field(default_factory=dict)
    index: int | None = None
    group_index: int | None = None
    tokens: list[int] = field(default_factory=list)
    response_length: int = 0
    loss_mask: list[int] | None = None
    rollout_log_probs: list[float] | None = None
    reward: float | None = None
    status: Any = Status.PENDING
    weight_versions: list[str] = field(default_factory=list)
    remove_sample: bool = False


class DataSource:
    def __init__(self, tasks: list[str], n: int):
        self.groups = [[Sample(metadata={"polar_task": t}) for _ in range(n)] for t in tasks]

    def get_samples(self, num: int) -> list[list[Sample]]:
        out, self.groups = self.groups[:num], self.groups[num:]
        return out


def main(argv: list[str] | None = None) -> list[list[Sample]]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("tasks", nargs="+")
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--server", default="http://127.0.0.1:8700")
    ap.add_argument("--harness", default="claude-code")
    ap.add_argument("--runtime", default="docker")
    a = ap.parse_args(argv)
    args = SimpleNamespace(
        rollout_batch_size=len(a.tasks),
        polar_server=a.server,
        polar_harness=a.harness,
        polar_runtime=a.runtime,
        polar_poll=0.5,
    )
    groups = generate_rollout(args, 0, DataSource(a.tasks, a.samples))
    groups = getattr(groups, "samples", groups)
    for g in groups:
        print([(s.index, s.status.name, s.reward, s.response_length, s.remove_sample) for s in g])
    return groups


if __name__ == "__main__":
    main()
