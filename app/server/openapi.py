"""``GET /openapi.json``: the API's description, generated from the route table and the typed models the server
validates bodies with (never written by hand): a route added later is described at once, with a body of its own
model where one validates it, else any JSON object. What API fuzzers (Schemathesis, ``tests/test_api_fuzz.py``) and
client generators read. Behind the API key like every route but the open list. Torch-free."""

from __future__ import annotations

import re
from typing import Any

from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from app.server.browser_guard import MULTIPART_PATHS
from app.wire.anthropic.request import MessagesBody
from app.wire.openai.chat import ChatBody
from app.wire.openai.completions import CompletionBody
from app.wire.openai.embeddings import EmbeddingsBody
from app.wire.openai.responses import ResponsesBody

#: The routes whose bodies a typed model validates (the others are read field by field: any JSON object).
BODIES: dict[str, type[BaseModel]] = {
    "/v1/chat/completions": ChatBody,
    "/v1/completions": CompletionBody,
    "/v1/responses": ResponsesBody,
    "/v1/embeddings": EmbeddingsBody,
    "/v1/messages": MessagesBody,
    "/v1/messages/count_tokens": MessagesBody,
}
#: The query parameters of the routes that page (OpenAI's ``limit``, ``after``, ``order``).
QUERIES: dict[str, dict[str, dict[str, Any]]] = {
    "/v1/files": {"purpose": {"type": "string"}, "limit": {"type": "integer"}, "after": {"type": "string"},
                  "order": {"type": "string", "enum": ["asc", "desc"]}},
    "/v1/batches": {"limit": {"type": "integer"}, "after": {"type": "string"}},
    "/v1/responses/{response_id}/input_items": {"limit": {"type": "integer"}, "after": {"type": "string"},
                                                "order": {"type": "string", "enum": ["asc", "desc"]}},
}  # fmt: skip
_UPLOAD = {"multipart/form-data": {"schema": {"type": "object", "required": ["file", "purpose"], "properties": {
    "file": {"type": "string", "format": "binary"}, "purpose": {"type": "string"}}}}}  # fmt: skip
_ERROR = {"description": "an error in the API's envelope", "content": {"application/json": {"schema": {
    "type": "object"}}}}  # fmt: skip


def describe(routes: list[Route]) -> dict[str, Any]:
    """The OpenAPI 3.1 document of ``routes``."""
    paths: dict[str, dict[str, Any]] = {}
    components: dict[str, Any] = {}
    for route in routes:
        path = re.sub(r"\{(\w+)(:\w+)?\}", r"{\1}", route.path)
        for method in sorted((route.methods or set()) - {"HEAD"}):
            paths.setdefault(path, {})[method.lower()] = _operation(path, method, route.name, components)
    return {"openapi": "3.1.0", "info": {"title": "smolserve", "version": "1"}, "paths": paths,
            "components": {"schemas": components}}  # fmt: skip


def _operation(path: str, method: str, name: str, components: dict[str, Any]) -> dict[str, Any]:
    parameters = [{"name": param, "in": "path", "required": True, "schema": {"type": "string"}}
                  for param in re.findall(r"\{(\w+)\}", path)]  # fmt: skip
    if method == "GET":
        parameters += [{"name": key, "in": "query", "required": False, "schema": schema}
                       for key, schema in QUERIES.get(path, {}).items()]  # fmt: skip
    operation: dict[str, Any] = {"operationId": f"{method.lower()} {path} ({name})",
                                 "parameters": parameters,
                                 "responses": {"200": {"description": "the answer"}, "4XX": _ERROR}}  # fmt: skip
    if method in ("POST", "PUT", "PATCH"):
        operation["requestBody"] = {"required": True, "content": _body(path, components)}
    return operation


def _body(path: str, components: dict[str, Any]) -> dict[str, Any]:
    if path in MULTIPART_PATHS:
        return _UPLOAD
    model = BODIES.get(path)
    if model is None:
        return {"application/json": {"schema": {"type": "object"}}}
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
    components.update(schema.pop("$defs", {}))
    components[model.__name__] = schema
    return {"application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}


async def openapi(request: Request) -> Response:
    return JSONResponse(describe([route for route in request.app.routes if isinstance(route, Route)]))
