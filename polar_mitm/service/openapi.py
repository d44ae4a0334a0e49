"""`GET /openapi.json`, built from the server's route table and the pydantic models it names."""

from __future__ import annotations

import re
from typing import Any, get_args, get_origin

from pydantic import BaseModel, TypeAdapter


def _schema(tp: Any, defs: dict[str, Any]) -> dict[str, Any]:
    schema = TypeAdapter(tp).json_schema(ref_template="#/components/schemas/{model}")
    defs.update(schema.pop("$defs", {}))
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        defs[tp.__name__] = schema
        return {"$ref": f"#/components/schemas/{tp.__name__}"}
    return schema


def openapi(routes: list[tuple]) -> dict[str, Any]:
    defs: dict[str, Any] = {}
    paths: dict[str, dict[str, Any]] = {}
    for method, path, handler, req_model, resp_model, summary, *_ in routes:
        op: dict[str, Any] = {"summary": summary, "operationId": handler.__name__}
        params = re.findall(r"{(\w+)}", path)
        if params:
            op["parameters"] = [
                {"name": p, "in": "path", "required": True, "schema": {"type": "string"}} for p in params
            ]
        if req_model is not None:
            op["requestBody"] = {
                "required": True,
                "content": {"application/json": {"schema": _schema(req_model, defs)}},
            }
        ok = "202" if method == "POST" and path == "/v1/tasks" else "200"
        response: dict[str, Any] = {"description": "OK"}
        if resp_model is not None and (isinstance(resp_model, type) or get_origin(resp_model) is list):
            if get_origin(resp_model) is list:
                response["content"] = {
                    "application/json": {
                        "schema": {"type": "array", "items": _schema(get_args(resp_model)[0], defs)}
                    }
                }
            else:
                response["content"] = {"application/json": {"schema": _schema(resp_model, defs)}}
        op["responses"] = {
            ok: response,
            "401": {"description": "control token missing or wrong"},
            "403": {"description": "this credential may not do this (a node's), or the server has it off"},
            "413": {"description": "the body is larger than the server's cap"},
            "422": {"description": "invalid request: the fields named"},
        }
        paths.setdefault(path, {})[method.lower()] = op
    return {
        "openapi": "3.1.0",
        "info": {"title": "polar-mitm rollout service", "version": "1"},
        "components": {
            "schemas": defs,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
        "security": [{"bearer": []}],
        "paths": paths,
    }
