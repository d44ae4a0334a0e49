"""Roll out tasks through a running service and print each group as it completes.

    polar-mitm serve --backend http://127.0.0.1:30000 --db rollouts.sqlite --task-root tasks/ &
    python examples/client_rollout.py tasks/ --harness claude-code --samples 4

Tasks are paths the server can read (Harbor directories, task files) under its --task-root. The
control token is read where `serve` wrote it (or POLAR_MITM_SERVICE_TOKEN). Each group's samples carry
the trainer's fields: tokens (prompt + response), loss_mask, rollout_logprobs, reward, status,
weight_versions, advantage.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from polar_mitm.client import RolloutClient


def main(argv: list[str] | None = None) -> list:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("tasks", nargs="+", type=Path)
    ap.add_argument("--server", default="http://127.0.0.1:8700")
    ap.add_argument("--token-file", default=None, help="[default: the file serve writes]")
    ap.add_argument("--harness", default="claude-code")
    ap.add_argument("--runtime", default="docker")
    ap.add_argument("--samples", type=int, default=4)
    a = ap.parse_args(argv)
    groups = []
    with RolloutClient(a.server, token_file=a.token_file) as client:
        for group in client.rollout(
            a.tasks, samples=a.samples, harness=a.harness, runtime=a.runtime, poll=0.5
        ):
            groups.append(group)
            print(f"{group.task_id}: rewards {[o.reward for o in group.outcomes]}")
            for s in group.samples:
                print(
                    f"  sample {s.index}: {len(s.tokens)} tokens, {sum(s.loss_mask)} trained, "
                    f"status {s.status}, reward {s.reward}, advantage {s.advantage}, versions {s.weight_versions}"
                )
    return groups


if __name__ == "__main__":
    main()
