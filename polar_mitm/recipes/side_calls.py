"""Side calls: the rules that tell a harness's side calls (a title, a topic check, a commit
message) from its main loop's turns, in one place.

A recipe's `side_calls` rules (`SideCall`) tag a call by its text and its shape. Which recipe's
rules apply belongs to the session: the recipe a rollout's sample or a node's lease carries
(`Tagger.assign`, through the pipeline's port), else the proxy's (`run`'s choice, or every
recipe's). An untagged call shaped like a side call is flagged as it arrives (`Tagger.signs`), and,
under the generic recipe, judged again over the whole session once it ended (`session_suspects`:
`stats` and `export` warn of them), since a session's first call may be its title.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Mapping, Sequence
from functools import cached_property
from typing import TYPE_CHECKING

from pydantic import BaseModel

from polar_mitm.neutral import ChatRequest

if TYPE_CHECKING:
    from polar_mitm.recipes import Recipe

# Recent system prompts -> {rule text: whether the prompt contains it}. Shared by every proxy of
# the process and harmless so: each entry is keyed by the whole prompt text and holds only what
# `needle in prompt` answers, which no proxy, session or recipe can change.
_system_found: OrderedDict[str, dict[str, bool]] = OrderedDict()


class CallText:
    """What side-call rules read of one request, taken out once for all the rules.

    Whether a system prompt contains a rule's text is remembered per system prompt (a few recent
    ones): a harness sends the same long prompt every turn, and searching 100 KB once per rule
    and turn cost more than the rest of tagging."""

    def __init__(self, req: ChatRequest):
        self.req = req

    @cached_property
    def system(self) -> str:
        return "\n".join(m.content for m in self.req.messages if m.role == "system")

    @cached_property
    def last_user(self) -> str | None:
        users = [m.content for m in self.req.messages if m.role == "user"]
        return users[-1] if users else None

    @cached_property
    def _found(self) -> dict[str, bool]:
        """What is known of this system prompt, looked up once per request: each lookup of a new
        request's prompt compares its whole text with the one remembered."""
        found = _system_found.get(self.system)
        if found is None:
            found = _system_found[self.system] = {}
            if len(_system_found) > 32:
                _system_found.popitem(last=False)
        else:
            _system_found.move_to_end(self.system)
        return found

    def system_contains(self, needle: str) -> bool:
        found = self._found
        hit = found.get(needle)
        if hit is None:
            hit = found[needle] = needle in self.system
        return hit


class SideCall(BaseModel):
    """One rule: every condition given must hold (at least one must be given)."""

    tag: str
    system_contains: str | None = None
    user_contains: str | None = None
    path_contains: str | None = None
    has_schema: bool | None = None  # a structured-output schema (output_format, json_schema)
    has_tools: bool | None = None  # whether the request offers the model any tool
    max_tokens_at_most: int | None = None

    def matches(self, req: ChatRequest, path: str, text: CallText | None = None) -> bool:
        """Every condition given holds (the cheap ones asked first; the first that fails ends it),
        and one at least is given."""
        given = False
        if self.has_tools is not None:
            if bool(req.tools) != self.has_tools:
                return False
            given = True
        if self.max_tokens_at_most is not None:
            limit = req.sampling.max_tokens
            if limit is None or limit > self.max_tokens_at_most:
                return False
            given = True
        if self.has_schema is not None:
            if (req.sampling.json_schema is not None) != self.has_schema:
                return False
            given = True
        if self.path_contains is not None:
            if self.path_contains not in path:
                return False
            given = True
        text = text or CallText(req)
        if self.user_contains is not None:
            last = text.last_user
            if last is None or self.user_contains not in last:
                return False
            given = True
        if self.system_contains is not None:
            if not text.system_contains(self.system_contains):
                return False
            given = True
        return given


class MainShape(BaseModel):
    """How a session's main calls look (its first untagged call that offers tools)."""

    model: str
    max_tokens: int | None


# A max_tokens this small leaves no room for an agent's turn (a title, a yes/no answer).
SMALL_MAX_TOKENS = 1024


def side_call_signs(req: ChatRequest, main: MainShape | None) -> list[str]:
    """What makes a request look like a side call rather than a turn of the main loop, compared
    with the session's main calls (`main`, None while none was seen). Pure."""
    signs = []
    if req.sampling.json_schema is not None:
        signs.append("a structured-output schema")
    limit = req.sampling.max_tokens
    if limit is not None and limit <= SMALL_MAX_TOKENS and (main is None or (main.max_tokens or 0) > limit):
        signs.append(f"max_tokens {limit}")
    if main is not None and not req.tools:
        signs.append("no tools (the session's main calls offer them)")
    if main is not None and req.model and req.model != main.model:
        signs.append(f"model {req.model!r} (the session's main calls ask for {main.model!r})")
    return signs


class Tagger:
    """Tags a request's side calls by the rules of its session's recipe: the one the session was
    issued with (`assign`: a rollout's sample, a node's), else the proxy's (`run`'s choice; every
    recipe's with None). Under the generic recipe, also those of a recipe the request itself shows
    it comes from (`Recognize`). `signs` says what makes an untagged call look like a side call."""

    SESSIONS = 10_000  # sessions whose main shape is remembered

    def __init__(self, recipe: str | None):
        from polar_mitm.recipes import get

        self.recipe = recipe
        self._rules: dict[str | None, list[Recipe]] = {recipe: self._load(recipe)}
        if recipe is not None:
            get(recipe)  # an unknown name fails here, where the proxy is made
        self._by_session: dict[str, str] = {}
        self._main: OrderedDict[str, MainShape] = OrderedDict()

    @staticmethod
    def _load(recipe: str | None) -> list[Recipe]:
        from polar_mitm.recipes import all_recipes, get

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
        from polar_mitm.recipes import all_recipes

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


def looks_like_side_call(signs: list[str]) -> bool:
    """Two signs at least: one alone (a main call without tools, a schema) is common enough in a
    main loop."""
    return len(signs) >= 2


def session_main_shape(calls: Sequence[ChatRequest]) -> MainShape | None:
    """A whole session's main shape: the model and max_tokens most of its calls that offer tools
    ask for (not only the first such call, which may be a side call of its own)."""
    shapes = Counter((c.model, c.sampling.max_tokens) for c in calls if c.tools)
    if not shapes:
        return None
    (model, max_tokens), _ = shapes.most_common(1)[0]
    return MainShape(model=model, max_tokens=max_tokens)


def session_suspects(calls: Sequence[ChatRequest]) -> list[tuple[int, list[str]]]:
    """Of a whole session's untagged calls, in order: (index, signs) of each that looks like a side
    call against the session's main shape, judged after the session ended (a title call that came
    first, before any main call, is judged too). Pure."""
    main = session_main_shape(calls)
    out = []
    for i, req in enumerate(calls):
        signs = side_call_signs(req, main)
        if main is not None and req.tools and req.model == main.model:
            continue  # shaped like the main loop's calls
        if looks_like_side_call(signs):
            out.append((i, signs))
    return out
