"""What runs for a sample (`SampleSpec`), resolved once where its task enters: the rollout command
(`run_rollout`) for all its samples, a node for each lease (`Specs`). The pipeline is given it and
never resolves a harness itself."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Sequence
from dataclasses import dataclass

from polar_mitm import recipes
from polar_mitm.harness.install import HarnessNotInstalled, harness_mount
from polar_mitm.once import Flights
from polar_mitm.recipes import Recipe
from polar_mitm.sandbox.base import HarnessMount, Runtime
from polar_mitm.tasks.model import Task


@dataclass(frozen=True, eq=False)
class SampleSpec:
    """What runs for a sample: the harness's recipe (which also tags the session's side calls),
    its command (None: the recipe's headless one), the runtime, and the host's installation of the
    harness that a container mounts."""

    recipe: Recipe
    harness_cmd: list[str] | None
    runtime: Runtime
    mount: HarnessMount | None

    def command(self, instruction: str) -> list[str]:
        return self.recipe.headless_command(instruction, self.harness_cmd)

    def check(self, task: Task) -> None:
        """ValueError when `task` cannot run so (before anything of it is recorded)."""
        if not self.runtime.isolated and task.evaluator.kind in ("harbor", "swebench"):
            raise ValueError(
                f"task {task.id}: its {task.evaluator.kind} evaluator works on absolute paths "
                f"(/tests, /logs, {task.workdir}) and needs a container: use --runtime docker or apptainer"
            )
        self.command(task.instruction)  # raises when unusable


class Specs:
    """Resolves specs once per (harness, command, runtime): the recipe loaded (KeyError when
    unknown), the runtime checked once (`Runtime.check`), the host's installation of the harness
    found for containers. Single-flight: samples that arrive together wait for the one resolution,
    and the file reads happen off the event loop."""

    def __init__(self) -> None:
        self._specs: dict[tuple[str, tuple[str, ...], int], SampleSpec] = {}
        self._resolving = Flights(self._specs)
        self._checked: list[Runtime] = []  # kept, so their ids stay theirs

    async def get(self, harness: str, harness_cmd: Sequence[str] | None, runtime: Runtime) -> SampleSpec:
        key = (harness, tuple(harness_cmd or ()), id(runtime))
        return await self._resolving.get(key, lambda: self._resolve(harness, harness_cmd, runtime))

    async def _resolve(self, harness: str, harness_cmd: Sequence[str] | None, runtime: Runtime) -> SampleSpec:
        recipe = await asyncio.to_thread(recipes.get, harness)
        if all(r is not runtime for r in self._checked):
            await runtime.check()
            if all(r is not runtime for r in self._checked):  # another harness's resolution meanwhile
                self._checked.append(runtime)
        cmd = list(harness_cmd) if harness_cmd else None
        mount = await asyncio.to_thread(_harness_mount, recipe, cmd) if runtime.isolated else None
        return SampleSpec(recipe, cmd, runtime, mount)


def _harness_mount(recipe: Recipe, cmd: list[str] | None) -> HarnessMount | None:
    """The host's installation of the harness, for containers. A --harness-cmd that runs
    something else (a script in the image) needs none."""
    if cmd and os.path.basename(cmd[0]) not in recipe.binaries:
        try:
            return harness_mount(recipe)
        except HarnessNotInstalled:
            return None
    return harness_mount(recipe, os.path.basename(cmd[0]) if cmd else None)
