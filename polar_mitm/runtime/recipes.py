"""Recipes: one TOML file per harness in polar_mitm/recipes/ — the binaries it matches, its
environment, the hosts it calls, and its known side calls (tagged in the store)."""

from __future__ import annotations

import os
import tomllib
from functools import cache
from importlib import resources
from pathlib import Path

from pydantic import BaseModel, Field

from polar_mitm.neutral import ChatRequest


class SideCall(BaseModel):
    tag: str
    system_contains: str | None = None
    user_contains: str | None = None
    path_contains: str | None = None
    has_schema: bool | None = None

    def matches(self, req: ChatRequest, path: str) -> bool:
        checks = []
        if self.system_contains is not None:
            system = "\n".join(m.content for m in req.messages if m.role == "system")
            checks.append(self.system_contains in system)
        if self.user_contains is not None:
            users = [m.content for m in req.messages if m.role == "user"]
            checks.append(bool(users) and self.user_contains in users[-1])
        if self.path_contains is not None:
            checks.append(self.path_contains in path)
        if self.has_schema is not None:
            checks.append((req.sampling.json_schema is not None) == self.has_schema)
        return bool(checks) and all(checks)


class CAEnv(BaseModel):
    cert_env: list[str] = Field(default_factory=list)
    bundle_env: list[str] = Field(default_factory=list)


class Recipe(BaseModel):
    name: str
    description: str = ""
    npm: str | None = None
    binaries: list[str] = Field(default_factory=list)
    status: str = "planned"
    example: str | None = None
    hosts: dict[str, str] = Field(default_factory=dict)  # host -> API style
    stub_hosts: list[str] = Field(default_factory=list)
    ca: CAEnv = Field(default_factory=CAEnv)
    env: dict[str, str] = Field(default_factory=dict)
    env_default: dict[str, str] = Field(default_factory=dict)
    # Variables the harness reads credentials from; when any is set, no dummy credential is added.
    credential_env: list[str] = Field(default_factory=list)
    side_calls: list[SideCall] = Field(default_factory=list)
    # The headless command a rollout runs, one argument per item; "{instruction}" inside an item is
    # replaced by the task's instruction (as one argument, never through a shell).
    headless: list[str] = Field(default_factory=list)

    def headless_command(self, instruction: str, template: list[str] | None = None) -> list[str]:
        """The command that runs this harness on `instruction` (`template` overrides the recipe's)."""
        argv = template or self.headless
        if not argv:
            raise ValueError(
                f"recipe {self.name!r} has no headless command; pass --harness-cmd "
                "(e.g. --harness-cmd 'mytool --prompt {instruction}')"
            )
        if not any("{instruction}" in a for a in argv):
            raise ValueError(f"the harness command {argv!r} has no {{instruction}} placeholder")
        return [a.replace("{instruction}", instruction) for a in argv]

    def tag(self, req: ChatRequest, path: str) -> str | None:
        for sc in self.side_calls:
            if sc.matches(req, path):
                return sc.tag
        return None


@cache
def all_recipes() -> dict[str, Recipe]:
    out: dict[str, Recipe] = {}
    for f in sorted(resources.files("polar_mitm.recipes").iterdir(), key=lambda p: p.name):
        if f.name.endswith(".toml"):
            r = Recipe.model_validate(tomllib.loads(f.read_text()))
            out[r.name] = r
    return out


def get(name: str) -> Recipe:
    recipes = all_recipes()
    if name not in recipes:
        raise KeyError(f"unknown recipe {name!r}; known: {', '.join(sorted(recipes))}")
    return recipes[name]


def for_command(cmd: list[str]) -> Recipe:
    """The recipe whose binaries match the command (looking past wrappers like env or npx)."""
    recipes = all_recipes()
    for arg in cmd:
        base = os.path.basename(arg)
        for r in recipes.values():
            if base in r.binaries:
                return r
    return recipes["generic"]


def provider_hosts() -> dict[str, str]:
    hosts: dict[str, str] = {}
    for r in all_recipes().values():
        hosts.update(r.hosts)
    return hosts


def stub_hosts() -> set[str]:
    out: set[str] = set()
    for r in all_recipes().values():
        out.update(r.stub_hosts)
    return out


def recipe_path(name: str) -> Path:
    return Path(str(resources.files("polar_mitm.recipes") / f"{name}.toml"))
