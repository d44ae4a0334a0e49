"""A bounded cache of turns' full token sequences, which resolving prompt references reads."""

from __future__ import annotations

from array import array
from collections import OrderedDict


class SequenceCache:
    """Full sequences (prompt + output) of recent turns, bounded by total tokens.

    `compact` keeps them as int32 arrays (4 B a token instead of ~36 B for a list of Python ints),
    for the long-lived proxy; the offline reader keeps lists, which it slices on every turn. A
    compact cache keeps its newest sequences (up to `hot_tokens`) as the lists they came as, since
    the next turn of a conversation asks for them again: converting 30k ids to an array and back
    every turn cost more than the rest of the store's work. The hot tier is least recently used
    out first, and a compact sequence asked for again is hot again (a turn retried many times
    splices onto the same sequence every time). Callers must not change what they get.

    A compact cache also keeps a turn whose whole sequence begins the next turn's (`put`'s
    `parent`: the usual turn of a growing conversation) as a view, the next turn's id and a
    length, instead of as a sequence of its own: a conversation then holds one sequence, not one
    per turn, and the hot tier holds conversations rather than turns. A view is read back as a
    slice of what it points to, for the rare request that goes back to an earlier turn.
    """

    MAX_VIEWS = 1_000_000

    def __init__(self, max_tokens: int = 8_000_000, *, compact: bool = False, hot_tokens: int = 1_000_000):
        self.max_tokens = max_tokens
        self.compact = compact
        self.size = 0
        self.items: OrderedDict[str, tuple[list[int] | array, int]] = OrderedDict()
        self.hot_tokens = hot_tokens if compact else 0
        self.hot_size = 0
        self.hot: OrderedDict[str, tuple[list[int], int]] = OrderedDict()
        # turn id -> (id of the turn whose sequence begins with this one's, its length, prompt length)
        self.views: OrderedDict[str, tuple[str, int, int]] = OrderedDict()
        # turn id -> (id of a hot turn whose first `length` ids begin this one's, length, the rest,
        # prompt length): a turn retried, each answer a branch from the same point
        self.branches: OrderedDict[str, tuple[str, int, list[int], int]] = OrderedDict()
        self.branch_size = 0

    def get(self, turn_id: str) -> tuple[list[int], int] | None:
        warm = self.hot.get(turn_id)
        if warm is not None:
            self.hot.move_to_end(turn_id)  # the least recently asked for leaves the hot tier first
            return warm
        hit = self.items.get(turn_id)
        if hit is not None:
            seq, prompt_len = hit
            if self.hot_tokens and isinstance(seq, array):
                # Asked for again (a turn retried, its conversation's sequence the point every
                # retry splices onto): hot again, so the next ask does not convert it back.
                ids = seq.tolist()
                del self.items[turn_id]
                self.size -= len(seq)
                self._hot(turn_id, ids, prompt_len)
                return ids, prompt_len
            self.items.move_to_end(turn_id)
            return (seq.tolist() if isinstance(seq, array) else seq), prompt_len
        view = self.views.get(turn_id)
        if view is None:
            return self._branch_get(turn_id)
        child_id, length, prompt_len = view
        child = self.get(child_id)
        if child is None or len(child[0]) < length:  # what it pointed to is gone
            del self.views[turn_id]
            return None
        return child[0][:length], prompt_len

    def _branch_get(self, turn_id: str) -> tuple[list[int], int] | None:
        branch = self.branches.get(turn_id)
        if branch is None:
            return None
        base_id, length, rest, prompt_len = branch
        base = self.get(base_id)
        if base is None or len(base[0]) < length:  # what it branched from is gone
            del self.branches[turn_id]
            self.branch_size -= len(rest)
            return None
        return base[0][:length] + rest, prompt_len

    def clear(self) -> None:
        self.items.clear()
        self.hot.clear()
        self.views.clear()
        self.branches.clear()
        self.size = self.hot_size = self.branch_size = 0

    def put(
        self, turn_id: str, seq: list[int], prompt_len: int, parent: tuple[str, int] | None = None
    ) -> None:
        """Keep `seq`; with `parent` (a turn, and how many of its ids begin `seq`), that turn
        becomes a view of this one when all of its sequence is `seq`'s beginning; when the parent
        is a view already (this is another answer to the same prompt), `seq` is kept as a branch:
        what it shares with the sequence the parent is a view of, and the rest."""
        if turn_id in self.items or turn_id in self.hot or turn_id in self.views or turn_id in self.branches:
            return
        if self.hot_tokens:
            if parent is not None and not self._fold(parent[0], parent[1], turn_id, seq):
                if self._branch(parent[0], parent[1], turn_id, seq, prompt_len):
                    return
            self._hot(turn_id, seq, prompt_len)
            return
        self._keep(turn_id, seq, prompt_len)

    def _hot(self, turn_id: str, seq: list[int], prompt_len: int) -> None:
        self.hot[turn_id] = (seq, prompt_len)
        self.hot_size += len(seq)
        while self.hot_size > self.hot_tokens and len(self.hot) > 1:
            old_id, (old, old_len) = self.hot.popitem(last=False)
            self.hot_size -= len(old)
            self._keep(old_id, old, old_len)

    def _fold(self, parent: str, spliced: int, child: str, seq: list[int]) -> bool:
        held = self.hot.get(parent)
        if held is None:
            return False
        old, old_len = held
        n = len(old)
        # All of the parent's sequence must begin the child's: the prompt was spliced from all of
        # it. Its first and last ids are compared too, as a check on what the caller says.
        start = max(n - 16, 0)
        if not n or spliced != n or n > len(seq) or seq[start:n] != old[start:] or seq[0] != old[0]:
            return False
        del self.hot[parent]
        self.hot_size -= n
        self.views[parent] = (child, n, old_len)
        if len(self.views) > self.MAX_VIEWS:
            self.views.popitem(last=False)
        return True

    def _branch(self, parent: str, spliced: int, turn_id: str, seq: list[int], prompt_len: int) -> bool:
        view = self.views.get(parent)
        if view is None:
            return False
        base_id, n, _ = view
        base = self.hot.get(base_id)
        if base is None or spliced != n or not n or n >= len(seq) or len(base[0]) < n:
            return False
        held = base[0]
        start = max(n - 16, 0)  # checked as `_fold` checks
        if seq[start:n] != held[start:n] or seq[0] != held[0]:
            return False
        rest = seq[n:]
        self.branches[turn_id] = (base_id, n, rest, prompt_len)
        self.branch_size += len(rest)
        while self.branch_size > self.hot_tokens or len(self.branches) > self.MAX_VIEWS:
            _, (_, _, old, _) = self.branches.popitem(last=False)
            self.branch_size -= len(old)
        return True

    def _keep(self, turn_id: str, seq: list[int], prompt_len: int) -> None:
        self.items[turn_id] = (array("i", seq) if self.compact else seq, prompt_len)
        self.size += len(seq)
        while self.size > self.max_tokens and len(self.items) > 1:
            _, (old, _) = self.items.popitem(last=False)
            self.size -= len(old)
