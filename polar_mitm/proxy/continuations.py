"""Stateful Responses clients: a request that names our earlier response by
`previous_response_id` and sends only what is new.

The store already holds all a continuation needs: each turn's raw request and its completion.
The conversation a response continues is rebuilt from them as a stateless client would have sent
it: the items of the request that produced it (itself perhaps a continuation, followed back to
the first) and the response's output items as we rendered them. Parsed with the new input after
it, the request reads like a stateless client's next one, so the policy finds the earlier turn
and the prompt is that turn's prompt ids + its sampled ids + the new input's rendering.

What each recent response continues is remembered (bounded), so a continuation costs one
turn read from the store; the chain back to the first request is read only after a restart.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from typing import Any

from polar_mitm.neutral import Completion, ProviderError
from polar_mitm.providers import Style
from polar_mitm.providers import openai_responses as responses
from polar_mitm.store.writer import Store


class Continuations:
    ENTRIES = 256  # responses whose conversation is remembered

    def __init__(self, store: Store):
        self.store = store
        # turn id -> (its session, the input items a continuation of its response begins with)
        self._after: OrderedDict[str, tuple[str, list[Any]]] = OrderedDict()

    async def parse_kwargs(self, style: Style, session: str, body: Any) -> dict[str, Any]:
        """What `style.parse_request` needs besides the body: for a Responses request naming a
        previous response, the `history` it continues (a ProviderError where there is none)."""
        if style.NAME != responses.NAME:
            return {}
        prev = responses.previous_response(body)
        if prev is None:
            return {}
        return {"history": await self.history(session, prev)}

    async def history(self, session: str, resp_id: str) -> list[Any]:
        """The input items that the response `resp_id` of `session` continues: a copy."""
        turn_id = responses.turn_of(resp_id)
        if turn_id is None:
            raise responses.previous_not_found(resp_id, "polar-mitm gave no response of that form")
        owner, items = await self._items_after(resp_id, turn_id)
        if owner != session:
            raise responses.previous_not_found(resp_id, "it is not a response of this session")
        return list(items)

    async def _items_after(self, resp_id: str, turn_id: str) -> tuple[str, list[Any]]:
        # Follow the chain back to a turn remembered, or to a request without a predecessor ...
        chain: list[tuple[str, tuple[str, str, str, str | None, str | None]]] = []
        base: list[Any] = []
        cur: str | None = turn_id
        while cur is not None:
            known = self._after.get(cur)
            if known is not None:
                self._after.move_to_end(cur)
                base = known[1]
                break
            row = await self.store.exchange(cur)
            if row is None:
                why = "polar-mitm gave no such response" if cur == turn_id else "its conversation is gone"
                raise responses.previous_not_found(resp_id, why)
            chain.append((cur, row))
            prev = responses.previous_response(_body(row[3]))
            cur = responses.turn_of(prev) if prev is not None else None
        if not chain:
            return self._after[turn_id][0], base
        # ... then fold forward: each request's items after what it continued, then its output.
        for tid, (session, style, status, request, response) in reversed(chain):
            if style != responses.NAME or status != "ok" or response is None:
                what = f"a {style} turn" if style != responses.NAME else f"a turn that ended {status}"
                raise responses.previous_not_found(resp_id, f"{tid} is {what}, not a completed response")
            body = _body(request)
            req = responses.parse_request(body, history=base if "previous_response_id" in body else None)
            output = responses.render_response(Completion.model_validate_json(response), req)["output"]
            base = [*base, *responses.input_items(body), *output]
            self._after[tid] = (session, base)
            if len(self._after) > self.ENTRIES:
                self._after.popitem(last=False)
        return chain[0][1][0], base


def _body(request: str | None) -> dict[str, Any]:
    try:
        body = json.loads(request or "")
    except ValueError:
        body = None
    if not isinstance(body, dict):
        raise ProviderError("api_error", "a stored Responses request is not a JSON object", 500)
    return body
