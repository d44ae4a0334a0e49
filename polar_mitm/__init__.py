"""polar-mitm: a transparent MITM proxy that turns unmodified agent harnesses into token-exact RL
environments. Most users drive it from the command line (`polar-mitm --help`); these are the names
a Python program imports, each from here or from the module it lives in:

- The rollout service's client (`polar_mitm.client`, HTTP only: no proxy, store or PyTorch):
  `RolloutClient`, `AsyncRolloutClient`, the `Group` and `Sample` they return, `RolloutError`.
- The service's API models (`polar_mitm.api`): `TaskRequest`, `Submitted`, `TaskView`,
  `SampleView`, `Event`.
- The task model (`polar_mitm.tasks`): `Task`, `TaskStep`, `Upload`, `EvaluatorSpec`,
  `load_tasks` (Harbor directories, SWE-bench rows, task files) and its `TaskFileError`.
- Export, store to training rows (`polar_mitm.reconstruct.export`): `export` (to parquet or JSON
  lines), `iter_trajectories` (the rows as `Trajectory` objects), `Selection` (which turns),
  `Strategy` (prefix-merge or per request), `SinkOptions`.
- The trainer bridges (`polar_mitm/bridges/`): TRL's `PolarRollout`, `WeightSync` and
  `polar_reward` (`PolarGRPOTrainer` is `polar_mitm.bridges.trl`'s, as it imports trl), verl's
  `agent_loop_class`; slime is given `polar_mitm.bridges.slime.generate_rollout` by name.
- `run_rollout` (with its `RolloutOptions` and `RolloutResult`, `polar_mitm.rollout.run`): a
  rollout from Python, as `polar-mitm rollout` runs one.

Each name is loaded on first use (PEP 562), so `import polar_mitm` loads none of these modules
and the command line stays light. docs/python-api.md shows each in use.
"""

from __future__ import annotations

import importlib
from typing import Any

# Every public name and the module it lives in: the one table `__all__`, `__getattr__` and
# `__dir__` read.
PUBLIC: dict[str, str] = {
    "RolloutClient": "polar_mitm.client",
    "AsyncRolloutClient": "polar_mitm.client",
    "Group": "polar_mitm.client",
    "Sample": "polar_mitm.client",
    "RolloutError": "polar_mitm.client",
    "TaskRequest": "polar_mitm.api",
    "Submitted": "polar_mitm.api",
    "TaskView": "polar_mitm.api",
    "SampleView": "polar_mitm.api",
    "Event": "polar_mitm.api",
    "Task": "polar_mitm.tasks.model",
    "TaskStep": "polar_mitm.tasks.model",
    "Upload": "polar_mitm.tasks.model",
    "EvaluatorSpec": "polar_mitm.tasks.model",
    "TaskFileError": "polar_mitm.tasks.model",
    "load_tasks": "polar_mitm.tasks",
    "export": "polar_mitm.reconstruct.export",
    "iter_trajectories": "polar_mitm.reconstruct.export",
    "SinkOptions": "polar_mitm.reconstruct.export",
    "Selection": "polar_mitm.reconstruct.source",
    "Trajectory": "polar_mitm.reconstruct.trajectory",
    "Strategy": "polar_mitm.strategies",
    "PolarRollout": "polar_mitm.bridges.trl",
    "WeightSync": "polar_mitm.bridges.trl",
    "polar_reward": "polar_mitm.bridges.trl",
    "agent_loop_class": "polar_mitm.bridges.verl",
    "run_rollout": "polar_mitm.rollout.run",
    "RolloutOptions": "polar_mitm.rollout.run",
    "RolloutResult": "polar_mitm.rollout.run",
}


__all__ = list(PUBLIC)


def __getattr__(name: str) -> Any:  # `from polar_mitm import RolloutClient`
    if name not in __all__:
        raise AttributeError(f"module 'polar_mitm' has no attribute {name!r}")
    value = getattr(importlib.import_module(PUBLIC[name]), name)
    globals()[name] = value  # loaded once
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
