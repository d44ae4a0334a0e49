"""Side calls: the rules that tell a harness's side calls (a title, a topic check, a commit
message) from its main loop's turns, in one place.

A recipe's `side_calls` rules (`SideCall`) tag a call by its text and its shape. Which recipe's
rules apply belongs to the session (`recipes.Tagger`): the recipe a rollout's sample or a node's
lease carries (`Tagger.assign`, through the pipeline's port), else the proxy's (`run`'s choice, or
every recipe's). An untagged call shaped like a side call is flagged as it arrives (`Tagger.signs`), and,
under the generic recipe, judged again over the whole session once it ended (`session_suspects`:
`stats` and `export` warn of them), since a session's first call may be its title.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Sequence
from functools import cached_property

from pydantic import BaseModel

from polar_mitm.neutral import ChatRequest

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
