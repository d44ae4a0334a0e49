"""polar-mitm as a verl agent loop.

In verl, register the loop and select it by name (`actor_rollout_ref.rollout.agent.default_agent_loop=polar`
or per row with `agent_name: polar`), with the service's address in the environment:

    export POLAR_MITM_SERVER=http://127.0.0.1:8700 POLAR_MITM_HARNESS=claude-code
    python -c "from polar_mitm.bridges.verl import agent_loop_class; agent_loop_class()"   # registers it

Each dataset row names its task in `extra_info["polar_task"]` (a Task dict, or a path the service
can read). This script runs the loop without verl, against a running service:

    polar-mitm serve --backend http://127.0.0.1:30000 --task-root tasks/ &
    python examples/verl_agent_loop.py tasks/answer-right
"""

from __future__ import annotations

import argparse
import asyncio

from polar_mitm.bridges.verl import agent_loop_class


def main(argv: list[str] | None = None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("task")
    ap.add_argument("--server", default="http://127.0.0.1:8700")
    ap.add_argument("--harness", default="claude-code")
    ap.add_argument("--runtime", default="docker")
    a = ap.parse_args(argv)
    loop = agent_loop_class()()
    loop.server, loop.harness, loop.runtime, loop.poll = a.server, a.harness, a.runtime, 0.5
    out = asyncio.run(loop.run({}, extra_info={"polar_task": a.task}))
    print(
        f"prompt {len(out.prompt_ids)} tokens, response {len(out.response_ids)} tokens "
        f"({sum(out.response_mask)} trained), reward {out.reward_score}, turns {out.num_turns}, {out.metrics}"
    )
    return out


if __name__ == "__main__":
    main()
