"""The rollout server's HTTP plumbing: who a bearer is and what it may call, bodies bounded
before they are read whole (size) and parsed (depth), and errors in one JSON shape.

Only the operator drives the server (`auth.py`): every route but `/health` takes the control
token; a node's credential registers, and the key a registration returns serves that node id
alone. Nothing here knows a route's meaning: the route table (`server.py`) says who may call each.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any, Literal

from aiohttp import web
from pydantic import BaseModel, ValidationError

from polar_mitm import api as m
from polar_mitm import auth, jsontext
from polar_mitm.providers import fields

log = logging.getLogger("polar_mitm.service")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
# Who may call a route: anyone, the operator, a node joining, or the node the path names;
# "polar": the operator, also by the header Polar's clients send (`service/polar.py`).
Who = Literal["public", "operator", "register", "node", "polar"]
POLAR_TOKEN_HEADER = "x-polar-control-token"
OPERATOR, ENROLL = "operator", "enroll"
PRINCIPAL = web.RequestKey("principal", str)  # who the request's bearer is (set by Guard)
MB = 1024 * 1024
# Bodies larger than this are parsed in a worker thread, so the loop goes on with other requests.
PARSE_INLINE = 256 * 1024
TOKEN_HINT = (
    "a control token is required: Authorization: Bearer TOKEN (serve writes it to"
    f" {auth.default_token_file()} unless given one; clients read it there, or from {auth.TOKEN_ENV})"
)


class ApiError(Exception):
    def __init__(self, status: int, kind: str, message: str, **extra: Any):
        self.status, self.kind, self.message, self.extra = status, kind, message, extra


def error_body(kind: str, message: str, **extra: Any) -> dict[str, Any]:
    return {"error": {"type": kind, "message": message, **extra}}


def validation_error(e: ValidationError) -> ApiError:
    fields = [
        {"field": ".".join(str(p) for p in err["loc"]) or "(body)", "message": err["msg"]}
        for err in e.errors()
    ]
    summary = "; ".join(f"{f['field']}: {f['message']}" for f in fields)
    return ApiError(422, "invalid_request", summary, fields=fields)


def forbid(field: str, message: str) -> ApiError:
    """A 403 that names the field the server has off."""
    return ApiError(403, "forbidden", f"{field}: {message}", fields=[{"field": field, "message": message}])


def _too_large(cap: int) -> ApiError:
    return ApiError(
        413, "too_large", f"the body is larger than {cap / MB:g} MB; serve --max-body-mb sets the limit"
    )


async def read_capped(request: web.Request, cap: int) -> bytes:
    """The body, refused as soon as it is known to be larger than `cap`: by its Content-Length
    before a byte is read, or as the streamed bytes pass it."""
    if request.content_length is not None and request.content_length > cap:
        raise _too_large(cap)
    buf = bytearray()
    async for chunk in request.content.iter_any():
        buf += chunk
        if len(buf) > cap:
            raise _too_large(cap)
    return bytes(buf)


def parse_body(raw: bytes, model: type[BaseModel]) -> Any:
    """JSON no deeper than the providers' bound (`providers/fields.py`), then the model."""
    depth = fields.nesting_depth(raw)
    if depth > fields.MAX_DEPTH:
        message = f"request body: JSON nested {depth} levels deep; at most {fields.MAX_DEPTH} are accepted"
        raise ApiError(422, "invalid_request", message, fields=[{"field": "(body)", "message": message}])
    try:
        data = fields.loads(raw)
    except fields.InvalidRequest as e:
        raise ApiError(400, "invalid_json", f"the body is not JSON: {e.message}") from None
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise validation_error(e) from None


async def body_of(request: web.Request, model: type[BaseModel], cap: int) -> Any:
    raw = await read_capped(request, cap)
    if len(raw) > PARSE_INLINE:
        return await asyncio.to_thread(parse_body, raw, model)
    return parse_body(raw, model)


def json_body(data: Any, status: int = 200) -> web.Response:
    """A JSON answer written by orjson: a group's rows (millions of token ids) in milliseconds
    where `json` takes tenths of a second; `json` writes what orjson does not (huge integers)."""
    return web.Response(body=jsontext.dumps(data), status=status, content_type="application/json")


@web.middleware
async def errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """An ApiError becomes its JSON error; anything unexpected a 500 and one log line."""
    try:
        return await handler(request)
    except ApiError as e:
        resp = web.json_response(error_body(e.kind, e.message, **e.extra), status=e.status)
        if e.status == 413:  # the rest of the body is not read: this connection is done
            resp.force_close()
        return resp
    except web.HTTPException:
        raise
    except Exception as e:  # last resort: a JSON error, one log line
        log.exception("%s %s failed", request.method, request.path)
        return web.json_response(error_body("internal_error", f"{e.__class__.__name__}: {e}"), status=500)


class Guard:
    """Who a request's bearer is, and whether that one may call the route: the middleware that
    stands before every handler."""

    def __init__(self, token: str, node_token: str, node_for_key: Callable[[str], str | None]):
        """`node_for_key`: the node id a registered node's key digest names (the store's)."""
        self.token = token
        self.node_token = node_token
        self.node_for_key = node_for_key
        self.who: dict[tuple[str, str], Who] = {}

    def principal(self, request: web.Request) -> str | None:
        """Who the bearer is: the operator, a node joining (the node credential), `node:ID`
        (a registered node's key), or None."""
        given = request.headers.get("authorization", "")
        if not given.startswith("Bearer "):
            return None
        token = given[7:].strip()
        if auth.same(token, self.token):
            return OPERATOR
        if auth.same(token, self.node_token):
            return ENROLL
        node = self.node_for_key(auth.digest(token)) if token else None
        return f"node:{node}" if node else None

    @web.middleware
    async def middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        resource = request.match_info.route.resource
        who = self.who.get((request.method, resource.canonical if resource else ""), "operator")
        if who == "public":
            return await handler(request)
        principal = self.principal(request)
        if (
            principal is None
            and who == "polar"
            and auth.same(request.headers.get(POLAR_TOKEN_HEADER), self.token)
        ):
            principal = OPERATOR
        if principal is None:
            raise ApiError(401, "unauthorized", TOKEN_HINT)
        node_id = request.match_info.get("node_id")
        if node_id is not None and not m.TASK_ID.fullmatch(node_id):
            raise ApiError(422, "invalid_request", f"node_id: {node_id[:80]!r} is not a node id",
                           fields=[{"field": "node_id", "message": "not a node id"}])  # fmt: skip
        allowed = (
            principal == OPERATOR
            or (who == "register" and (principal == ENROLL or principal.startswith("node:")))
            or (who == "node" and principal == f"node:{node_id}")
        )
        if not allowed:
            if principal == ENROLL:
                said = "the node credential only registers a node; its heartbeats, leases and results take the key registration returned"
            else:
                mine = principal.removeprefix("node:")
                said = f"node {mine}'s key only heartbeats, leases and reports for node {mine}"
            raise ApiError(
                403, "forbidden", f"{said}: {request.method} {request.path} needs the control token"
            )
        request[PRINCIPAL] = principal
        return await handler(request)
