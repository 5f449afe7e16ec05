"""Ollama's model store, where it has a local meaning: ``/api/create`` and ``/api/copy`` make a model that answers
with a served one under its own default options, system prompt and opening messages (``app/stores/model_aliases.py``);
``/api/delete`` removes one; ``/api/chat``, ``/api/generate``, ``/api/show`` and ``/api/tags`` know them
(``aliased``), as does ``/v1/chat/completions`` (``as_chat_completions``). A served model's file is never copied,
changed or deleted; ``/api/push`` is a 400 (no registry). Torch-free."""

from __future__ import annotations

import json
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from app.server.state import ServerState, server_state
from app.stores.model_aliases import Alias, AliasFull
from app.wire.ollama import request as wire
from app.wire.ollama.create import copied, creation
from app.wire.openai.errors import APIError, bad_request

#: What Ollama's create stream says before ``success`` (nothing is downloaded or written but the alias).
_CREATED = ("using existing layer", "creating new layer", "writing manifest", "success")


def served_names(state: ServerState) -> set[str]:
    return {name for entry in state.pool.entries for name in entry.names}


def aliased(state: ServerState, body: dict[str, Any], generate: bool) -> dict[str, Any]:
    """A body naming a made model, as the body of the served model it answers with: its options under the body's
    own, its system prompt where the body gives none, its opening messages first (``/api/chat``); a body naming any
    other model as it is."""
    alias = state.aliases.get(wire.model_name(body))
    if alias is None:
        return body
    given = body.get("options")
    if given is not None and not isinstance(given, dict):
        raise bad_request("options must be an object", "options")
    out = {**body, "model": alias.target, "options": {**alias.parameters, **(given or {})}}
    if generate:
        out["system"] = body.get("system") or alias.system
        return out
    messages = body.get("messages") if isinstance(body.get("messages"), list) else []
    has_system = any(isinstance(message, dict) and message.get("role") == "system" for message in messages)
    opening = [{"role": "system", "content": alias.system}] if alias.system and not has_system else []
    out["messages"] = [*opening, *alias.messages, *messages]
    return out


def as_chat_completions(state: ServerState, body: dict[str, Any]) -> tuple[dict[str, Any], str | None]:
    """A ``/v1/chat/completions`` body naming a made model, as Ollama serves it there too: the served model's body
    with the made model's options (as chat completions' fields) where the body sets none, its system prompt where
    the body has none, its opening messages first; and the made model's name to answer under (None: not one)."""
    name = body.get("model")
    alias = state.aliases.get(name.removesuffix(":latest")) if isinstance(name, str) and name else None
    if alias is None or not isinstance(body.get("messages"), list):
        return body, None
    sampling = wire.options({k: v for k, v in alias.parameters.items() if k != "num_ctx"}, 1 << 62)
    ollama = aliased(state, {"model": name, "messages": body["messages"]}, generate=False)
    return {**sampling, **body, "model": alias.target, "messages": ollama["messages"]}, name


async def create(request: Request) -> Response:
    state = server_state(request)
    body = state.parse_body(await request.body())
    made = creation(body)
    _check_name(state, made.name)
    base = _base(state, made.target)
    alias = Alias(made.name, base.target, {**base.parameters, **made.parameters}, made.system or base.system,
                  [*base.messages, *made.messages], made.license or base.license)  # fmt: skip
    _check_options(state, alias)
    _store(state, alias)
    if body.get("stream") is False:
        return JSONResponse({"status": "success"})
    return Response("".join(json.dumps({"status": s}) + "\n" for s in _CREATED), media_type="application/x-ndjson")


async def copy(request: Request) -> Response:
    state = server_state(request)
    source, destination = copied(state.parse_body(await request.body()))
    _check_name(state, destination)
    base = _base(state, source)
    _store(state, Alias(destination, base.target, base.parameters, base.system, base.messages, base.license))
    return Response(status_code=200)


async def delete(request: Request) -> Response:
    state = server_state(request)
    body = state.parse_body(await request.body())
    name = wire.model_name({"model": body.get("model") or body.get("name")})  # (the JavaScript library's: name)
    if name in served_names(state):
        raise bad_request(f"model '{name}' is a local file this server serves (--model, --models-dir); only models "
                          "made by /api/create or /api/copy are deleted", "model")  # fmt: skip
    if not state.aliases.delete(name):
        raise APIError(404, f"model '{name}' not found", param="model")
    return Response(status_code=200)


async def push(request: Request) -> Response:
    raise APIError(400, "push: this server has no registry; its models are local files (--model, --models-dir)")


def _check_name(state: ServerState, name: str) -> None:
    if name in served_names(state):
        raise bad_request(f"model '{name}' is a local file this server serves; choose another name", "model")


def _base(state: ServerState, source: str) -> Alias:
    """What a new model starts from: a made model's settings, or a served model's (none); Ollama's 404 for another."""
    alias = state.aliases.get(source)
    if alias is not None:
        return alias
    if source not in served_names(state):
        raise APIError(404, f"model '{source}' not found: a new model is made from one this server serves",
                       param="from")  # fmt: skip
    return Alias(source, source)


def _check_options(state: ServerState, alias: Alias) -> None:
    """The options as ``/api/chat`` would check them: one it would refuse is refused now."""
    entry = state.pool.entry(alias.target)
    limit = entry.max_model_len if entry.max_model_len is not None else 1 << 62
    try:
        wire.options(alias.parameters, limit)
    except APIError as exc:
        raise bad_request(exc.message.replace("options.", "parameters.", 1), "parameters") from None


def _store(state: ServerState, alias: Alias) -> None:
    try:
        state.aliases.put(alias)
    except AliasFull as exc:
        raise APIError(507, str(exc), code="storage_full") from None
    except ValueError as exc:
        raise bad_request(str(exc), "model") from None
    except OSError as exc:
        raise APIError(503, f"the made models cannot be kept: {exc}", code="storage_unavailable") from None
