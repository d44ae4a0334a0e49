"""Recipes: one TOML file per harness in polar_mitm/recipes/ — the binaries it matches, its
environment, the hosts it calls, and its known side calls (tagged in the store).

A side call (a title, a topic check, a commit message) is known by its text and by its shape: no
tools where the harness's main loop offers them, a small max_tokens, a structured-output schema.
Which recipe's rules apply is chosen by the command run, and, for a program the command does not
name (a Python script driving Claude Code through its SDK), by what the request shows of its
sender (`Recognize`). The side-call rules themselves live in `side_calls.py`."""

from __future__ import annotations

import os
import tomllib
from collections import OrderedDict
from collections.abc import Mapping
from importlib import resources
from pathlib import Path

from pydantic import BaseModel, Field, field_validator

from polar_mitm.neutral import ChatRequest
from polar_mitm.once import once
from polar_mitm.recipes.side_calls import (  # noqa: F401 - the side-call rules, named here too
    SMALL_MAX_TOKENS,
    CallText,
    MainShape,
    SideCall,
    looks_like_side_call,
    side_call_signs,
)


class Recognize(BaseModel):
    """What shows that a request comes from this harness whatever program started it (one
    marker is enough): a program driving the harness through its SDK is not named in the
    command, but its requests carry the harness's own user agent and headers."""

    user_agent_contains: list[str] = Field(default_factory=list)
    headers: dict[str, str] = Field(default_factory=dict)  # lowercased name -> exact value
    system_contains: list[str] = Field(default_factory=list)

    def matches(self, headers: Mapping[str, str], text: CallText) -> bool:
        agent = headers.get("user-agent", "")
        return (
            any(m in agent for m in self.user_agent_contains)
            or any(headers.get(k) == v for k, v in self.headers.items())
            or any(text.system_contains(m) for m in self.system_contains)
        )


class CAEnv(BaseModel):
    cert_env: list[str] = Field(default_factory=list)
    bundle_env: list[str] = Field(default_factory=list)


class Recipe(BaseModel):
    name: str
    description: str = ""
    npm: str | None = None
    # An npm prefix of its own under the polar-mitm cache (`POLAR_MITM_CACHE`, default
    # ~/.cache/polar-mitm), where scripts/install.sh puts a harness that needs another Node than
    # the system's, with that Node (OpenClaw: `openclaw`). PATH has a launcher for it, which no
    # container can run: a container gets this prefix's installation and its Node instead.
    npm_prefix: str | None = None
    # The package's own command in that prefix where its launcher has another name (Kimi Code's
    # launcher `kimi-code` runs the prefix's `kimi`, a name Kimi CLI's has too); None: the same.
    npm_prefix_bin: str | None = None
    # The PyPI requirement of a Python harness (each lives in a virtualenv of its own; see
    # harness/install.py for how a container runs it); named in "not installed" messages.
    pypi: str | None = None
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
    # Command-line flags whose value is a credential though their name does not say so (`-k`):
    # their values are left out of the stored command (see redact.argv).
    secret_flags: list[str] = Field(default_factory=list)
    side_calls: list[SideCall] = Field(default_factory=list)
    recognize: Recognize = Field(default_factory=Recognize)
    # The headless command a rollout runs, one argument per item; "{instruction}" inside an item is
    # replaced by the task's instruction (as one argument, never through a shell).
    headless: list[str] = Field(default_factory=list)
    # Files a harness needs in a fresh HOME before it can call a model (its provider settings),
    # path relative to HOME -> content. A rollout writes them into each sample's new HOME; `run`
    # uses the user's own HOME and writes nothing there (docs/harnesses.md shows each file).
    home_files: dict[str, str] = Field(default_factory=dict)

    @field_validator("home_files")
    @classmethod
    def _inside_home(cls, v: dict[str, str]) -> dict[str, str]:
        for rel in v:
            parts = Path(rel).parts
            if not parts or Path(rel).is_absolute() or ".." in parts:
                raise ValueError(f"home file {rel!r} must be a relative path inside HOME")
        return v

    def write_home_files(self, home: Path) -> list[Path]:
        """Create the recipe's home files under `home`, a directory we made; a file already there
        is kept, and no link is followed (the file is created exclusively, with O_NOFOLLOW)."""
        written: list[Path] = []
        for rel, content in self.home_files.items():
            path = home / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            except FileExistsError:
                continue
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(content)
            written.append(path)
        return written

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

    def tag(self, req: ChatRequest, path: str, text: CallText | None = None) -> str | None:
        text = text or CallText(req)
        for sc in self.side_calls:
            if sc.matches(req, path, text):
                return sc.tag
        return None


class Tagger:
    """Tags a request's side calls by the rules of its session's recipe: the one the session was
    issued with (`assign`: a rollout's sample, a node's), else the proxy's (`run`'s choice; every
    recipe's with None). Under the generic recipe, also those of a recipe the request itself shows
    it comes from (`Recognize`). `signs` says what makes an untagged call look like a side call."""

    SESSIONS = 10_000  # sessions whose main shape is remembered

    def __init__(self, recipe: str | None):
        self.recipe = recipe
        # An unknown name fails here, where the proxy is made.
        self._rules: dict[str | None, list[Recipe]] = {recipe: self._load(recipe)}
        self._by_session: dict[str, str] = {}
        self._main: OrderedDict[str, MainShape] = OrderedDict()

    @staticmethod
    def _load(recipe: str | None) -> list[Recipe]:
        return [get(recipe)] if recipe else list(all_recipes().values())

    def assign(self, session: str, recipe: str | None) -> None:
        """`session` is tagged by `recipe`'s rules from now on (None: the proxy's)."""
        if recipe is None:
            self._by_session.pop(session, None)
            return
        if recipe not in self._rules:
            self._rules[recipe] = self._load(recipe)
        self._by_session[session] = recipe

    def forget(self, session: str) -> None:
        """The session ended: its recipe and main shape are dropped."""
        self._by_session.pop(session, None)
        self._main.pop(session, None)

    def recipe_of(self, session: str | None) -> str | None:
        return self._by_session.get(session, self.recipe) if session is not None else self.recipe

    def __call__(
        self,
        req: ChatRequest,
        path: str,
        headers: Mapping[str, str] | None = None,
        session: str | None = None,
    ) -> str | None:
        text = CallText(req)
        name = self.recipe_of(session)
        rules = self._rules[name]
        if name == "generic" and headers is not None:
            lower: dict[str, str] = {}
            for k, v in headers.items():  # a repeated header: every value (a User-Agent sent twice)
                lower[k.lower()] = f"{lower[k.lower()]}, {v}" if k.lower() in lower else v
            rules = [r for r in all_recipes().values() if r.recognize.matches(lower, text)] + rules
        for r in rules:
            if t := r.tag(req, path, text):
                return t
        return None

    def signs(self, req: ChatRequest, session: str) -> list[str]:
        """Of an untagged call of `session`: what makes it look like a side call (empty: it looks
        like a main call). The session's first untagged call offering tools sets its main shape."""
        main = self._main.get(session)
        if main is None and req.tools:
            self._main[session] = MainShape(model=req.model, max_tokens=req.sampling.max_tokens)
            if len(self._main) > self.SESSIONS:
                self._main.popitem(last=False)
            return []
        return side_call_signs(req, main)


@once
def all_recipes() -> dict[str, Recipe]:
    """Every recipe shipped, read once per process (single-flight: `polar_mitm.once`)."""
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
